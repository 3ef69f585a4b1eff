"""The compiled CPU decode step (engine/compiled_decode.py, `compile_decode`): the same tokens as the eager
step, every decode-only step through it, every other step (and any it has no graph for) eager, and far
fewer dispatches per decode step.

The model is a small random one (2 layers, hidden 64) whose weights are drawn wide enough that its greedy
tokens follow the context (at N(0, 0.02) every token repeats the last one, which would hide a wrong
attention): compiling its layer takes seconds, and the engines are made once per module.
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from loraplex.engine import EngineConfig, LLMEngine, SamplingParams
from loraplex.engine.compiled_decode import CompiledDecode
from loraplex.engine.lora.synthetic import SyntheticAdapter
from loraplex.engine.model.config import named_shape
from loraplex.engine.model.loader import LoadedModel, random_model
from loraplex.engine.model.quantize_weights import quantize_model

pytestmark = pytest.mark.slow

ADAPTERS = 3
MAX_NUM_SEQS = 8


def wide_random(quantization: str = "none") -> LoadedModel:
    config = named_shape("tiny")
    model = random_model(config, torch.float32, "cpu", seed=3, max_positions=256)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.25, generator=generator)
    if quantization != "none":
        quantize_model(model, "int4", 32)
    return LoadedModel(model, None, config, "random:tiny (wide)", quantization)


def make_engine(loaded: LoadedModel, compile_decode: bool) -> LLMEngine:
    engine = LLMEngine(
        EngineConfig(
            device="cpu",
            dtype="float32",
            quantization=loaded.quantization,
            num_pages=96,
            max_num_seqs=MAX_NUM_SEQS,
            max_model_len=256,
            compile_decode=compile_decode,
        ),
        loaded=loaded,
    )
    for i in range(ADAPTERS):
        engine.register_adapter(f"a{i}", SyntheticAdapter(engine.base_shape, seed=i, rank=4 * (i + 1)))
    return engine


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return wide_random()


@pytest.fixture(scope="module")
def eager(loaded) -> LLMEngine:
    return make_engine(loaded, compile_decode=False)


@pytest.fixture(scope="module")
def compiled(loaded) -> LLMEngine:
    return make_engine(loaded, compile_decode=True)


def prompts(count: int, offset: int = 0) -> list[list[int]]:
    """Prompts of different lengths, some past a page (16 tokens), so contexts span 1-3 pages."""
    return [[(7 * i + 3 * j + offset) % 500 + 1 for j in range(3 + 9 * i)] for i in range(count)]


def workload() -> tuple[list[list[int]], list[SamplingParams], list[str | None]]:
    """Five requests finishing at different steps (buckets 8, then 4, 2, 1), greedy and seeded, three
    adapters (ranks 4, 8, 12) and the base model."""
    params = [
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=25, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=18, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
    ]
    return prompts(5), params, ["a0", None, "a1", "a2", "a0"]


def test_compiled_decode_gives_the_eager_tokens(eager, compiled) -> None:
    requests, params, adapters = workload()
    want = [o.token_ids for o in eager.generate(requests, params, adapters)]
    step = compiled.runner.compiled
    assert isinstance(step, CompiledDecode)
    before = step.steps
    got = [o.token_ids for o in compiled.generate(requests, params, adapters)]
    assert got == want
    assert len({tuple(t[:8]) for t in want}) == len(want)  # the tokens follow the context
    assert step.steps - before >= 39  # every decode step but the first (mixed with prefills) compiled
    assert step.fallbacks == 0
    assert torch.count_nonzero(compiled.cache.memory[0]) == 0  # the zero page stays zero
    assert compiled.pool.pages_by_kind()["kv"] == 0


def test_steps_outside_the_buckets_run_eagerly_with_the_same_tokens(loaded, eager, compiled) -> None:
    """Prefill and mixed steps never reach the compiled step; a decode step it has no graph for (here:
    warm-up compiled batches of one only) runs eagerly, with the same tokens."""
    requests, params, adapters = workload()
    want = [o.token_ids for o in eager.generate(requests, params, adapters)]
    runner = compiled.runner
    kept = runner.compiled
    assert kept is not None and runner.builder.buckets is not None
    narrow = CompiledDecode(loaded.model, compiled.cache.memory, compiled.config.page_size)
    narrow.warm_up([1], runner.builder.buckets.padding_page, runner.lora.widths(), runner.lora.dtype)
    runner.compiled = narrow
    try:
        got = [o.token_ids for o in compiled.generate(requests, params, adapters)]
    finally:
        runner.compiled = kept
    assert got == want
    assert narrow.fallbacks > 0  # batches of 2 or more: no graph, eager
    assert narrow.steps > 0  # batches of one: compiled

    before = kept.steps
    prefill_only = SamplingParams(max_tokens=1, temperature=0.0)
    compiled.generate(prompts(3, offset=4), prefill_only)
    assert kept.steps == before  # a step with prefills is never the compiled step's


def test_compiled_decode_with_int4_weights_gives_the_eager_tokens() -> None:
    """Weight-only int4 matmuls (torch's CPU kernel) inside the compiled layer."""
    loaded = wide_random("int4")
    requests, params, adapters = workload()
    want = [o.token_ids for o in make_engine(loaded, False).generate(requests, params, adapters)]
    engine = make_engine(loaded, True)
    got = [o.token_ids for o in engine.generate(requests, params, adapters)]
    assert got == want
    assert engine.runner.compiled is not None and engine.runner.compiled.fallbacks == 0


def aten_ops_per_decode_step(engine: LLMEngine, adapters: list[str | None]) -> int:
    """Aten ops dispatched by one decode step's forward of four requests (the profiler's count: a
    dispatch mode would itself change what torch.compile's guards see)."""
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params, adapter=a) for p, a in zip(prompts(4), adapters, strict=True)]
    for _ in range(3):  # prefill, then decodes: stacks and caches warm
        engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as trace:
        engine.step()
    for request_id in ids:
        engine.abort(request_id)
    # Ops that the step's own code dispatched; ops inside them (aten::linear's aten::mm) not again.
    events = [e for e in trace.events() if e.name.startswith("aten::") and e.cpu_parent is None]
    return len(events)


def test_a_compiled_decode_step_dispatches_a_fraction_of_the_eager_ops(eager, compiled) -> None:
    for adapters in ([None] * 4, ["a0", None, "a1", "a2"]):
        eager_ops = aten_ops_per_decode_step(eager, adapters)
        compiled_ops = aten_ops_per_decode_step(compiled, adapters)
        # Eager: some 60 per layer and the step's own (2 layers here, 30 in SmolLM2). Compiled: a few per
        # layer (its weight matmuls are inside the graph's calls) and the step's own.
        assert compiled_ops * 2 < eager_ops, (compiled_ops, eager_ops)


def test_warm_steps_call_the_compiled_graphs_directly(eager, compiled) -> None:
    """After warm-up every graph has a direct entry (batch of one and more, with LoRA and without), and
    warm steps give the eager tokens without torch.compile's entry (here: one that raises)."""
    step = compiled.runner.compiled
    assert isinstance(step, CompiledDecode)
    assert {(one, none) for one, _, none in step._direct} == {
        (True, True),
        (True, False),
        (False, True),
        (False, False),
    }
    requests, params, adapters = workload()
    want = [o.token_ids for o in eager.generate(requests, params, adapters)]

    def no_entry(*args, **kwargs):
        raise AssertionError("torch.compile's entry called on a warm step")

    kept, step._layer = step._layer, no_entry
    try:
        before = step.steps
        got = [o.token_ids for o in compiled.generate(requests, params, adapters)]
    finally:
        step._layer = kept
    assert got == want
    assert step.steps - before >= 39 and step.fallbacks == 0


def _toy_layer(kinds, weights, lora, hidden, delta, cos, sin, memory, layer, tables, lens, shape):
    """decode_layer's signature, a graph small enough to compile in a second."""
    return hidden * weights[0] + delta, delta * 2, tables.sum(1), lens + layer


def test_a_direct_entry_takes_its_inputs_from_the_arguments_and_needs_dynamic_sizes() -> None:
    from loraplex.engine.compiled_decode import _direct_entry, _Entries, _own_copy

    def call_args(batch: int, width: int) -> list:
        return [
            None, (torch.tensor(3.0),), None, torch.randn(batch, 4), torch.randn(batch, 4), None, None, None,
            torch.tensor(1), torch.arange(batch * width).view(batch, width),
            torch.ones(batch, dtype=torch.int64), None,
        ]  # fmt: skip

    for dynamic in (True, False):
        entries = _Entries()  # a code object of its own: a graph of its own
        layer = torch.compile(_own_copy(_toy_layer), backend=entries, fullgraph=True)
        args = call_args(2, 3)
        if dynamic:
            torch._dynamo.maybe_mark_dynamic(args[3], 0)
            torch._dynamo.maybe_mark_dynamic(args[4], 0)
            torch._dynamo.maybe_mark_dynamic(args[9], 0)
            torch._dynamo.maybe_mark_dynamic(args[9], 1)
            torch._dynamo.maybe_mark_dynamic(args[10], 0)
        with torch.inference_mode():
            layer(*args)
            direct = _direct_entry(*entries.graphs[-1], args)
            if not dynamic:  # a graph of batch 2 and width 3 only: no entry that other steps would reach
                assert direct is None
                continue
            assert direct is not None
            other = call_args(5, 4)  # other tensors, other sizes: read from the arguments given
            got, want = direct(other), _toy_layer(*other)
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))

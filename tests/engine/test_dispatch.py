"""What a CUDA graph of the decode step relies on, proven on the CPU under a dispatch counter.

A captured graph replays a fixed list of kernels, and cannot stop for the host. So, with decode steps
graph-ready (`graph_decode="on"`), the step's forward (from the metadata copy to the logits and their
finite flags) must read no device value on the host; two decode steps of the same batch-size bucket
must issue the same ops and Triton launches with the same shapes and grids, whatever their requests;
and the padding that makes them so must not change any request's tokens. The counter is
bench/dispatch.py's (aten ops, Triton launches, host reads).
"""

from __future__ import annotations

import pytest
import torch

from loraplex.bench.dispatch import DispatchCounter, Trace
from loraplex.engine import EngineConfig, LLMEngine, SamplingParams
from loraplex.engine.lora.synthetic import SyntheticAdapter

from .tiny_engines import interpreted_graph_engine

# Aten ops of one SmolLM2 (30 layers) decode step's forward on the torch path, graph-ready: measured
# 1,754 (three base-model decodes), 2,120 with adapters (two of four rows; 1,996 before decode rows took
# their own LoRA matrices in a batched matmul, one op more per adapted projection and 3-6x less time on
# the CPU). The budget leaves a little room, so that a change which adds an op per layer (30 more) or
# more fails here.
FORWARD_OP_BUDGET = 1_780
FORWARD_OP_BUDGET_LORA = 2_150
# Host reads of a whole decode step: one copy of the sampled tokens with the finite flags.
STEP_HOST_READS = 1

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def prompts(count: int, offset: int = 0) -> list[list[int]]:
    """Prompts of different lengths (so different contexts and pages) per request and per offset."""
    return [list(range(100 + offset, 117 + offset + 5 * i)) for i in range(count)]


def decode_trace(engine: LLMEngine, requests: list[list[int]], adapters=None) -> tuple[Trace, Trace]:
    """(forward, whole step) traces of one decode step of `requests`, once all are decoding."""
    names = adapters or [None] * len(requests)
    ids = [engine.add_request(p, GREEDY, adapter=a) for p, a in zip(requests, names, strict=True)]
    scheduler = engine.scheduler
    while scheduler.waiting or any(
        r.num_computed_tokens < len(r.prompt_token_ids) for r in scheduler.running
    ):
        engine.step()
    engine.step()  # a decode step first: adapter stacks and kernel caches are warm
    traces: dict[str, Trace] = {}
    forward = engine.runner.forward

    def counted(chunks, feed=None):
        counter = DispatchCounter()
        with counter as trace:
            result = forward(chunks, feed)
        traces["forward"] = trace
        return result

    engine.runner.forward = counted  # type: ignore[method-assign]
    try:
        with DispatchCounter() as step:
            engine.step()
    finally:
        del engine.runner.forward
        for request_id in ids:
            engine.abort(request_id)
    return traces["forward"], step


@pytest.fixture(scope="module")
def torch_engine(smollm2) -> LLMEngine:
    engine = LLMEngine(
        EngineConfig(device="cpu", dtype="float32", num_pages=160, max_num_seqs=8, graph_decode="on"),
        loaded=smollm2,
    )
    shape = engine.base_shape
    for i in range(2):
        engine.register_adapter(f"a{i}", SyntheticAdapter(shape, seed=i, rank=8))
    return engine


@pytest.fixture(scope="module")
def kernel_engine() -> LLMEngine:
    """The Triton path (interpreted on the CPU) on a 2-layer random model: the launch sequence is the
    same structure per layer as SmolLM2's, at a fraction of the interpreter's time."""
    return interpreted_graph_engine(2)


def test_torch_decode_forward_reads_nothing_on_the_host_and_stays_under_budget(torch_engine) -> None:
    forward, step = decode_trace(torch_engine, prompts(3))
    assert forward.host_reads == []
    assert forward.launches <= FORWARD_OP_BUDGET, forward.by_name().most_common(12)
    assert len(step.host_reads) <= STEP_HOST_READS, step.host_reads

    forward, step = decode_trace(torch_engine, prompts(4, offset=3), adapters=["a0", None, "a1", None])
    assert forward.host_reads == []
    assert forward.launches <= FORWARD_OP_BUDGET_LORA, forward.by_name().most_common(12)
    assert len(step.host_reads) <= STEP_HOST_READS, step.host_reads


def test_kernel_decode_steps_of_one_bucket_issue_the_same_launches(kernel_engine) -> None:
    # 3 and 4 decodes of other prompts, lengths, pages and rows: both bucket 4.
    first, _ = decode_trace(kernel_engine, prompts(3))
    second, _ = decode_trace(kernel_engine, prompts(4, offset=7))
    assert first.host_reads == [] and second.host_reads == []
    launches = sum(name.startswith("triton:") for name, _ in first.ops)
    assert launches > 0
    assert first.kernels() == second.kernels()
    # The counter tells buckets apart: 5 decodes are bucket 8, with other shapes.
    other, _ = decode_trace(kernel_engine, prompts(5))
    assert other.kernels() != first.kernels()
    # With adapters: the same adapter set (the LoRA tables are per adapter set today), other requests.
    first, _ = decode_trace(kernel_engine, prompts(3), adapters=["a0", "a1", None])
    second, _ = decode_trace(kernel_engine, prompts(4, offset=5), adapters=["a1", None, "a0", "a0"])
    assert first.host_reads == [] and second.host_reads == []
    assert sum(name.startswith("triton:") for name, _ in first.ops) > launches  # the LoRA kernels ran
    assert first.kernels() == second.kernels()


def test_padding_changes_no_token_and_leaves_the_zero_page_zero(smollm2, torch_engine) -> None:
    """Greedy and seeded outputs with graph-ready decode equal those without it; page 0 stays zero."""
    plain = LLMEngine(
        EngineConfig(device="cpu", dtype="float32", num_pages=160, max_num_seqs=8, graph_decode="off"),
        loaded=smollm2,
    )
    for i in range(2):
        plain.register_adapter(f"a{i}", SyntheticAdapter(plain.base_shape, seed=i, rank=8))
    params = [
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=7, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
    ]
    adapters = ["a0", None, "a1"]
    # Three requests finishing at different steps: buckets 4, then 2, then 1.
    want = plain.generate(prompts(3), params, adapters)
    got = torch_engine.generate(prompts(3), params, adapters)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert torch_engine.runner.builder.buckets is not None
    assert torch.count_nonzero(torch_engine.cache.memory[0]) == 0
    assert plain.runner.builder.buckets is None

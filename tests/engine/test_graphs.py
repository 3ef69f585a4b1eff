"""Decode steps replayed from captured graphs (engine/graphs.py), proven on the CPU.

The graph backend is CpuGraphBackend: "capture" keeps the step's forward (built on the step's batch,
attention and LoRA objects) and "replay" runs that same callable again on the same static buffers, into
the same output tensor. So when replayed steps give the tokens of eager steps, a replay needed nothing
but what the next step copied into its bucket's buffer: what torch.cuda.CUDAGraph relies on.
"""

from __future__ import annotations

import pytest
import torch

from loraplex.engine import LLMEngine, SamplingParams
from loraplex.engine.graphs import CpuGraphBackend, DecodeGraphs
from loraplex.engine.lora.synthetic import SyntheticAdapter

from .tiny_engines import interpreted_graph_engine


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    """The Triton path (interpreted) on a 2-layer random model, graph-ready decode steps."""
    return interpreted_graph_engine(3)


def prompts(count: int, offset: int = 0) -> list[list[int]]:
    return [list(range(10 + offset, 17 + offset + 3 * i)) for i in range(count)]


def test_replayed_decode_steps_equal_eager_steps(engine: LLMEngine) -> None:
    params = [
        SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=0.9, top_p=0.9, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=7, temperature=0.7, seed=11, ignore_eos=True),
    ]
    adapters = ["a0", None, "a1", "a0"]
    engine.runner.graphs = None
    want = engine.generate(prompts(4), params, adapters)
    backend = CpuGraphBackend()
    graphs = engine.runner.graphs = DecodeGraphs(backend, max_graphs=4)
    try:
        # Requests ending at different steps walk buckets 4, 2 and 1, with changing adapter sets.
        got = engine.generate(prompts(4), params, adapters)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert graphs.stats.replays > 0 and graphs.stats.captures == backend.captures > 0
        # Other requests in the same buckets replay the graphs captured above, with the same outputs.
        replays = graphs.stats.replays
        engine.runner.graphs = None
        want = engine.generate(prompts(4, offset=5), params, adapters)
        engine.runner.graphs = graphs
        got = engine.generate(prompts(4, offset=5), params, adapters)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert graphs.stats.replays > replays
        # Another adapter set in the same bucket and layout: its own graph, not the set above's tables.
        others = ["a2", "a1", None, "a2"]
        engine.runner.graphs = None
        want = engine.generate(prompts(4, offset=2), params, others)
        engine.runner.graphs = graphs
        got = engine.generate(prompts(4, offset=2), params, others)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert len(graphs) <= 4
    finally:
        engine.runner.graphs = None


def test_an_adapter_load_invalidates_the_graphs_that_read_its_tables(engine: LLMEngine) -> None:
    """A new residency version (an adapter loaded or evicted rewrites or reallocates the persistent
    tables) makes the step capture again rather than replay a graph that read the old tables."""
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    graphs = engine.runner.graphs = DecodeGraphs(CpuGraphBackend())
    try:
        engine.generate(prompts(2), [params] * 2, ["a0", None])
        before = graphs.stats.captures
        engine.generate(prompts(2), [params] * 2, ["a0", None])
        assert graphs.stats.captures == before  # same bucket, adapter set, version: replays only
        engine.register_adapter("fresh", SyntheticAdapter(engine.base_shape, seed=9, rank=16))
        engine.generate(prompts(2), [params] * 2, ["fresh", None])  # loads it: the version moves
        version_then = engine.loader.version
        engine.generate(prompts(2), [params] * 2, ["a0", None])
        assert engine.loader.version == version_then
        assert graphs.stats.captures > before + 1  # a0's set captured again under the new version
    finally:
        engine.runner.graphs = None


def test_graphs_are_least_recently_used_and_refuse_bad_settings() -> None:
    calls: list[int] = []

    def step(value: int):
        def fn() -> torch.Tensor:
            calls.append(value)
            return torch.tensor([float(value)])

        return fn

    graphs = DecodeGraphs(CpuGraphBackend(), max_graphs=2)
    assert graphs.run("a", step(1)).item() == 1.0
    assert graphs.run("b", step(2)).item() == 2.0
    out = graphs.run("a", step(99))  # replays a's captured callable, not the new one
    assert out.item() == 1.0 and calls == [1, 2, 1]
    graphs.run("c", step(3))  # evicts b, the least recently used
    assert graphs.stats.evictions == 1 and len(graphs) == 2
    assert graphs.run("b", step(4)).item() == 4.0  # captured afresh
    with pytest.raises(ValueError, match="max_graphs"):
        DecodeGraphs(CpuGraphBackend(), max_graphs=0)

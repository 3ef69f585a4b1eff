"""Engines the graph and dispatch tests share the shape of: cheap enough for the Triton interpreter."""

from __future__ import annotations

from loraplex.engine import EngineConfig, LLMEngine
from loraplex.engine.lora.synthetic import SyntheticAdapter


def interpreted_graph_engine(num_adapters: int) -> LLMEngine:
    """The Triton path (interpreted on the CPU) on a 2-layer random model with graph-ready decode steps
    and adapters a0.. a{num_adapters - 1}: the launch sequence per layer has SmolLM2's structure, at a
    fraction of the interpreter's time."""
    engine = LLMEngine(
        EngineConfig(
            model="random:tiny",
            device="cpu",
            dtype="float32",
            num_pages=96,
            max_num_seqs=8,
            kernels="triton",
            graph_decode="on",
            max_model_len=64,  # narrow block tables: fewer interpreted programs
        )
    )
    for i in range(num_adapters):
        engine.register_adapter(f"a{i}", SyntheticAdapter(engine.base_shape, seed=i, rank=8))
    return engine

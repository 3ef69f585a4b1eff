"""The engine on the Triton kernels gives what it gives on the torch reference ops.

On the CPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before
anything imports Triton), so this checks the engine's wiring of the kernels — tables, segments, the
decode and prefill launches, the KV writes — on every CI run; on a GPU the same test runs them natively.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from loraplex.engine import EngineConfig, LLMEngine, SamplingParams
from loraplex.engine.lora.synthetic import SyntheticAdapter
from loraplex.engine.model.loader import load_model

ADAPTERS = {  # name -> (rank, targets): heterogeneous ranks, different module sets
    "r2-qv": (2, ("q", "v")),
    "r8-all": (8, ("q", "k", "v", "o", "gate", "up", "down")),
    "r5-mlp": (5, ("gate", "down")),
}


def run(
    kernels: str, prompts: list[list[int]], adapters: list[str | None], num_pages: int
) -> list[list[int]]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    loaded = load_model("random:tiny", torch.float32, device, seed=3)
    engine = LLMEngine(
        EngineConfig(
            model="random:tiny", device=device, dtype="float32", num_pages=num_pages, page_size=16,
            max_num_seqs=4, max_batch_tokens=24, kernels=kernels,
        ),
        loaded=loaded,
    )  # fmt: skip
    assert engine.runner.use_kernels == (kernels == "triton")
    base = loaded.config.lora_shape()
    for seed, (name, (rank, targets)) in enumerate(ADAPTERS.items()):
        engine.register_adapter(
            name, SyntheticAdapter(base, seed=seed, rank=rank, targets=targets, strength=1.0)
        )
    preemptions = []
    preempt = engine.scheduler.preempt

    def counted_preempt(request: Any) -> Any:
        preemptions.append(request)
        return preempt(request)

    setattr(engine.scheduler, "preempt", counted_preempt)  # noqa: B010 (shadows the method)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    outputs = engine.generate(prompts, params, adapters=adapters)
    assert engine.pool.pages_by_kind()["kv"] == 0
    if any(adapters):  # the pool is small enough that the run exercises both kinds of pressure
        assert preemptions and engine.stats().adapter_evictions > 0
    return [o.token_ids for o in outputs]


def test_kernels_match_the_reference_ops_with_mixed_adapters_and_preemption() -> None:
    generator = torch.Generator().manual_seed(0)
    lengths = [3, 17, 9, 30, 1, 12, 22, 6]
    prompts = [torch.randint(1, 512, (n,), generator=generator).tolist() for n in lengths]
    names: list[str | None] = [None, "r2-qv", "r8-all", "r5-mlp", "r8-all", None, "r2-qv", "r5-mlp"]
    # 16 pages of 16 tokens: adapters (2 to 9 pages each) and KV compete, so requests are preempted
    # and unused adapters evicted.
    reference = run("torch", prompts, names, num_pages=16)
    kernels = run("triton", prompts, names, num_pages=16)
    assert kernels == reference
    base_only = run("torch", prompts, [None] * len(prompts), num_pages=16)
    assert base_only != reference  # the adapters did change the outputs


def test_triton_on_the_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        EngineConfig(kernels="triton").use_kernels(torch.device("cpu"))
    with pytest.raises(ValueError, match="kernels must be"):
        EngineConfig(kernels="cuda")

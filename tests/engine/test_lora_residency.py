"""Adapter residency bookkeeping on a tiny model: load on demand, hold while used, evict when unused."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplex.adapters import AdapterError
from loraplex.engine import EngineConfig, LLMEngine, SamplingParams

from ..adapters.conftest import TINY, make_peft_adapter


@pytest.fixture(scope="module")
def engine_and_adapters(tmp_path_factory: pytest.TempPathFactory) -> tuple[LLMEngine, dict[str, Path]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("tiny")
    LlamaForCausalLM(LlamaConfig(**TINY)).save_pretrained(root / "base")
    make_peft_adapter(root / "a", seed=1, r=8, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    make_peft_adapter(root / "b", seed=2, r=4, lora_alpha=8, target_modules="all-linear")
    engine = LLMEngine(EngineConfig(model=str(root / "base"), device="cpu", num_pages=8, page_size=16))
    return engine, {"a": root / "a", "b": root / "b"}


def test_load_hold_release_evict(engine_and_adapters) -> None:  # type: ignore[no-untyped-def]
    engine, dirs = engine_and_adapters
    residency = engine.adapters
    for name, path in dirs.items():
        engine.register_adapter(name, path)
    assert engine.pool.pages_by_kind()["adapter"] == 0  # registered is not resident
    assert residency.acquire("a")
    used = engine.pool.pages_by_kind()["adapter"]
    assert used == len(residency.resident["a"].pages) > 0
    with pytest.raises(AdapterError, match="serving requests"):
        engine.register_adapter("a", dirs["a"])
    assert residency.evict_unused(engine.pool.num_pages) == 0  # in use: never evicted
    residency.release("a")
    assert "a" in residency.resident  # unused adapters stay until their pages are wanted
    version = residency.version
    assert residency.evict_unused(engine.pool.num_pages) == used
    assert engine.pool.pages_by_kind()["adapter"] == 0 and residency.version != version


def test_kv_takes_pages_from_unused_adapters(engine_and_adapters) -> None:  # type: ignore[no-untyped-def]
    engine, dirs = engine_and_adapters
    for name, path in dirs.items():
        engine.register_adapter(name, path)
    outputs = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0.0), adapters="b")
    assert len(outputs[0].token_ids) == 2 and "b" in engine.adapters.resident
    # A base request whose KV needs the whole pool: the unused adapter gives way.
    free = engine.pool.num_pages - 1
    engine.generate([[3] * (free * 16 - 12)], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert "b" not in engine.adapters.resident and engine.adapters.stats.evictions >= 1
    assert engine.pool.pages_by_kind() == {"free": free, "kv": 0, "adapter": 0, "reserved": 1}
    with pytest.raises(ValueError, match="not registered"):
        engine.add_request([1, 2], adapter="missing")

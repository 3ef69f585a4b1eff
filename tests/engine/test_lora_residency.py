"""Adapter residency on a tiny model: registry pages and loader copies, hold while used, evict when unused,
unregister drains, prefetch on arrival."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplex.adapters import AdapterError
from loraplex.engine import EngineConfig, LLMEngine, SamplingParams
from loraplex.engine.lora.loader import AdapterLoader
from loraplex.engine.lora.tables import adapter_meta

from ..adapters.conftest import TINY, make_peft_adapter


def assert_tables_follow_residency(loader: AdapterLoader) -> None:
    """The kernels' persistent tables hold exactly the resident adapters, each one's metadata in its
    own column range (what a step's tables point into)."""
    for group, table in loader.tables.groups.items():
        assert set(table.ranges) == {n for n, r in loader.resident.items() if group in r.a_rows}, group
    for name, rows in loader.resident.items():
        for group, meta in adapter_meta(rows, loader.base, loader.head_dim).items():
            table = loader.tables.groups[group]
            start, size = table.ranges[name]
            assert size == meta.rank
            for field in ("a_starts", "b_starts", "b_cols", "b_widths"):
                assert (getattr(table, field)[:, start : start + size] == getattr(meta, field)).all()


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
    registry, loader = engine.registry, engine.loader
    for name, path in dirs.items():
        engine.register_adapter(name, path)
    assert engine.pool.pages_by_kind()["adapter"] == 0  # registered is not resident
    registry.add_user("a")
    assert registry.acquire("a")
    used = engine.pool.pages_by_kind()["adapter"]
    (load,) = registry.pending_loads()  # pages handed out, rows not copied yet
    assert load.name == "a" and len(load.pages) == used > 0 and "a" not in loader.resident
    version = loader.version
    assert loader.load([load]) == [] and loader.version != version
    assert loader.resident["a"].pages == load.pages and not registry.pending_loads()
    assert_tables_follow_residency(loader)
    with pytest.raises(AdapterError, match="serving 1 request"):
        engine.register_adapter("a", dirs["a"])
    assert registry.evict_unused(engine.pool.num_pages) == 0  # in use: never evicted
    registry.release("a")
    registry.remove_user("a")
    assert "a" in registry.resident_names()  # unused adapters stay until their pages are wanted
    version = loader.version
    columns = {g: t.ranges["a"] for g, t in loader.tables.groups.items() if "a" in t.ranges}
    assert registry.evict_unused(engine.pool.num_pages) == used
    assert engine.pool.pages_by_kind()["adapter"] == 0 and loader.version != version
    assert "a" not in loader.resident and "a" in loader.host  # the host copy stays for next time
    assert_tables_follow_residency(loader)
    # The eviction (the scheduler's reclaim, torch-free) wrote nothing on the device: its columns are
    # zeroed by the loader's next call, before any load could be handed them.
    widths = {g: loader.tables.groups[g].b_widths[:, s : s + n] for g, (s, n) in columns.items()}
    assert columns and all(bool(w.any()) for w in widths.values())
    assert loader.load([]) == []
    assert not any(
        bool(loader.tables.groups[g].b_widths[:, s : s + n].any()) for g, (s, n) in columns.items()
    )


def test_kv_takes_pages_from_unused_adapters(engine_and_adapters) -> None:  # type: ignore[no-untyped-def]
    engine, dirs = engine_and_adapters
    for name, path in dirs.items():
        engine.register_adapter(name, path)
    outputs = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0.0), adapters="b")
    assert len(outputs[0].token_ids) == 2 and "b" in engine.registry.resident_names()
    assert_tables_follow_residency(engine.loader)
    # A base request whose KV needs the whole pool: the unused adapter gives way.
    free = engine.pool.num_pages - 1
    engine.generate([[3] * (free * 16 - 12)], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert "b" not in engine.registry.resident_names() and engine.stats().adapter_evictions >= 1
    assert_tables_follow_residency(engine.loader)  # its columns freed with its pages
    # Its full pages stay in the prefix cache, evictable like unused adapters.
    cached = engine.pool.reclaimable_pages()
    assert cached == (free * 16 - 12) // 16
    assert engine.pool.pages_by_kind() == {
        "free": free - cached,
        "kv": 0,
        "prefix": cached,
        "adapter": 0,
        "reserved": 1,
    }
    with pytest.raises(ValueError, match="not registered"):
        engine.add_request([1, 2], adapter="missing")


def test_register_by_uri_checks_the_hash(engine_and_adapters) -> None:  # type: ignore[no-untyped-def]
    from loraplex.adapters.digest import adapter_digest

    engine, dirs = engine_and_adapters
    digest = adapter_digest(dirs["a"])
    manifest = engine.register_adapter("by-uri", dirs["a"].resolve().as_uri(), sha256=digest)
    assert manifest.sha256 == digest
    with pytest.raises(AdapterError, match="expected"):
        engine.register_adapter("wrong-hash", dirs["a"].resolve().as_uri(), sha256="0" * 64)
    assert engine.adapter("wrong-hash") is None
    with pytest.raises(AdapterError, match="not supported"):
        engine.register_adapter("s3", "s3://bucket/adapter")


def test_unregister_drains_then_forgets_pages_and_host_bytes(engine_and_adapters) -> None:  # type: ignore[no-untyped-def]
    """Unregistering refuses new requests at once; the running one finishes with the adapter's weights,
    then its pages and its host copy go, and the name can be registered again."""
    engine, dirs = engine_and_adapters
    engine.register_adapter("other", dirs["a"])
    engine.generate([[1, 2]], SamplingParams(max_tokens=1, temperature=0.0), adapters="other")
    before = engine.stats()
    engine.register_adapter("gone", dirs["b"])
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    expected = engine.generate([[4, 5, 6]], params, adapters="gone")[0].token_ids
    request_id = engine.add_request([4, 5, 6], params, adapter="gone")
    engine.step()
    during = engine.stats()
    pages = engine.registry.pages_of("gone")
    assert during.pages["adapter"] >= pages and during.host_cache_bytes > before.host_cache_bytes
    assert engine.unregister_adapter("gone") is False  # in use: it drains
    assert engine.adapter("gone") is None and engine.stats().adapters_draining == 1
    with pytest.raises(ValueError, match="not registered"):
        engine.add_request([1, 2], adapter="gone")
    with pytest.raises(AdapterError, match="not registered"):
        engine.unregister_adapter("gone")
    finished = {}
    while engine.has_unfinished():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert finished[request_id].token_ids == expected  # served to the end with its own weights
    after = engine.stats()
    assert after.adapters_draining == 0 and "gone" not in engine.registry.resident_names()
    assert after.pages["adapter"] == during.pages["adapter"] - pages
    assert after.host_cache_bytes == before.host_cache_bytes and "gone" not in engine.loader.host
    assert engine.registry.entry("gone") is None and "gone" not in engine.loader.resident
    engine.register_adapter("gone", dirs["b"])  # the name is free again
    assert engine.generate([[4, 5, 6]], params, adapters="gone")[0].token_ids == expected
    assert engine.unregister_adapter("gone") is True  # unused: forgotten at once
    assert engine.unregister_adapter("other") is True


def test_weights_that_vanish_fail_their_requests_only(tmp_path: Path, engine_and_adapters) -> None:  # type: ignore[no-untyped-def]
    import shutil

    engine, dirs = engine_and_adapters
    copy = tmp_path / "fragile"
    shutil.copytree(dirs["a"], copy)
    engine.register_adapter("fragile", copy)
    engine.register_adapter("sound", dirs["b"])
    (copy / "adapter_model.safetensors").write_bytes(b"not safetensors any more")
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    broken = engine.add_request([4, 5, 6], params, adapter="fragile")
    fine = [engine.add_request([7, 8], params, adapter=a) for a in ("sound", None)]
    finished = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    assert finished[broken].finish_reason == "error"
    assert "fragile" in (finished[broken].error or "") and "cannot read" in (finished[broken].error or "")
    assert all(finished[r].finish_reason == "length" and len(finished[r].token_ids) == 3 for r in fine)
    with pytest.raises(ValueError, match="cannot be served"):
        engine.add_request([1], adapter="fragile")
    engine.unregister_adapter("fragile")


def test_synthetic_adapters_are_deterministic_and_change_outputs(engine_and_adapters) -> None:  # type: ignore[no-untyped-def]
    import torch

    from loraplex.engine.lora.synthetic import SyntheticAdapter

    engine, _ = engine_and_adapters
    base = engine.loaded.config.lora_shape()
    one, again = SyntheticAdapter(base, seed=7, rank=5), SyntheticAdapter(base, seed=7, rank=5)
    assert one.manifest == again.manifest
    first, second = one.load(torch.float32), again.load(torch.float32)
    assert all(
        torch.equal(first[k][0], second[k][0]) and torch.equal(first[k][1], second[k][1]) for k in first
    )
    engine.register_adapter(
        "syn", SyntheticAdapter(base, seed=7, rank=5, targets=("q", "down"), strength=2.0)
    )
    logits = engine.next_token_logits([[3, 4, 5, 6]])[0]
    with_adapter = engine.generate(
        [[3, 4, 5, 6]], SamplingParams(max_tokens=1, temperature=0.0, logprobs=5), adapters="syn"
    )[0]
    assert with_adapter.logprobs is not None and len(with_adapter.logprobs[0].top) == 5
    base_top = int(logits.argmax())
    assert with_adapter.logprobs[0].top[0][1] != pytest.approx(float(torch.log_softmax(logits, -1)[base_top]))
    with pytest.raises(ValueError, match="rank"):
        SyntheticAdapter(base, seed=1, rank=0)


def test_max_resident_adapters_caps_the_pool() -> None:
    from loraplex.engine.lora.synthetic import SyntheticAdapter

    capped = LLMEngine(EngineConfig(model="random:tiny", device="cpu", num_pages=32, max_resident_adapters=2))
    base = capped.loaded.config.lora_shape()
    for i in range(4):
        capped.register_adapter(f"r{i}", SyntheticAdapter(base, seed=i, rank=2))
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    outputs = capped.generate([[1, 2, 3]] * 4, params, adapters=[f"r{i}" for i in range(4)])
    assert all(len(o.token_ids) == 2 for o in outputs)
    assert len(capped.registry.resident_names()) <= 2 and capped.stats().adapter_evictions >= 2


def test_adapters_of_queued_requests_are_prefetched() -> None:
    from loraplex.engine.lora.synthetic import SyntheticAdapter

    engine = LLMEngine(
        EngineConfig(model="random:tiny", device="cpu", num_pages=64, max_num_seqs=1, max_batch_tokens=16)
    )
    base = engine.loaded.config.lora_shape()
    for i in range(4):
        engine.register_adapter(f"p{i}", SyntheticAdapter(base, seed=i, rank=3))
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.generate([[1, 2, 3]] * 4, params, adapters=[f"p{i}" for i in range(4)])
    stats = engine.stats()
    # Every adapter's read started when its request was added, none when a step first wanted it.
    assert stats.host_cache_misses == 0 and stats.host_cache_hits + stats.host_cache_waits == 4
    assert engine.loader.host.stats.loads == 4

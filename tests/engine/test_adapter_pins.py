"""Pinned adapters (issue 28 item 5) and the digest a request was routed with (item 2), on a tiny model:
a pin keeps its adapter resident through pool pressure and counts before the KV cache; a pin past the
budget is refused and changes nothing; a request routed with digest D is never run on other weights."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplex.adapters import AdapterError
from loraplex.adapters.digest import adapter_digest
from loraplex.engine import EngineConfig, LLMEngine, SamplingParams
from loraplex.engine.engine import RequestTooLarge
from loraplex.engine.lora.registry import PinRefused
from loraplex.engine.lora.report import adapter_report
from loraplex.wire.errors import AdapterChanged, AdapterUnavailable

from ..adapters.conftest import TINY, make_peft_adapter

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)
PROMPT = [5, 17, 42, 9, 3]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("pins")
    LlamaForCausalLM(LlamaConfig(**TINY)).save_pretrained(root / "base")
    make_peft_adapter(root / "v1", seed=1, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    make_peft_adapter(root / "v2", seed=2, r=8, lora_alpha=16, target_modules="all-linear")
    return {"base": root / "base", "v1": root / "v1", "v2": root / "v2"}


def make_engine(dirs: dict[str, Path], **overrides: object) -> LLMEngine:
    config = {"model": str(dirs["base"]), "device": "cpu", "num_pages": 24, "page_size": 16, **overrides}
    return LLMEngine(EngineConfig(**config))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def engine(dirs: dict[str, Path]) -> LLMEngine:
    return make_engine(dirs)


def tokens(engine: LLMEngine, adapter: str | None) -> list[int]:
    return engine.generate([PROMPT], GREEDY, adapters=adapter)[0].token_ids


def test_a_pinned_adapter_stays_resident_and_counts_first(engine: LLMEngine, dirs: dict[str, Path]) -> None:
    registry = engine.registry
    engine.register_adapter("p", dirs["v1"])
    engine.register_adapter("q", dirs["v2"])
    try:
        assert engine.pin_adapter("p") == "device"
        assert registry.entry("p").resident and engine.adapter("p").pinned  # type: ignore[union-attr]
        assert engine.adapter_view["p"].pinned
        pinned_pages = registry.pages_of("p")
        assert registry.evictable_pages() == 0  # out of eviction's reach from the start
        # Pool pressure: every free page wanted (the KV cache's way of asking) takes unused adapters and
        # cached prefixes, never the pinned one.
        tokens(engine, "q")  # q resident and unused now: evictable
        assert registry.evictable_pages() == registry.pages_of("q")
        registry.evict_unused(engine.pool.num_pages)
        assert registry.entry("p").resident and not registry.entry("q").resident  # type: ignore[union-attr]
        # Used and released, it stays resident and unevictable.
        assert tokens(engine, "p") == tokens(engine, "p")
        assert registry.evictable_pages() == 0
        report = adapter_report(engine.scheduler, registry, engine.loader.host, engine.loader)
        assert report.pinned == 1
        (held,) = [a for a in report.loaded if a.name == "p"]
        assert held.pinned and held.sha256 == adapter_digest(dirs["v1"])
        # Unpinned: an unused adapter like any other, evicted when pages are wanted.
        assert engine.unpin_adapter("p") and not engine.unpin_adapter("p")
        assert registry.evictable_pages() == pinned_pages
        registry.evict_unused(engine.pool.num_pages)
        assert not registry.entry("p").resident  # type: ignore[union-attr]
    finally:
        for name in ("p", "q"):
            engine.unregister_adapter(name)


def test_a_pin_past_the_budget_is_refused_and_changes_nothing(dirs: dict[str, Path]) -> None:
    # 24 pages, 1 reserved, a full context of 128 tokens is 8 (under half the pool): pins may take 15.
    engine = make_engine(dirs)
    registry = engine.registry
    assert registry.pin_budget == 24 - 1 - 128 // 16
    size = engine.loader.pages_for(engine.register_adapter("a0", dirs["v2"]))
    fitting = registry.pin_budget // size
    for i in range(1, fitting + 1):
        engine.register_adapter(f"a{i}", dirs["v2"])
    for i in range(fitting):
        engine.pin_adapter(f"a{i}")
    before = (dict(registry.pinned), engine.pool.pages_by_kind())
    with pytest.raises(PinRefused, match=r"of the 15 pages pins may take \(the pool's 24 pages"):
        engine.pin_adapter(f"a{fitting}")
    assert (dict(registry.pinned), engine.pool.pages_by_kind()) == before
    assert not engine.adapter(f"a{fitting}").pinned  # type: ignore[union-attr]
    # Admission accounts for the pins first: a request at the full context fits the pool beside its own
    # adapter, but not beside the pins too (they hold their pages whatever else runs).
    full = SamplingParams(max_tokens=128 - len(PROMPT), temperature=0.0)
    with pytest.raises(RequestTooLarge, match=f"pinned adapters hold {fitting * size} of the pool"):
        engine.add_request(PROMPT, full, adapter=f"a{fitting}")
    engine.abort(engine.add_request(PROMPT, full, adapter="a0"))  # a pinned one's own pages are counted once
    # Pinning a pinned adapter again is harmless; unregistering one ends its pin and frees its pages.
    assert engine.pin_adapter("a0") == "device"
    assert engine.unregister_adapter("a0") and "a0" not in registry.pinned
    engine.pin_adapter(f"a{fitting}")  # fits now


def test_pins_leave_a_resident_slot_for_unpinned_adapters(dirs: dict[str, Path]) -> None:
    engine = make_engine(dirs, max_resident_adapters=2)
    for name in ("a", "b"):
        engine.register_adapter(name, dirs["v1"])
    engine.pin_adapter("a")
    with pytest.raises(PinRefused, match="max_resident_adapters"):
        engine.pin_adapter("b")
    assert tokens(engine, "b")  # the slot left serves the others


def test_a_request_routed_with_other_weights_than_the_engine_s_fails_closed(
    engine: LLMEngine, dirs: dict[str, Path]
) -> None:
    """Between the gateway's registration and the request's queueing, the name was registered again
    with other weights: the request is refused, naming both digests, and nothing runs on the new ones."""
    d1, d2 = adapter_digest(dirs["v1"]), adapter_digest(dirs["v2"])
    engine.register_adapter("x", dirs["v1"], d1)
    engine.register_adapter("x", dirs["v2"], d2)  # no user yet: replaced
    try:
        with pytest.raises(AdapterChanged, match=f"routed with weights {d1[:16]}.*now serves {d2[:16]}"):
            engine.add_request(PROMPT, GREEDY, adapter="x", adapter_sha256=d1.upper())
        assert isinstance(AdapterChanged("x"), AdapterUnavailable)  # a retry, never a failed adapter
        assert not engine.scheduler.waiting and engine.registry.entry("x").users == 0  # type: ignore[union-attr]
        request_id = engine.add_request(PROMPT, GREEDY, adapter="x", adapter_sha256=d2)
        engine.abort(request_id)
    finally:
        engine.unregister_adapter("x")


def test_a_version_switch_mid_batch_leaves_every_row_on_its_own_version(
    engine: LLMEngine, dirs: dict[str, Path]
) -> None:
    """Requests of two versions run in one batch; the switch (the gateway's next requests naming the
    other version, and a registration of a running version's name with the other's weights) lands while
    they run: every reply is its own version's, as each would be alone."""
    d1, d2 = adapter_digest(dirs["v1"]), adapter_digest(dirs["v2"])
    engine.register_adapter("id:v1", dirs["v1"], d1)
    engine.register_adapter("id:v2", dirs["v2"], d2)
    try:
        alone = {name: tokens(engine, name) for name in ("id:v1", "id:v2")}
        assert alone["id:v1"] != alone["id:v2"]
        long = SamplingParams(max_tokens=8, temperature=0.0)
        first = {
            engine.add_request(PROMPT, long, adapter="id:v1", adapter_sha256=d1): "id:v1",
            engine.add_request(PROMPT, long, adapter="id:v2", adapter_sha256=d2): "id:v2",
        }
        finished: dict[str, list[int]] = {}
        engine.step()  # both prefilled in one batch
        assert {r.adapter for r in engine.scheduler.running} == {"id:v1", "id:v2"}
        # The switch lands: the running version's name cannot be given other weights under its rows...
        with pytest.raises(AdapterError, match="serving 1 request"):
            engine.register_adapter("id:v1", dirs["v2"], d2)
        # ... and requests of the new version join the same batch.
        later = {engine.add_request(PROMPT, long, adapter="id:v2", adapter_sha256=d2): "id:v2"}
        while len(finished) < 3:
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = output.token_ids
        for request_id, name in {**first, **later}.items():
            assert finished[request_id][:4] == alone[name], name
    finally:
        for name in ("id:v1", "id:v2"):
            engine.unregister_adapter(name)

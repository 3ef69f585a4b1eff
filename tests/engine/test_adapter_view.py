"""The registry's view for other threads: an immutable snapshot of the registration facts, replaced by a
new object whenever a registration, a refusal, an unregister or a drained adapter's end changes them, and
left alone by what happens every step (users, acquire, load, release, eviction)."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest

from loraplex.adapters import AdapterError
from loraplex.engine.lora.registry import AdapterRegistry
from loraplex.engine.pool import PagePool
from loraplex.engine.stats import AdapterFacts

SHA_A, SHA_B = "a" * 64, "b" * 64


@dataclass(frozen=True)
class FakeSource:
    """What the registry keeps of a source: its manifest's digest (the weights are the loader's)."""

    sha256: str

    @property
    def manifest(self) -> Any:
        return SimpleNamespace(sha256=self.sha256)


def test_the_view_changes_with_registrations_only() -> None:
    registry = AdapterRegistry(PagePool(16))
    assert dict(registry.view) == {}

    before = registry.view
    registry.register("a", FakeSource(SHA_A), num_pages=4)
    assert registry.view is not before
    assert dict(registry.view) == {"a": AdapterFacts("a", SHA_A, 4, None, False)}
    assert dict(before) == {}  # a snapshot a reader holds never changes under it
    with pytest.raises(TypeError):
        registry.view["b"] = AdapterFacts("b", SHA_B, 1, None, False)

    # Serving it, every step's business, leaves the view as it was: the very same object.
    registered = registry.view
    registry.add_user("a")
    assert registry.acquire("a")
    registry.loaded("a")
    registry.release("a")
    registry.remove_user("a")
    assert registry.evict_unused(registry.pool.num_pages) == 4
    assert registry.view is registered

    # A registration refused (in use) changes nothing either.
    registry.add_user("a")
    with pytest.raises(AdapterError, match="serving 1 request"):
        registry.register("a", FakeSource(SHA_B), num_pages=2)
    assert registry.view is registered

    registry.mark_failed("a", "weights are not finite")
    refused = registry.view
    assert refused is not registered and refused["a"].failed == "weights are not finite"
    assert registered["a"].failed is None

    registry.unregister("a")  # one user left: it drains, still in the view, marked so
    draining = registry.view
    assert draining is not refused and draining["a"].draining and draining["a"].failed is not None
    registry.remove_user("a")  # its last user ends: forgotten
    assert registry.view is not draining and "a" not in registry.view


def test_reregistering_swaps_in_one_complete_view() -> None:
    registry = AdapterRegistry(PagePool(16))
    registry.register("a", FakeSource(SHA_A), num_pages=4)
    registry.register("keep", FakeSource(SHA_B), num_pages=1)
    registry.mark_failed("a", "bad rows")

    same = registry.view
    registry.register("a", FakeSource(SHA_A), num_pages=4)  # the same weights: the same fault
    assert registry.view is not same and registry.view["a"].failed == "bad rows"
    other = registry.view
    registry.register("a", FakeSource(SHA_B), num_pages=2)  # other weights clear it
    assert registry.view is not other
    assert dict(registry.view) == {
        "a": AdapterFacts("a", SHA_B, 2, None, False),
        "keep": AdapterFacts("keep", SHA_B, 1, None, False),
    }

    last = registry.view
    assert registry.unregister("a") is True  # unused: forgotten at once
    assert registry.view is not last and list(registry.view) == ["keep"]

"""The page allocator never leaks a page and never hands one out twice (hypothesis state machine)."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from loraplex.engine.pool import PageKind, PagePool, PoolExhausted


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = PagePool(37)
        self.held: dict[str, list[int]] = {}

    @rule(owner=st.sampled_from(["a", "b", "c", "d"]), count=st.integers(0, 12), adapter=st.booleans())
    def allocate(self, owner: str, count: int, adapter: bool) -> None:
        kind = PageKind.ADAPTER if adapter else PageKind.KV
        if self.pool.can_allocate(count):
            pages = self.pool.allocate(count, owner, kind)
            assert len(pages) == count
            self.held.setdefault(owner, []).extend(pages)
        else:
            with pytest.raises(PoolExhausted):
                self.pool.allocate(count, owner, kind)

    @precondition(lambda self: any(self.held.values()))
    @rule(data=st.data())
    def free_some(self, data: st.DataObject) -> None:
        owner = data.draw(st.sampled_from(sorted(o for o, p in self.held.items() if p)))
        pages = self.held[owner]
        count = data.draw(st.integers(1, len(pages)))
        chosen = data.draw(st.permutations(pages))[:count]
        self.pool.free(chosen, owner)
        for page in chosen:
            pages.remove(page)

    @precondition(lambda self: any(self.held.values()))
    @rule(data=st.data())
    def free_by_wrong_owner_is_refused(self, data: st.DataObject) -> None:
        owner = data.draw(st.sampled_from(sorted(o for o, p in self.held.items() if p)))
        page = self.held[owner][0]
        with pytest.raises(ValueError, match="not owned"):
            self.pool.free([page], owner + "-other")

    @invariant()
    def every_page_is_free_or_owned_once(self) -> None:
        owned = [p for pages in self.held.values() for p in pages]
        assert len(owned) == len(set(owned)), "a page is owned twice"
        free = set(self.pool._free)
        assert len(free) == len(self.pool._free), "a page is free twice"
        assert not free & set(owned), "a page is both free and owned"
        assert free | set(owned) == set(range(self.pool.num_pages)), "a page leaked"
        counts = self.pool.pages_by_kind()
        assert counts["free"] + counts["kv"] + counts["adapter"] == self.pool.num_pages
        for owner, pages in self.held.items():
            assert all(self.pool.owner_of(p) == owner for p in pages)


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_double_free_is_refused() -> None:
    pool = PagePool(4)
    pages = pool.allocate(2, "r")
    pool.free(pages, "r")
    with pytest.raises(ValueError, match="not owned"):
        pool.free(pages[:1], "r")
    assert pool.num_free == 4


def test_pool_must_have_pages() -> None:
    with pytest.raises(ValueError, match="at least one page"):
        PagePool(0)

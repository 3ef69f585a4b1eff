"""The adapter host cache: LRU within a byte budget, background prefetch, failures surfaced."""

from __future__ import annotations

import threading

import pytest
import torch

from loraplex.adapters import AdapterError
from loraplex.engine.lora.host_cache import HostCache, packed_bytes
from loraplex.engine.lora.layout import PackedAdapter


def packed(rows: int) -> PackedAdapter:
    return PackedAdapter(
        num_rows=rows,
        data=torch.zeros(rows, 8),
        data_rows=torch.arange(rows),
        a_rows={},
        b_rows={},
    )


def test_least_recently_used_goes_first_when_over_budget() -> None:
    size = packed_bytes(packed(4))
    cache = HostCache(budget_bytes=2 * size)
    for name in ("a", "b"):
        cache.get(name, lambda: packed(4))
    cache.get("a", lambda: pytest.fail("a is cached"))  # touch a: b is now the oldest
    cache.get("c", lambda: packed(4))
    assert "a" in cache and "c" in cache and "b" not in cache
    assert cache.bytes_used <= 2 * size
    assert cache.stats.hits == 1 and cache.stats.misses == 3 and cache.stats.evictions == 1


def test_an_adapter_bigger_than_the_budget_is_still_handed_out() -> None:
    cache = HostCache(budget_bytes=1)
    got = cache.get("huge", lambda: packed(64))
    assert got.num_rows == 64 and "huge" in cache  # kept until the next one needs the room
    cache.get("next", lambda: packed(2))
    assert "huge" not in cache


def test_prefetch_loads_in_the_background_and_get_waits_for_it() -> None:
    cache = HostCache(budget_bytes=1 << 20)
    started, release = threading.Event(), threading.Event()

    def slow() -> PackedAdapter:
        started.set()
        release.wait(5)
        return packed(3)

    cache.prefetch("slow", slow)
    assert started.wait(5) and not cache.ready("slow")
    cache.prefetch("slow", lambda: pytest.fail("already on its way"))
    release.set()
    assert cache.get("slow", lambda: pytest.fail("prefetched")).num_rows == 3
    assert cache.stats.loads == 1
    cache.close()


def test_a_failed_load_raises_and_is_retried_next_time() -> None:
    cache = HostCache(budget_bytes=1 << 20)
    attempts = []

    def broken() -> PackedAdapter:
        attempts.append(1)
        raise AdapterError("weights are gone")

    cache.prefetch("x", broken)
    with pytest.raises(AdapterError, match="gone"):
        cache.get("x", broken)
    with pytest.raises(AdapterError, match="gone"):
        cache.get("x", broken)
    assert len(attempts) >= 2 and cache.stats.failures == len(attempts) and "x" not in cache


def test_budget_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        HostCache(budget_bytes=0)


def test_a_failed_prefetch_is_reported_to_the_next_get_once() -> None:
    """A prefetch that fails leaves its error for the get that wanted the adapter (the store outage or
    bad weights are that request's answer), and the get after it reads again."""
    cache = HostCache(budget_bytes=1 << 20)
    outcomes = [AdapterError("the store is down"), packed(2)]

    def flaky() -> PackedAdapter:
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    cache.prefetch("x", flaky)
    with pytest.raises(AdapterError, match="down"):
        cache.get("x", flaky)
    assert cache.get("x", flaky).num_rows == 2 and not outcomes
    assert (cache.stats.waits, cache.stats.misses, cache.stats.failures) == (1, 1, 1)
    cache.close()


def test_discard_while_a_prefetch_is_in_flight_keeps_nothing() -> None:
    cache = HostCache(budget_bytes=1 << 20)
    started, release = threading.Event(), threading.Event()

    def slow() -> PackedAdapter:
        started.set()
        release.wait(5)
        return packed(3)

    cache.prefetch("gone", slow)
    assert started.wait(5)
    cache.discard("gone")  # unregistered while its read was running
    release.set()
    cache.close()  # waits for the worker: the pack finished and was dropped
    assert "gone" not in cache and cache.bytes_used == 0 and cache.stats.loads == 1


def test_background_packing_uses_one_intra_op_thread_and_leaves_the_callers_alone() -> None:
    """A prefetch's torch ops run on one intra-op thread: a second OpenMP team as wide as the model's
    slows every later step of the main thread on a small CPU (docs/benchmarks.md)."""
    callers = torch.get_num_threads()
    cache = HostCache(budget_bytes=1 << 20)
    seen: list[int] = []

    def pack() -> PackedAdapter:
        seen.append(torch.get_num_threads())
        return packed(2)

    cache.prefetch("a", pack)
    assert cache.get("a", lambda: pytest.fail("prefetched")).num_rows == 2
    cache.close()
    assert seen == [1]
    assert torch.get_num_threads() == callers

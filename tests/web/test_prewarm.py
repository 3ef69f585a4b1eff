"""The gateway's prewarm (web/services/prewarm.py): pods a replica-set change adds are warmed in the
background and tried after the warm ones, with the pods the adapter moved from as the fallback between."""

from __future__ import annotations

import asyncio

import pytest

from loraplex import wire
from loraplex.web.services.prewarm import Prewarmer
from loraplex.web.services.routing import Change, PlacementPolicy, Router
from loraplex.web.services.warming import Warming

KEY = "adapter:" + "a" * 64
TENANT_A = wire.AdapterRef("11111111-1111-1111-1111-111111111111", "s3://store/a", "a" * 64)
TENANT_B = wire.AdapterRef("22222222-2222-2222-2222-222222222222", "s3://store/b", "a" * 64)


class Engines:
    """Prewarm calls, each held until the test lets it answer (or fail)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.gate = asyncio.Event()
        self.fail: set[str] = set()

    async def post(self, pod: str, ref: wire.AdapterRef) -> None:
        self.calls.append((pod, ref.name))
        await self.gate.wait()
        if pod in self.fail:
            raise ConnectionError(f"{pod} refused")


def change(added: tuple[str, ...], removed: tuple[str, ...] = (), reason: str = "grew") -> Change:
    members = ("p1", *added) if reason == "grew" else added
    return Change(pool="d", key=KEY, members=members, added=added, removed=removed, reason=reason)


def run(test: object) -> None:
    asyncio.run(test())  # type: ignore[operator]


def test_a_grown_member_is_tried_last_until_it_is_warm() -> None:
    async def test() -> None:
        engines = Engines()
        warm = Prewarmer(engines.post)
        warm.remember(KEY, TENANT_A)
        warm.remember(KEY, TENANT_B)  # two tenants' adapters with one digest: each registered there
        warm.on_change(change(("p2",)))
        await asyncio.sleep(0)
        assert warm.warming("p2", KEY)
        assert warm.arrange(KEY, ["p2", "p1"], {"p1", "p2"}) == ["p1", "p2"]
        engines.gate.set()
        await warm.settle()
        assert engines.calls == [("p2", TENANT_B.name), ("p2", TENANT_A.name)]
        assert not warm.warming("p2", KEY) and warm.warmed == 1
        assert warm.arrange(KEY, ["p2", "p1"], {"p1", "p2"}) == ["p2", "p1"]  # by load again

    run(test)


def test_a_moved_adapter_is_served_where_it_was_until_its_new_pod_is_warm() -> None:
    async def test() -> None:
        engines = Engines()
        warm = Prewarmer(engines.post)
        warm.remember(KEY, TENANT_A)
        warm.on_change(change(("p3",), removed=("p1",), reason="pods"))  # p3 joined and ranks first
        await asyncio.sleep(0)
        assert warm.arrange(KEY, ["p3"], {"p1", "p3"}) == ["p1", "p3"]
        assert warm.arrange(KEY, ["p3"], {"p3"}) == ["p3"]  # p1 is gone: nothing better than a cold p3
        engines.gate.set()
        await warm.settle()
        assert warm.arrange(KEY, ["p3"], {"p1", "p3"}) == ["p3"]

    run(test)


def test_a_pod_that_cannot_be_warmed_is_served_cold_as_without_prewarm() -> None:
    async def test() -> None:
        engines = Engines()
        engines.fail.add("p2")
        warm = Prewarmer(engines.post)
        warm.remember(KEY, TENANT_A)
        warm.on_change(change(("p2",)))
        engines.gate.set()
        await warm.settle()
        assert (warm.warmed, warm.failed) == (0, 1)
        assert warm.arrange(KEY, ["p2", "p1"], {"p1", "p2"}) == ["p2", "p1"]

    run(test)


@pytest.mark.parametrize("reason", ["placed"])
def test_nothing_is_warmed_for_a_first_placement_or_an_unknown_adapter(reason: str) -> None:
    async def test() -> None:
        engines = Engines()
        warm = Prewarmer(engines.post)
        warm.on_change(change(("p2",)))  # never routed here: nothing to register
        warm.remember(KEY, TENANT_A)
        warm.on_change(Change("d", KEY, ("p1",), ("p1",), (), reason))  # its request loads it
        await asyncio.sleep(0)
        assert engines.calls == [] and not warm.warming("p1", KEY)

    run(test)


def test_remembered_adapters_are_bounded() -> None:
    warm = Prewarmer(Engines().post, max_remembered=3)
    for i in range(10):
        warm.remember(f"adapter:{i}", TENANT_A)
    assert list(warm._refs) == ["adapter:7", "adapter:8", "adapter:9"]


def test_the_router_sends_a_flood_to_a_grown_pod_only_once_it_is_warm() -> None:
    async def test() -> None:
        engines = Engines()
        warm = Prewarmer(engines.post)
        router = Router(cooldown_s=5, policy=PlacementPolicy(saturation=2), clock=lambda: 0.0)
        router.subscribe(warm.on_change)
        router.arrange = warm.arrange
        pods = ["http://a", "http://b", "http://c"]
        warm.remember(KEY, TENANT_A)
        first = router.order(KEY, pods)[0]
        works = [router.begin(first, KEY) for _ in range(2)]  # its one member is saturated
        grown_order = router.order(KEY, pods)
        await asyncio.sleep(0)
        (grown,) = [p for p in router.replica_set(KEY, pods) if p != first]
        assert warm.warming(grown, KEY) and engines.calls == [(grown, TENANT_A.name)]
        assert grown_order[:2] == [first, grown]  # the busy member still first: the new one is cold
        engines.gate.set()
        await warm.settle()
        assert router.order(KEY, pods)[0] == grown  # warm and idle: the least loaded member now
        for work in works:
            work.done()

    run(test)


class Pods:
    """Discovery's view of one kubernetes:// deployment: its ready pods and those leaving (still serving)."""

    def __init__(self, ready: list[str]):
        self.ready, self.leaving_pods = list(ready), []  # type: ignore[var-annotated]

    def expand(self, endpoints: list[str]) -> list[str]:
        return list(self.ready)

    def leaving(self, endpoints: list[str]) -> list[str]:
        return list(self.leaving_pods)

    def delete(self, pod: str) -> None:  # a scale-in: Ready off, still serving through its preStop
        self.ready.remove(pod)
        self.leaving_pods.append(pod)


def test_a_scaled_in_pod_serves_its_adapters_until_their_new_pod_is_warm() -> None:
    async def test() -> None:
        engines = Engines()
        warm = Prewarmer(engines.post)
        pods = Pods(["http://a", "http://b", "http://c"])
        router = Router(cooldown_s=5, discovery=pods, clock=lambda: 0.0)  # type: ignore[arg-type]
        router.subscribe(warm.on_change)
        router.arrange = warm.arrange
        deployment = ["kubernetes://ns/engines"]
        warm.remember(KEY, TENANT_A)
        holder = router.order(KEY, deployment)[0]
        pods.delete(holder)
        order = router.order(KEY, deployment)
        await asyncio.sleep(0)
        (successor,) = router.replica_set(KEY, deployment)
        assert successor != holder and warm.warming(successor, KEY)
        assert order[:2] == [holder, successor]  # the leaving pod still holds it: no cold load
        engines.gate.set()
        await warm.settle()
        assert router.order(KEY, deployment)[0] == successor
        pods.leaving_pods.clear()  # gone: nothing refers to it any more
        assert holder not in router.order(KEY, deployment)

    run(test)


def test_the_bookkeeping_alone_needs_no_event_loop() -> None:
    # The same object bench cluster drives on simulated pods: started/finished, no asyncio.
    state = Warming()
    assert state.on_change(change(("p2",), reason="placed")) == ()
    assert state.on_change(change(("p3",), removed=("p1",), reason="pods")) == ("p3",)
    state.started("p3", KEY)
    assert state.on_change(change(("p3",), reason="pods")) == ()  # already warming: not twice
    assert state.in_flight() == [("p3", KEY)]
    assert state.arrange(KEY, ["p3"], {"p1", "p3"}) == ["p1", "p3"]
    state.finished("p3", KEY, ok=False)
    assert (state.warmed, state.failed) == (0, 1) and not state.warming("p3", KEY)
    assert state.arrange(KEY, ["p3"], {"p1", "p3"}) == ["p3"]  # served cold, as without prewarm
    state.finished("p3", KEY, ok=True)  # a late second answer changes nothing
    assert (state.warmed, state.failed) == (0, 1)


def test_a_set_waits_for_its_warming_member_before_growing_again() -> None:
    state = Warming()
    router = Router(cooldown_s=5, policy=PlacementPolicy(saturation=2), clock=lambda: 0.0)
    router.arrange = state.arrange

    def changed(c: Change) -> None:
        for pod in state.on_change(c):
            state.started(pod, c.key)

    router.subscribe(changed)
    pods = ["http://a", "http://b", "http://c", "http://d"]
    first = router.order(KEY, pods)[0]
    works = [router.begin(first, KEY) for _ in range(4)]
    assert router.order(KEY, pods)[0] == first  # grew, and the new member warms: the old one serves
    (grown,) = [p for p in router.replica_set(KEY, pods) if p != first]
    works += [router.begin(first, KEY) for _ in range(4)]
    router.order(KEY, pods)
    assert router.replica_set(KEY, pods) == (first, grown)  # not a third while the second warms
    state.finished(grown, KEY, ok=True)
    assert router.order(KEY, pods)[0] == grown
    for work in works:
        work.done()

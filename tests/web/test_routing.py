"""Placement with replication by demand and load-aware picks (web/services/routing.py), on a fake clock and
a load signal the test sets: stable, bounded, deterministic, grows under load, shrinks when cool."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplex.web.services.routing import (
    Change,
    Combined,
    EngineMetrics,
    Outstanding,
    Placement,
    PlacementPolicy,
    Router,
    rendezvous_order,
)

PODS = [f"http://10.0.0.{i}:8000" for i in range(8)]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Loads:
    """A load signal the test writes."""

    def __init__(self) -> None:
        self.pods: dict[str, float] = {}
        self.keys: dict[str, float] = {}

    def load(self, endpoint: str) -> float:
        return self.pods.get(endpoint, 0.0)

    def demand(self, key: str) -> float:
        return self.keys.get(key, 0.0)


def router(policy: PlacementPolicy | None = None, **kw: object) -> tuple[Router, Clock, Loads]:
    clock, loads = Clock(), Loads()
    made = Router(
        60.0,
        policy=policy or PlacementPolicy(saturation=4, cool_s=10, idle_s=100),
        load=loads,
        clock=clock,
        rng=random.Random(0),
        **kw,  # type: ignore[arg-type]
    )
    return made, clock, loads


def test_a_quiet_adapter_goes_to_its_rendezvous_pod_like_before() -> None:
    r, _, _ = router()
    for i in range(50):
        key = f"adapter:{i}"
        assert r.order(key, PODS)[0] == rendezvous_order(key, PODS)[0]
        assert r.replica_set(key, PODS) == (rendezvous_order(key, PODS)[0],)


def test_least_loaded_member_is_picked() -> None:
    r, _, loads = router()
    key = "adapter:hot"
    first, second, third = rendezvous_order(key, PODS)[:3]
    loads.keys[key] = 4
    loads.pods[first] = 4  # saturated: the set grows to the next pod with room
    assert r.order(key, PODS)[0] == second
    assert r.replica_set(key, PODS) == (first, second)
    for pod in PODS:  # the rest of the pool as busy as the set: no pressure to grow further
        loads.pods[pod] = 3
    loads.pods[first], loads.pods[second] = 1, 3
    assert r.order(key, PODS)[:2] == [first, second]
    loads.pods[first], loads.pods[second] = 3, 1
    assert r.order(key, PODS)[:2] == [second, first]
    assert third not in r.replica_set(key, PODS)


def test_the_set_grows_under_load_and_shrinks_when_cool() -> None:
    r, clock, loads = router()
    key = "adapter:hot"
    ranked = rendezvous_order(key, PODS)
    changes: list[Change] = []
    r.subscribe(changes.append)
    for size in range(1, 5):  # each time every member is saturated, one more pod joins
        for pod in ranked[:size]:
            loads.pods[pod] = 4
        loads.keys[key] = 4 * size
        r.order(key, PODS)
        assert r.replica_set(key, PODS) == tuple(ranked[: size + 1])
    assert [c.reason for c in changes] == ["placed", "grew", "grew", "grew", "grew"]
    assert changes[-1].added == (ranked[4],) and changes[-1].removed == ()

    loads.pods.clear()
    loads.keys[key] = 1  # demand for one pod: after cool_s, one member leaves per cool_s
    r.order(key, PODS)
    clock.now += 9.9
    r.order(key, PODS)
    assert len(r.replica_set(key, PODS)) == 5
    for expected in (4, 3, 2, 1):
        clock.now += 10.0
        r.order(key, PODS)
        assert r.replica_set(key, PODS) == tuple(ranked[:expected])
    assert changes[-1].reason == "shrank" and changes[-1].removed == (ranked[1],)


def test_a_set_does_not_grow_into_a_busy_pod() -> None:
    r, _, loads = router()
    key = "adapter:x"
    loads.keys[key] = 4
    for pod in PODS:
        loads.pods[pod] = 3.9  # less than spread (0.05 of saturation 4) below the member's 4 everywhere
    first, second = rendezvous_order(key, PODS)[:2]
    loads.pods[first] = 4
    r.order(key, PODS)
    assert len(r.replica_set(key, PODS)) == 1
    loads.pods[second] = 3.5  # now it has room
    r.order(key, PODS)
    assert r.replica_set(key, PODS) == (first, second)


def test_a_quiet_adapter_on_a_busy_pod_waits_there() -> None:
    # Its one request would be a cold load elsewhere; the busy adapters are the ones that spread.
    r, _, loads = router()
    key = "adapter:quiet"
    loads.pods[rendezvous_order(key, PODS)[0]] = 8
    loads.keys[key] = 1  # one request: below per_member (grow_share of saturation, at least 2)
    assert r.order(key, PODS)[0] == rendezvous_order(key, PODS)[0]
    assert len(r.replica_set(key, PODS)) == 1


def test_idle_adapters_give_their_place_up() -> None:
    r, clock, _ = router()
    changes: list[Change] = []
    r.subscribe(changes.append)
    r.order("adapter:a", PODS, 10)
    held = r.replica_set("adapter:a", PODS)
    clock.now += 100.0
    r.order("adapter:b", PODS, 10)  # any request sweeps the idle ones
    assert r.replica_set("adapter:a", PODS) == ()
    assert [(c.key, c.reason, c.removed) for c in changes] == [
        ("adapter:a", "placed", ()),
        ("adapter:a", "idle", held),
        ("adapter:b", "placed", ()),
    ]
    placement = r.placement(PODS)
    assert sum(placement.assigned_bytes(p) for p in PODS) == 10


def test_base_model_requests_go_to_the_least_loaded_pod() -> None:
    r, _, loads = router()
    for i, pod in enumerate(PODS):
        loads.pods[pod] = 10 - i
    assert r.order(None, PODS)[0] == PODS[-1]
    # Equal loads: spread, not always the same pod.
    loads.pods.clear()
    assert len({r.order(None, PODS)[0] for _ in range(64)}) > 4


def test_resting_pods_come_last_and_members_fail_over_in_hrw_order() -> None:
    r, _, _ = router()
    key = "adapter:1"
    ranked = rendezvous_order(key, PODS)
    r.mark_down(ranked[0])
    assert r.order(key, PODS) == [*ranked[1:], ranked[0]]
    r.mark_up(ranked[0])
    assert r.order(key, PODS) == ranked


def test_capacity_bounds_what_a_pod_is_assigned() -> None:
    r, _, _ = router(PlacementPolicy(saturation=4, pod_adapter_bytes=100))
    placement = r.placement(PODS)
    for i in range(100):
        r.order(f"adapter:{i}", PODS, 30)  # 3 fit a pod: 8 pods hold 24
    assert all(placement.assigned_bytes(p) <= 100 for p in PODS)
    assert len(placement.sets()) == 24 and placement.overflows == 76
    # An adapter with no room anywhere is still served, by plain rendezvous.
    assert r.order("adapter:99", PODS, 30)[0] == rendezvous_order("adapter:99", PODS)[0]


def test_outstanding_counts_in_and_out() -> None:
    counts = Outstanding()
    a = counts.begin("p", "adapter:x", 10)
    b = counts.begin("p", None, 5)
    assert counts.load("p") == 2 and counts.demand("adapter:x") == 1 and counts.tokens["p"] == 15
    a.done()
    a.done()  # idempotent: a stream's close and an error path may both end it
    b.done()
    assert counts.requests == {} and counts.tokens == {} and counts.by_key == {}


def test_engine_metrics_signal_reads_the_protocol_series() -> None:
    scraped = EngineMetrics()
    scraped.observe_text(
        "p",
        "# TYPE vllm:num_requests_waiting gauge\n"
        'vllm:num_requests_waiting{model_name="m"} 3\n'
        'vllm:num_requests_running{model_name="m a"} 5.0 1700000000\n'
        "vllm:num_requests_waiting_other 100\n",
    )
    assert scraped.load("p") == 8
    local = Outstanding()
    local.begin("p", None)
    both = Combined(local, scraped)
    assert both.load("p") == 8 and both.load("q") == 0
    with pytest.raises(ValueError, match="finite"):
        scraped.observe("p", float("nan"), 0)


def test_policy_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="saturation"):
        PlacementPolicy(saturation=0)
    with pytest.raises(ValueError, match="room"):
        PlacementPolicy(room=1.5)


# -- properties -----------------------------------------------------------------------------------------


def _placed(pods: list[str], keys: list[str], capacity: int = 0) -> dict[str, tuple[str, ...]]:
    placement = Placement(PlacementPolicy(pod_adapter_bytes=capacity), clock=lambda: 0.0)
    placement.set_pods(pods)
    for key in keys:
        placement.place(key, 1)
    return placement.sets()


@settings(max_examples=25, deadline=None)
@given(n=st.integers(4, 16), seed=st.integers(0, 1000))
def test_adding_or_removing_a_pod_moves_about_one_in_n(n: int, seed: int) -> None:
    pods = [f"http://pod-{seed}-{i}" for i in range(n)]
    keys = [f"adapter:{seed}:{i}" for i in range(600)]
    placement = Placement(PlacementPolicy(), clock=lambda: 0.0)
    placement.set_pods(pods)
    for key in keys:
        placement.place(key, 1)
    before = placement.sets()
    placement.set_pods([*pods, "http://new"])
    grown = placement.sets()
    moved = [k for k in keys if grown[k] != before[k]]
    assert all(grown[k] == ("http://new",) for k in moved)  # only to the new pod
    assert len(moved) < 2.5 * len(keys) / (n + 1)
    placement.set_pods(pods[1:])
    shrunk = placement.sets()
    moved = [k for k in keys if shrunk[k] != before[k]]
    assert {before[k][0] for k in moved} <= {pods[0]}  # only the removed pod's adapters move
    assert len(moved) < 2.5 * len(keys) / n


@settings(max_examples=40, deadline=None)
@given(
    pods=st.integers(1, 6),
    capacity=st.integers(1, 50),
    ops=st.lists(
        st.tuples(st.sampled_from(["req", "tick", "pods", "hot"]), st.integers(0, 30), st.integers(0, 20)),
        max_size=60,
    ),
)
def test_no_pod_is_assigned_more_than_it_holds(
    pods: int, capacity: int, ops: list[tuple[str, int, int]]
) -> None:
    r, clock, loads = router(PlacementPolicy(saturation=2, cool_s=5, idle_s=20, pod_adapter_bytes=capacity))
    pool = [f"http://p{i}" for i in range(pods)]
    for op, a, b in ops:
        if op == "req":
            r.order(f"adapter:{a}", pool, b)
        elif op == "tick":
            clock.now += b
        elif op == "pods":
            pool = [f"http://p{i}" for i in range(a % 7, a % 7 + 1 + b % 6)]
        else:
            loads.pods = {p: 2.0 for p in pool[: b % (len(pool) + 1)]}
        placement = r.placement(pool)
        used: dict[str, int] = {}
        for key, members in placement.sets().items():
            assert members and len(set(members)) == len(members)
            size = placement._adapters[key].size
            for pod in members:
                used[pod] = used.get(pod, 0) + size
        for pod in placement.pods:
            assert placement.assigned_bytes(pod) == used.get(pod, 0) <= capacity


@settings(max_examples=40, deadline=None)
@given(
    budgets=st.lists(st.one_of(st.none(), st.integers(0, 50)), min_size=4, max_size=4),
    ops=st.lists(
        st.tuples(st.sampled_from(["req", "budget", "hot"]), st.integers(0, 30), st.integers(0, 60)),
        max_size=60,
    ),
)
def test_a_budget_that_changes_is_never_exceeded_once_refit(
    budgets: list[int | None], ops: list[tuple[str, int, int]]
) -> None:
    # Budgets as engines report them over time (None: none reported, unbounded); each change is followed
    # by Router.refit, as engine_load.py does.
    pool = [f"http://p{i}" for i in range(4)]
    reported = dict(zip(pool, budgets, strict=True))
    r, _, loads = router(PlacementPolicy(saturation=2, cool_s=5, idle_s=20), capacity=reported.get)
    for op, a, b in ops:
        if op == "req":
            r.order(f"adapter:{a}", pool, b % 20)
        elif op == "budget":
            reported[pool[a % 4]] = None if b > 50 else b
            r.refit(pool[a % 4])
        else:
            loads.pods = {p: 2.0 for p in pool[: b % 5]}
        placement = r.placement(pool)
        for pod in pool:
            budget = reported[pod]
            assert budget is None or placement.assigned_bytes(pod) <= budget


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_two_instances_given_the_same_inputs_agree(seed: int) -> None:
    events = random.Random(seed)
    script = [
        (events.choice(["req", "tick", "load", "pods"]), events.randrange(40), events.random())
        for _ in range(300)
    ]

    def run() -> tuple[dict[str, tuple[str, ...]], list[Change]]:
        r, clock, loads = router(PlacementPolicy(saturation=3, cool_s=4, idle_s=30, pod_adapter_bytes=500))
        changes: list[Change] = []
        r.subscribe(changes.append)
        pool = PODS
        for op, n, x in script:
            if op == "req":
                r.order(f"adapter:{n}", pool, 10 + n)
            elif op == "tick":
                clock.now += x * 5
            elif op == "load":
                loads.pods[PODS[n % 8]] = 6 * x
                loads.keys[f"adapter:{n}"] = 10 * x
            else:
                pool = PODS[: 2 + n % 7]
        return r.placement(pool).sets(), changes

    assert run() == run()


def test_sets_are_prefixes_of_the_hrw_order_when_nothing_is_busy() -> None:
    sets = _placed(PODS, [f"adapter:{i}" for i in range(100)])
    for key, members in sets.items():
        assert members == tuple(rendezvous_order(key, PODS)[: len(members)])


def test_a_burst_spreads_before_its_pod_saturates() -> None:
    # A member far busier than the pool's least-loaded pod (surge: a quarter of saturation) is crowded
    # though under saturation: the set grows while the burst ramps, before a queue forms on its pod.
    r, _, loads = router()
    key = "adapter:burst"
    first, second = rendezvous_order(key, PODS)[:2]
    loads.keys[key] = 2
    loads.pods[first] = 2  # half of saturation 4; every other pod idle
    assert r.order(key, PODS)[0] == second
    assert r.replica_set(key, PODS) == (first, second)
    # The same member in a pool as busy as it is has no one to hand work to: it stays alone.
    r2, _, loads2 = router()
    loads2.keys[key] = 2
    for pod in PODS:
        loads2.pods[pod] = 1.5
    loads2.pods[first] = 2
    assert r2.order(key, PODS)[0] == first and r2.replica_set(key, PODS) == (first,)


def test_a_set_that_shrank_does_not_grow_back_on_the_same_inputs() -> None:
    r, clock, loads = router()
    key = "adapter:warm"
    first, second = rendezvous_order(key, PODS)[:2]
    loads.keys[key], loads.pods[first] = 4, 4
    r.order(key, PODS)
    assert r.replica_set(key, PODS) == (first, second)
    for pod in PODS:  # a calm pool; the adapter's demand fits in its first pod
        loads.pods[pod] = 1.8
    loads.keys[key], loads.pods[first] = 2, 2
    for _ in range(4):
        r.order(key, PODS)
        clock.now += 5.0
    assert r.replica_set(key, PODS) == (first,)
    for _ in range(4):  # the inputs that shrank it do not grow it back
        r.order(key, PODS)
        clock.now += 5.0
    assert r.replica_set(key, PODS) == (first,)


@settings(max_examples=200, deadline=None)
@given(
    saturation=st.floats(1, 100),
    shares=st.tuples(st.floats(0.01, 1), st.floats(0.01, 1), st.floats(0.01, 1), st.floats(0.01, 2)),
    demand=st.floats(0, 500),
    fewer=st.integers(1, 16),
    load=st.floats(0, 200),
    floor=st.floats(0, 200),
)
def test_a_set_that_may_shrink_is_not_crowded_on_the_same_inputs(
    saturation: float,
    shares: tuple[float, float, float, float],
    demand: float,
    fewer: int,
    load: float,
    floor: float,
) -> None:
    # Hysteresis: whatever lets the last member go would not, on the same loads and demand, grow the set
    # back (no flapping between the two every cool_s).
    room, grow_share, spread, surge = shares
    policy = PlacementPolicy(
        saturation=saturation, room=room, grow_share=grow_share, spread=spread, surge=surge
    )
    floor = min(floor, load)
    if policy.may_shrink(demand, fewer, load, floor):
        assert not (policy.crowded(load, floor) and policy.may_grow(demand, fewer))

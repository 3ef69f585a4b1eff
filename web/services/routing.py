"""Where a gateway request goes: adapter placement with replication by demand, then the least-loaded pod.

Each adapter has a replica set: the first pods of its rendezvous (highest-random-weight) order that have
room for its weights. It starts with one pod, so the adapter stays resident where it ran last (affinity);
when its least-loaded member is crowded (saturated, or far busier than the pool's least-loaded pod) and the
adapter carries a real share of its members' work, the set grows by the next pod in that order that is
clearly less loaded; when the adapter's demand has been low, or has fit in one pod fewer without pressure,
for `cool_s`, the last member leaves (the thresholds apart, so a set does not flap); after `idle_s` without
a request the adapter gives its place up. A request goes to the least-loaded member. Base-model requests go
to the least-loaded pod. See docs/placement.md for the signals and their limits.

Bookkeeping only, no I/O and no wall clock of its own: `Placement` and `Router` take the clock, the load
signal and the pod capacities as inputs, so tests and `bench cluster` drive the same code the gateway runs.
Health is passive: a pod that refuses a connection rests for `cooldown_s` (still tried, last). A
`kubernetes://<namespace>/<name>` endpoint stands for the ready pods discovery sees (discovery.py).
"""

from __future__ import annotations

import hashlib
import math
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from .discovery import Discovery

# Cooldown entries of replicas that are gone (pods come and go, each with a new IP) are dropped once the
# table holds this many, so it stays bounded however long the control plane runs.
MAX_COOLDOWN_ENTRIES = 4096
# Deployments (pod sets) the router keeps a placement for; the least recently routed is forgotten beyond.
MAX_PLACEMENTS = 256


def hrw_weight(key: str, endpoint: str) -> int:
    digest = hashlib.blake2b(f"{key}\n{endpoint}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rendezvous_order(key: str, endpoints: Iterable[str]) -> list[str]:
    """Endpoints from most to least preferred for `key` (highest random weight first). Removing an
    endpoint moves only the keys it ranked first; adding one takes about 1/N of the keys."""
    return sorted(endpoints, key=lambda endpoint: hrw_weight(key, endpoint), reverse=True)


# -- load signals ---------------------------------------------------------------------------------------


class LoadSignal(Protocol):
    """Outstanding work, in requests: on a pod, and of one adapter over all pods."""

    def load(self, endpoint: str) -> float: ...

    def demand(self, key: str) -> float: ...


@dataclass(eq=False)
class Work:
    """One upstream request counted as outstanding until `done()` (idempotent: a stream's close and an
    error path may both call it)."""

    endpoint: str
    key: str | None
    tokens: int
    _owner: Outstanding | None = field(default=None, repr=False)

    def done(self) -> None:
        owner, self._owner = self._owner, None
        if owner is not None:
            owner._end(self)


class Outstanding:
    """The gateway's own in-flight requests (and their reserved tokens) per pod and per adapter: exact
    and current for this gateway, blind to what other control-plane replicas sent."""

    def __init__(self) -> None:
        self.requests: dict[str, int] = {}
        self.tokens: dict[str, int] = {}
        self.by_key: dict[str, int] = {}

    def begin(self, endpoint: str, key: str | None, tokens: int = 0) -> Work:
        self.requests[endpoint] = self.requests.get(endpoint, 0) + 1
        self.tokens[endpoint] = self.tokens.get(endpoint, 0) + tokens
        if key is not None:
            self.by_key[key] = self.by_key.get(key, 0) + 1
        return Work(endpoint, key, tokens, self)

    def _end(self, work: Work) -> None:
        _decrement(self.requests, work.endpoint, 1)
        _decrement(self.tokens, work.endpoint, work.tokens)
        if work.key is not None:
            _decrement(self.by_key, work.key, 1)

    def load(self, endpoint: str) -> float:
        return self.requests.get(endpoint, 0)

    def demand(self, key: str) -> float:
        return self.by_key.get(key, 0)


def _decrement(counts: dict[str, int], name: str, amount: int) -> None:
    left = counts.get(name, 0) - amount
    if left > 0:
        counts[name] = left
    else:
        counts.pop(name, None)  # so the tables hold only what is in flight


# The engine's adapter budget on /metrics (engine/server/metrics.py): pool bytes adapters may hold while a
# full batch keeps its KV headroom.
ADAPTER_CAPACITY_SERIES = "loraplex_adapter_capacity_bytes"
_QUEUE_SERIES = ("vllm:num_requests_waiting", "vllm:num_requests_running")


class EngineMetrics:
    """Engines' own queue as they report it on /metrics (`vllm:num_requests_waiting` + `_running`), and
    their adapter budget (`loraplex_adapter_capacity_bytes`), fed by whoever scrapes them (`observe`,
    `observe_text`). The queue counts every gateway's requests, but is as old as the scrape."""

    def __init__(self) -> None:
        self._load: dict[str, float] = {}
        self._adapter_bytes: dict[str, int] = {}

    def observe(self, endpoint: str, waiting: float, running: float) -> None:
        if not (math.isfinite(waiting) and math.isfinite(running)) or waiting < 0 or running < 0:
            raise ValueError(f"{endpoint}: waiting and running must be finite and >= 0")
        self._load[endpoint] = waiting + running

    def observe_capacity(self, endpoint: str, adapter_bytes: float | None) -> None:
        """The engine's adapter budget in bytes; None: it reports none (an older engine, or still loading)."""
        if adapter_bytes is None:
            self._adapter_bytes.pop(endpoint, None)
            return
        if not math.isfinite(adapter_bytes) or adapter_bytes < 0:
            raise ValueError(f"{endpoint}: {ADAPTER_CAPACITY_SERIES} must be finite and >= 0")
        self._adapter_bytes[endpoint] = int(adapter_bytes)

    def observe_text(self, endpoint: str, text: str) -> None:
        """From a Prometheus text exposition (`name{labels} value [timestamp]`); a missing queue series is
        0, a missing budget is none."""
        totals: dict[str, float] = {}
        for line in text.splitlines():
            ends = [i for i in (line.find("{"), line.find(" ")) if i >= 0]
            if line.startswith("#") or not ends:
                continue
            name = line[: min(ends)]
            if name in _QUEUE_SERIES or name == ADAPTER_CAPACITY_SERIES:
                rest = line[line.rfind("}") + 1 :] if line[min(ends)] == "{" else line[min(ends) :]
                totals[name] = totals.get(name, 0.0) + float(rest.split()[0])
        waiting, running = (totals.get(name, 0.0) for name in _QUEUE_SERIES)
        self.observe(endpoint, waiting, running)
        self.observe_capacity(endpoint, totals.get(ADAPTER_CAPACITY_SERIES))

    def forget(self, endpoint: str) -> None:
        self._load.pop(endpoint, None)
        self._adapter_bytes.pop(endpoint, None)

    def load(self, endpoint: str) -> float:
        return self._load.get(endpoint, 0.0)

    def adapter_capacity(self, endpoint: str) -> int | None:
        """The budget the engine last reported, in bytes (0: no room); None when it reported none."""
        return self._adapter_bytes.get(endpoint)

    def demand(self, key: str) -> float:
        return 0.0  # the protocol's per-adapter series name adapters, not how many requests each has


@dataclass
class Combined:
    """The larger of the gateway's own count (fresh) and the engines' (every gateway's, scraped late)."""

    local: Outstanding
    scraped: EngineMetrics

    def load(self, endpoint: str) -> float:
        return max(self.local.load(endpoint), self.scraped.load(endpoint))

    def demand(self, key: str) -> float:
        return self.local.demand(key)


@dataclass
class MeasuredCapacity:
    """Adapter bytes a pod may be assigned: what its engine reports (`loraplex_adapter_capacity_bytes`,
    0 meaning no room), else the configured budget (`configured`, where 0 is unbounded). None: unbounded."""

    scraped: EngineMetrics
    configured: int

    def __call__(self, endpoint: str) -> int | None:
        measured = self.scraped.adapter_capacity(endpoint)
        if measured is not None:
            return measured
        return self.configured or None


# -- placement ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlacementPolicy:
    """When a set grows and shrinks. Load is outstanding requests on a pod; the shares below are of
    `saturation`, so one policy reads the same for any batch size."""

    # A pod with this many outstanding requests is saturated: a new one would wait behind a full batch.
    saturation: float = 48.0
    # A member this much busier than the pool's least-loaded pod is crowded even below saturation: a burst
    # spreads while it ramps up, not once a queue has formed.
    surge: float = 0.25
    # A pod outside the set may join when it is at least this much less loaded than the least-loaded
    # member: relative to that member, so a set still spreads when every pod is busy but some less so.
    spread: float = 0.05
    # A set grows only while the adapter has at least this share outstanding per member (and 2 requests:
    # `per_member`): a quiet adapter on a pod made busy by others waits there (its load elsewhere would
    # serve one request); the busy ones spread, and the pod frees up.
    grow_share: float = 0.1
    # The last member leaves once, for `cool_s`, the adapter's demand per remaining member is at most half
    # of `grow_share` (hysteresis: it takes twice the demand to grow back), or its demand fits in the
    # remaining members at `room` of their saturation while they have room and are not crowded.
    room: float = 0.75
    cool_s: float = 30.0
    # An adapter with no request for this long gives its place (and its pages) up.
    idle_s: float = 300.0
    # Bytes of adapter weights one pod may be assigned (its pool less the KV headroom) where its engine
    # reports no budget of its own (MeasuredCapacity); 0 is unbounded.
    pod_adapter_bytes: int = 0
    # Most pods in one set (0: every pod).
    max_replicas: int = 0

    def __post_init__(self) -> None:
        for name in ("saturation", "surge", "cool_s", "idle_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"PlacementPolicy.{name} must be a finite number > 0, not {value!r}")
        for name in ("room", "grow_share", "spread"):
            value = getattr(self, name)
            if not (0 < value <= 1):
                raise ValueError(f"PlacementPolicy.{name} must be in (0, 1], not {value!r}")
        if self.pod_adapter_bytes < 0 or self.max_replicas < 0:
            raise ValueError("PlacementPolicy.pod_adapter_bytes and max_replicas must be >= 0")

    def crowded(self, load: float, floor: float) -> bool:
        """A member with `load`, in a pool whose least-loaded pod has `floor`, would gain by a new member."""
        return load >= self.saturation or load - floor >= self.surge * self.saturation

    def per_member(self) -> float:
        """Outstanding requests per member that justify the set: `grow_share` of saturation, and never
        under 2, since an adapter with one request in flight per member has nothing to give a new one."""
        return max(self.grow_share * self.saturation, 2.0)

    def may_grow(self, demand: float, members: int) -> bool:
        return demand >= members * self.per_member()

    def may_shrink(self, demand: float, fewer: int, fewer_load: float, floor: float) -> bool:
        """The set could lose its last member: `fewer` members would remain, the least loaded at
        `fewer_load`. Both thresholds sit below the growth's, so a set that shrank does not grow back at
        once."""
        if demand <= fewer * self.per_member() / 2:
            return True
        fits = demand <= fewer * self.room * self.saturation
        calm = (
            fewer_load < self.room * self.saturation and fewer_load - floor < self.surge * self.saturation / 2
        )
        return fits and calm


@dataclass(frozen=True)
class Change:
    """A replica set changed: `added` pods should load the adapter (prewarm), `removed` may drop it."""

    pool: str
    key: str
    members: tuple[str, ...]
    added: tuple[str, ...]
    removed: tuple[str, ...]
    reason: str  # placed, grew, shrank, idle, pods, capacity


@dataclass
class _Adapter:
    size: int
    order: list[str]  # the HRW order over the current pods
    members: list[str]
    last_used: float
    cool_since: float | None = None


class Placement:
    """Replica sets of one pool of pods (one deployment). Deterministic: two instances given the same
    calls at the same clock readings hold the same sets."""

    def __init__(
        self,
        policy: PlacementPolicy,
        clock: Callable[[], float] = time.monotonic,
        capacity: Callable[[str], int | None] | None = None,
        pool: str = "",
    ):
        self.policy, self.clock, self.pool = policy, clock, pool
        self._capacity = capacity
        self.pods: tuple[str, ...] = ()
        self._adapters: OrderedDict[str, _Adapter] = OrderedDict()  # least recently used first
        self._used: dict[str, int] = {}
        self._multi: set[str] = set()  # adapters with more than one member (few: the hot ones)
        self._listeners: list[Callable[[Change], None]] = []
        self.overflows = 0  # adapters that found no pod with room (routed by HRW, unassigned)

    # -- what callers read
    def replicas(self, key: str) -> tuple[str, ...]:
        """The adapter's replica set, most preferred first (empty when it holds no place)."""
        adapter = self._adapters.get(key)
        return tuple(adapter.members) if adapter else ()

    def sets(self) -> dict[str, tuple[str, ...]]:
        return {key: tuple(a.members) for key, a in self._adapters.items()}

    def hrw_order(self, key: str) -> list[str]:
        """Every pod of the pool in the adapter's rendezvous order."""
        adapter = self._adapters.get(key)
        return list(adapter.order) if adapter else rendezvous_order(key, self.pods)

    def assigned_bytes(self, pod: str) -> int:
        return self._used.get(pod, 0)

    def capacity(self, pod: str) -> int | None:
        """Adapter bytes `pod` may be assigned now (None: unbounded): the capacity function's answer, or
        the policy's `pod_adapter_bytes` (0 there is unbounded). Read at each assignment."""
        if self._capacity is not None:
            return self._capacity(pod)
        return self.policy.pod_adapter_bytes or None

    def subscribe(self, listener: Callable[[Change], None]) -> None:
        self._listeners.append(listener)

    # -- inputs
    def set_pods(self, pods: Iterable[str]) -> None:
        """The pool's pods now. When they change every set is placed again, hot adapters first, on the
        new HRW orders: a pod that left moves only its adapters, one that came takes about 1/N."""
        current = tuple(sorted(set(pods)))
        if current == self.pods:
            return
        self.pods = current
        self._replace("pods")

    def refit(self) -> None:
        """A pod's capacity changed (its engine reported a budget, or another one): every set is placed
        again on the same pods, as when they change, so no pod stays assigned more than it now holds."""
        self._replace("capacity")

    def _replace(self, reason: str) -> None:
        current = self.pods
        self._used, self._multi = {}, set()
        before = {key: list(a.members) for key, a in self._adapters.items()}
        # Canonical order (more replicas first, then key), so the result does not depend on history.
        for key in sorted(self._adapters, key=lambda k: (-len(self._adapters[k].members), k)):
            adapter = self._adapters[key]
            want = max(1, len(adapter.members))
            adapter.order = rendezvous_order(key, current)
            adapter.members = []
            for pod in adapter.order:
                if len(adapter.members) == want:
                    break
                if self._fits(pod, adapter.size):
                    self._assign(key, adapter, pod)
        for key, old in before.items():
            adapter = self._adapters[key]
            if not adapter.members:  # no pod has room for it any more
                del self._adapters[key]
            self._emit(key, old, adapter.members, reason)

    def place(self, key: str, size: int) -> tuple[str, ...]:
        """The adapter's set, placing it on the first pod of its HRW order with room when it has none;
        a request for it now (keeps the place from going idle). Empty when no pod has room."""
        now = self.clock()
        adapter = self._adapters.get(key)
        if adapter is not None:  # touched before the sweep, which must not take it for idle
            adapter.last_used = now
            self._adapters.move_to_end(key)
        self._expire(now)
        if adapter is not None:
            return tuple(adapter.members)
        if size < 0:
            raise ValueError(f"adapter {key}: size must be >= 0 bytes, not {size}")
        order = rendezvous_order(key, self.pods)
        pod = next((p for p in order if self._fits(p, size)), None)
        if pod is None:
            self.overflows += 1
            return ()
        adapter = _Adapter(size=size, order=order, members=[], last_used=now)
        self._adapters[key] = adapter
        self._assign(key, adapter, pod)
        self._emit(key, [], adapter.members, "placed")
        return (pod,)

    def grow(self, key: str, has_room: Callable[[str], bool]) -> str | None:
        """Add the next pod of the adapter's HRW order outside its set that `has_room` (load) and can
        hold its weights (pages); that pod, or None."""
        adapter = self._adapters.get(key)
        limit = self.policy.max_replicas or len(self.pods)
        if adapter is None or len(adapter.members) >= limit:
            return None
        for pod in adapter.order:
            if pod not in adapter.members and self._fits(pod, adapter.size) and has_room(pod):
                old = list(adapter.members)
                self._assign(key, adapter, pod)
                adapter.cool_since = None
                self._emit(key, old, adapter.members, "grew")
                return pod
        return None

    def observe(self, key: str, demand: float, load: Callable[[str], float], floor: float = 0.0) -> None:
        """The adapter's outstanding requests now, and the pool's least load (`floor`): the last member
        leaves once the policy's `may_shrink` has held for `cool_s`."""
        adapter = self._adapters.get(key)
        if adapter is None or len(adapter.members) < 2:
            return
        now = self.clock()
        fewer = adapter.members[:-1]
        if not self.policy.may_shrink(demand, len(fewer), min(map(load, fewer)), floor):
            adapter.cool_since = None
        elif adapter.cool_since is None:
            adapter.cool_since = now
        elif now - adapter.cool_since >= self.policy.cool_s:
            self._shrink(key, adapter, len(fewer), "shrank")
            adapter.cool_since = now  # still cool: the next member may leave after another cool_s

    # -- bookkeeping
    def _fits(self, pod: str, size: int) -> bool:
        capacity = self.capacity(pod)
        return capacity is None or self._used.get(pod, 0) + size <= capacity

    def _assign(self, key: str, adapter: _Adapter, pod: str) -> None:
        adapter.members.append(pod)
        self._used[pod] = self._used.get(pod, 0) + adapter.size
        if len(adapter.members) > 1:
            self._multi.add(key)

    def _shrink(self, key: str, adapter: _Adapter, keep: int, reason: str) -> None:
        old = list(adapter.members)
        for pod in adapter.members[keep:]:
            _decrement(self._used, pod, adapter.size)
        adapter.members = adapter.members[:keep]
        adapter.cool_since = None
        if keep < 2:
            self._multi.discard(key)
        self._emit(key, old, adapter.members, reason)

    def _expire(self, now: float) -> None:
        """Adapters idle past `idle_s` leave (the least recently used are first in line); an adapter with
        extra members and no request for `cool_s` keeps only its first (no request, no demand)."""
        while self._adapters:
            key, adapter = next(iter(self._adapters.items()))
            if now - adapter.last_used < self.policy.idle_s:
                break
            self._shrink(key, adapter, 0, "idle")
            del self._adapters[key]
        for key in [k for k in self._multi if now - self._adapters[k].last_used >= self.policy.cool_s]:
            self._shrink(key, self._adapters[key], 1, "shrank")

    def _emit(self, key: str, old: list[str], new: list[str], reason: str) -> None:
        if old == new or not self._listeners:
            return
        change = Change(
            pool=self.pool,
            key=key,
            members=tuple(new),
            added=tuple(p for p in new if p not in old),
            removed=tuple(p for p in old if p not in new),
            reason=reason,
        )
        for listener in self._listeners:
            listener(change)


# -- the router -----------------------------------------------------------------------------------------


class Router:
    """The gateway's pick of a pod for each request: `order()` ranks a deployment's pods (try the first;
    on a refused connection, the next), `begin()` counts the request as outstanding until its `done()`."""

    def __init__(
        self,
        cooldown_s: float,
        discovery: Discovery | None = None,
        *,
        policy: PlacementPolicy | None = None,
        load: LoadSignal | None = None,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        capacity: Callable[[str], int | None] | None = None,
    ):
        self.cooldown_s = cooldown_s
        self.discovery = discovery
        self.policy = policy or PlacementPolicy()
        self.outstanding = Outstanding()
        self.load: LoadSignal = load or self.outstanding
        self.clock = clock
        self._rng = rng or random.Random()
        # Adapter bytes each pod may be assigned (None: unbounded); None here: the policy's pod_adapter_bytes.
        # engine_load.py sets a MeasuredCapacity, the engines' own budgets; read at every assignment.
        self.capacity = capacity
        self._down_until: dict[str, float] = {}
        self._placements: OrderedDict[tuple[str, ...], Placement] = OrderedDict()
        self._listeners: list[Callable[[Change], None]] = []
        # Reorders an adapter's live members (key, members, healthy pods): prewarm (prewarm.py) puts the
        # members still loading it last, after the pods it moved from. None: by load alone.
        self.arrange: Callable[[str, list[str], set[str]], list[str]] | None = None

    def replicas(self, endpoints: list[str]) -> list[str]:
        """The replica URLs a deployment's endpoints stand for right now."""
        if self.discovery is None:
            return [e for e in endpoints if not e.startswith("kubernetes://")]
        return self.discovery.expand(endpoints)

    def placement(self, endpoints: list[str]) -> Placement:
        """The placement of the deployment with these endpoints (as stored), its pods brought up to date."""
        pool = tuple(endpoints)
        placement = self._placements.get(pool)
        if placement is None:
            placement = Placement(self.policy, self.clock, self._capacity_of, pool=",".join(pool))
            for listener in self._listeners:
                placement.subscribe(listener)
            self._placements[pool] = placement
            if len(self._placements) > MAX_PLACEMENTS:
                self._placements.popitem(last=False)
        self._placements.move_to_end(pool)
        placement.set_pods(self.replicas(endpoints))
        return placement

    def _capacity_of(self, pod: str) -> int | None:
        if self.capacity is not None:
            return self.capacity(pod)
        return self.policy.pod_adapter_bytes or None

    def refit(self, pod: str) -> None:
        """`pod`'s capacity changed: the deployments it serves place their sets again (Placement.refit)."""
        for placement in self._placements.values():
            if pod in placement.pods:
                placement.refit()

    def known_pods(self) -> set[str]:
        """Every pod of the deployments routed lately (what engine_load.py reads the queues of)."""
        return {pod for placement in self._placements.values() for pod in placement.pods}

    def replica_set(self, key: str, endpoints: list[str]) -> tuple[str, ...]:
        """The pods that hold (or should hold) the adapter now."""
        return self.placement(endpoints).replicas(key)

    def subscribe(self, listener: Callable[[Change], None]) -> None:
        """Call `listener` with every replica-set change, of every deployment (prewarm hooks in here)."""
        self._listeners.append(listener)
        for placement in self._placements.values():
            placement.subscribe(listener)

    def order(self, key: str | None, endpoints: list[str], size: int = 0) -> list[str]:
        """Pods in the order to try them: the chosen one first, then the rest of the adapter's set by
        load, then the other healthy pods (by HRW for an adapter), then the resting ones (a last resort,
        not a dead end). `size` is the adapter's weight bytes, counted against the pods' capacity."""
        placement = self.placement(endpoints)
        now = self.clock()
        healthy = [p for p in placement.pods if self._down_until.get(p, 0.0) <= now]
        if key is None:
            ranked = self._by_load(healthy)
        else:
            # Pods being deleted that still serve: where their adapters may go while new pods warm.
            leaving = set(self.discovery.leaving(endpoints)) if self.discovery is not None else set()
            ranked = self._adapter_order(placement, key, size, set(healthy), leaving)
        chosen = set(ranked)
        resting = [p for p in placement.pods if p not in chosen]
        return ranked + sorted(resting, key=lambda p: self._down_until.get(p, 0.0))

    def _by_load(self, pods: list[str]) -> list[str]:
        """Least loaded first; ties in random order, so equal pods share the traffic."""
        shuffled = self._rng.sample(pods, len(pods))
        return sorted(shuffled, key=self.load.load)

    def _adapter_order(
        self,
        placement: Placement,
        key: str,
        size: int,
        healthy: set[str],
        leaving: frozenset[str] | set[str] = frozenset(),
    ) -> list[str]:
        members = placement.place(key, size)
        if not members:  # no pod can hold it: today's rendezvous, the engine evicts what it must
            return [p for p in rendezvous_order(key, placement.pods) if p in healthy]
        policy, load = self.policy, self.load.load
        # Ties go to the earlier member (HRW order), so a quiet adapter stays on its first pod.
        live = sorted((m for m in members if m in healthy), key=load)
        demand = self.load.demand(key)
        # The pool's least-loaded pod: growth and shrinking are judged against it, not only in absolutes.
        floor = min(map(load, healthy), default=0.0)
        if live and policy.crowded(load(live[0]), floor) and policy.may_grow(demand, len(members)):
            # A member still warming (prewarm) has no load yet, so it stands first here and the set waits
            # for it before growing again.
            room = load(live[0]) - policy.spread * policy.saturation
            grown = placement.grow(key, lambda p: p in healthy and load(p) <= room)
            if grown is not None:
                live.insert(0, grown)
        placement.observe(key, demand, load, floor)
        if self.arrange is not None:
            live = self.arrange(key, live, healthy | leaving)
        return live + [p for p in placement.hrw_order(key) if p in healthy and p not in live]

    def begin(self, endpoint: str, key: str | None, tokens: int = 0) -> Work:
        """Count a request sent to `endpoint` as outstanding until the returned work's `done()`."""
        return self.outstanding.begin(endpoint, key, tokens)

    def mark_down(self, endpoint: str) -> None:
        now = self.clock()
        if len(self._down_until) >= MAX_COOLDOWN_ENTRIES:
            self._down_until = {e: t for e, t in self._down_until.items() if t > now}
        self._down_until[endpoint] = now + self.cooldown_s

    def mark_up(self, endpoint: str) -> None:
        self._down_until.pop(endpoint, None)

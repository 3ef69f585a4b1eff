"""Tenant fairness: the Virtual Token Counter (VTC) of Sheng et al., "Fairness in Serving Large Language
Models" (OSDI 2024), per tenant.

Each tenant has a counter of the service it was given: `w_p` per prompt token, charged when its request
is admitted (the paper's choice: the prompt is committed then), plus `w_q` per output token, charged as
each is appended; both divided by the tenant's weight, so a tenant of weight 2 gets twice the tokens for
the same counter. Admission takes the earliest waiting request of the tenant with the smallest counter.
A tenant whose queue was empty has its counter lifted, when a request of it arrives, to the smallest
counter of the tenants with requests queued (or to the counter of the last tenant whose queue emptied,
when none are queued): idle time is not banked as credit. Requests without a tenant are one anonymous
tenant (key None).

Ties go to the tenant with fewer requests running, then to the earliest request: a tenant that just
became active (lifted to the backlogged tenant's counter, nothing running) goes first.

The bound (the paper's Theorem 4.4 for this cost function): for two tenants f and g of equal weight that
are backlogged (have requests waiting) throughout [t1, t2),
    |W_f(t1, t2) - W_g(t1, t2)| <= 2 * U,   U = max(w_p * L_input, w_q * M),
where W is the service charged in the window, L_input the longest prompt and M the most tokens the running
batch can hold (the pool's KV capacity in tokens). tests/engine/test_fairness.py checks it.

State stays bounded: a tenant with nothing queued or running is forgotten once its counter is at or
below the floor a returning tenant is lifted to (the smallest counter of the backlogged tenants, or the
last emptied one's), because from then on the lift alone sets its counter: the floor never decreases (a
backlogged tenant's counter is at least the floor, counters only grow, and a tenant joins at or above
it), so forgetting it changes no decision (tests/engine/test_fairness.py checks this against an
unpruned twin). Idle tenants that were served more than the floor are kept until the floor passes them:
their lead is not forgiven by leaving. The sweep runs when the idle set has doubled since the last one,
so its cost per request is constant.

What the paper leaves open, decided here: a preempted request is not charged again when it is recomputed
(the engine chose to drop its cache, the tenant did not), and prompt tokens served from the prefix cache
are charged like computed ones (the tenant's share is of tokens, not of compute). Bookkeeping only: no
torch (tests/engine/test_torch_free.py).

The scheduler's two queue policies live here too, chosen when it is made: `FirstComeQueue` (arrival
order) and `FairQueue` (the counter's pick, with its newcomer and bypass rules).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from .request import Request

Tenant = str | None  # None: the anonymous tenant


@dataclass
class _TenantState:
    counter: float = 0.0
    waiting: int = 0  # requests queued
    running: int = 0  # requests admitted and not finished


@dataclass
class VirtualTokenCounter:
    """The counters and per-tenant queue sizes; the scheduler tells it what happens to requests."""

    prompt_weight: float = 1.0
    output_weight: float = 2.0
    prune: bool = True  # forget idle tenants that the lift would reset anyway (off only to test that)
    tenants: dict[Tenant, _TenantState] = field(default_factory=dict)
    sweep_minimum: int = 64  # idle tenants kept before the first sweep (tests set 1 to sweep always)
    _idle: set[Tenant] = field(default_factory=set)  # tenants with nothing queued or running
    _unserved: set[Tenant] = field(default_factory=set)  # tenants with requests queued and none running
    _sweep_at: int = 0  # sweep the idle tenants when there are this many
    _last_emptied: float = 0.0  # the counter of the last tenant whose queue became empty
    _charged: set[str] = field(default_factory=set)  # requests whose prompt was charged (once)

    def __post_init__(self) -> None:
        self._sweep_at = self.sweep_minimum
        if not (self.prompt_weight >= 0 and self.output_weight >= 0):
            raise ValueError(
                f"token weights must be 0 or more, got prompt {self.prompt_weight}, "
                f"output {self.output_weight}"
            )

    def counter(self, tenant: Tenant) -> float:
        """The tenant's counter; 0 for one never seen or forgotten while idle."""
        state = self.tenants.get(tenant)
        return state.counter if state else 0.0

    def _state(self, tenant: Tenant) -> _TenantState:
        state = self.tenants.get(tenant)
        if state is None:
            state = self.tenants[tenant] = _TenantState()
        return state

    def queued(self, request: Request) -> None:
        """A request joins the queue (new, or back after preemption)."""
        state = self._state(request.tenant)
        if state.waiting == 0:  # becomes active: lift, so idle time is no credit
            state.counter = max(state.counter, self._floor(skip=frozenset([request.tenant])))
        state.waiting += 1
        self._idle.discard(request.tenant)
        self._track_unserved(request.tenant, state)

    def _floor(self, skip: frozenset[Tenant] = frozenset()) -> float:
        """What a tenant becoming active is lifted to: the smallest counter of the backlogged tenants
        not in `skip`, or the counter of the last tenant whose queue emptied when none are."""
        backlogged = [s.counter for t, s in self.tenants.items() if s.waiting and t not in skip]
        return min(backlogged) if backlogged else self._last_emptied

    def _became_idle(self, tenant: Tenant) -> None:
        """`tenant` has nothing queued or running: forget the idle tenants the lift would reset anyway,
        once the idle set has doubled since the last sweep (amortized constant cost per request)."""
        if not self.prune:
            return
        self._idle.add(tenant)
        if len(self._idle) < self._sweep_at:
            return
        floor = self._floor()
        for idle in [t for t in self._idle if self.tenants[t].counter <= floor]:
            del self.tenants[idle]
            self._idle.discard(idle)
        self._sweep_at = max(self.sweep_minimum, 2 * len(self._idle))

    def _check_idle(self, tenant: Tenant, state: _TenantState) -> None:
        if state.waiting == 0 and state.running == 0:
            self._became_idle(tenant)

    def _left_queue(self, state: _TenantState) -> None:
        state.waiting -= 1
        if state.waiting == 0:
            self._last_emptied = state.counter

    def admitted(self, request: Request) -> None:
        """A waiting request joins the running batch; its prompt is charged the first time."""
        state = self._state(request.tenant)
        self._left_queue(state)
        state.running += 1
        self._track_unserved(request.tenant, state)
        if request.request_id not in self._charged:
            self._charged.add(request.request_id)
            state.counter += self.prompt_weight * len(request.prompt_token_ids) / request.tenant_weight

    def preempted(self, request: Request) -> None:
        """A running request goes back to the queue (its recomputation is not charged)."""
        self._state(request.tenant).running -= 1
        self.queued(request)

    def generated(self, request: Request, num_tokens: int = 1) -> None:
        self._state(request.tenant).counter += self.output_weight * num_tokens / request.tenant_weight

    def finished(self, request: Request, was_running: bool) -> None:
        """The request ended (stopped, aborted or failed), from the queue or the running batch."""
        state = self._state(request.tenant)
        if was_running:
            state.running -= 1
        else:
            self._left_queue(state)
        self._charged.discard(request.request_id)
        self._track_unserved(request.tenant, state)
        self._check_idle(request.tenant, state)

    def _track_unserved(self, tenant: Tenant, state: _TenantState) -> None:
        if state.waiting and not state.running:
            self._unserved.add(tenant)
        else:
            self._unserved.discard(tenant)

    def newcomers(self) -> set[Tenant]:
        """Tenants with requests queued, none running, and a counter no larger than that of any tenant
        with requests running: the under-served whose first chunk the scheduler keeps light. Asked every
        step: nothing to look at (no tenant waits with nothing running) is answered at once."""
        if not self._unserved:
            return set()
        running = [s.counter for s in self.tenants.values() if s.running]
        least_served = min(running) if running else float("inf")
        return {tenant for tenant in self._unserved if self.tenants[tenant].counter <= least_served}

    def pick(self, waiting: Iterable[Request], skip: set[Tenant]) -> Request | None:
        """The earliest waiting request of the tenant with the smallest counter, skipping `skip`'s
        tenants; ties go to the tenant with fewer requests running, then to the earliest request."""
        best: Request | None = None
        best_key: tuple[float, int] | None = None
        seen: set[Tenant] = set()
        for request in waiting:  # queue order: a tenant's first request here is its earliest
            tenant = request.tenant
            if tenant in seen or tenant in skip:
                continue
            seen.add(tenant)
            state = self._state(tenant)
            key = (state.counter, state.running)
            if best_key is None or key < best_key:
                best, best_key = request, key
        return best


# -- the scheduler's queue policies ------------------------------------------------------------------------


class FirstComeQueue:
    """First come, first served: the queue's front goes next, and nothing is passed over."""

    def queued(self, request: Request) -> None:
        pass

    def admitted(self, request: Request) -> None:
        pass

    def preempted(self, request: Request) -> None:
        pass

    def generated(self, request: Request) -> None:
        pass

    def finished(self, request: Request, was_running: bool, was_queued: bool) -> None:
        pass

    def pick(self, waiting: Sequence[Request], passed: set[Tenant]) -> Request | None:
        return waiting[0]

    def pass_over(self, request: Request, passed: set[Tenant], starving: bool) -> bool:
        return False

    def newcomers(
        self,
        running: Sequence[Request],
        waiting: Iterable[Request],
        full: bool,
        ready: Callable[[Request], bool],
    ) -> tuple[set[Tenant], Request | None]:
        return set(), None

    def may_hold_back(self, request: Request) -> bool:
        return False

    def held_back(self, requests: Iterable[Request]) -> None:
        pass


class FairQueue:
    """Tenant fairness: the tenant with the least service goes next (`vtc`), and two rules around it.

    Newcomers: the step that admits an under-served tenant's first request (nothing running, least
    counter) carries no other prefill (running chunks wait a step, other tenants do not join), so its
    first token costs about what it costs on an idle engine. Each request is held back like that at most
    once, so a stream of newcomers cannot starve a prefill. When the running batch has no free slot, one
    running request of the tenant running the most (two or more) gives its slot up, preempted (its full
    pages stay in the prefix cache), so the newcomer does not wait for another tenant's long request to
    end; each request yields like that at most once, and only to a newcomer whose adapter, if any, is
    resident (one that would wait for pages anyway takes nobody's slot).

    Bypass: a request whose adapter cannot get pages now is passed over so other tenants run; after
    `max_bypass_steps` steps of that, nothing joins behind it until the running batch drains enough pages
    for it, so it cannot starve."""

    def __init__(
        self, vtc: VirtualTokenCounter, max_bypass_steps: int = 32, light_newcomer_steps: bool = True
    ):
        self.vtc = vtc
        self.max_bypass_steps = max_bypass_steps
        self.light_newcomer_steps = light_newcomer_steps
        self.bypassed: dict[str, int] = {}  # request id -> steps it was passed over
        self._held_back: set[str] = set()  # request ids whose prefill waited out a newcomer's step
        self._yielded: set[str] = set()  # request ids preempted once to give a newcomer their slot

    def queued(self, request: Request) -> None:
        self.vtc.queued(request)

    def admitted(self, request: Request) -> None:
        self.bypassed.pop(request.request_id, None)
        self.vtc.admitted(request)

    def preempted(self, request: Request) -> None:
        self.vtc.preempted(request)

    def generated(self, request: Request) -> None:
        self.vtc.generated(request)

    def finished(self, request: Request, was_running: bool, was_queued: bool) -> None:
        if was_running or was_queued:  # never queued: nothing counted
            self.vtc.finished(request, was_running)
        self.bypassed.pop(request.request_id, None)
        self._held_back.discard(request.request_id)
        self._yielded.discard(request.request_id)

    def pick(self, waiting: Sequence[Request], passed: set[Tenant]) -> Request | None:
        return self.vtc.pick(waiting, passed)

    def pass_over(self, request: Request, passed: set[Tenant], starving: bool) -> bool:
        """Whether admission may go on past `request`, which cannot join now: its tenant waits out this
        step, unless it was passed over for lack of pages (`starving`) on `max_bypass_steps` steps
        already: then admission stops behind it until it fits."""
        if starving:
            steps = self.bypassed.get(request.request_id, 0)
            if steps >= self.max_bypass_steps:
                return False
            if request.tenant not in passed:  # once per step
                self.bypassed[request.request_id] = steps + 1
        passed.add(request.tenant)
        return True

    def newcomers(
        self,
        running: Sequence[Request],
        waiting: Iterable[Request],
        full: bool,
        ready: Callable[[Request], bool],
    ) -> tuple[set[Tenant], Request | None]:
        """The tenants whose request joins first and alone this step, and the running request that gives
        its slot up for them (None: the batch has a free slot, or nobody yields)."""
        if not self.light_newcomer_steps:
            return set(), None
        newcomers = self.vtc.newcomers()
        if not newcomers or not full:
            return newcomers, None
        if not any(r.tenant in newcomers and ready(r) for r in waiting):
            return set(), None
        victim = self._yielding_request(running)
        if victim is None:
            return set(), None
        self._yielded.add(victim.request_id)
        return newcomers, victim

    def may_hold_back(self, request: Request) -> bool:
        """Whether the running request's prefill may wait out a newcomer's step (not if it did once)."""
        return request.request_id not in self._held_back

    def held_back(self, requests: Iterable[Request]) -> None:
        self._held_back.update(request.request_id for request in requests)

    def _yielding_request(self, running: Sequence[Request]) -> Request | None:
        """The running request that gives its slot to a newcomer: of the tenant with the most running
        (at least two: a tenant never loses its last), the one with the least computed (the least to
        recompute; the latest admitted of equals) that has not yielded before."""
        by_tenant: dict[Tenant, list[Request]] = {}
        for request in running:
            by_tenant.setdefault(request.tenant, []).append(request)
        tenants = sorted(
            (t for t, rs in by_tenant.items() if len(rs) >= 2),
            key=lambda t: (len(by_tenant[t]), self.vtc.counter(t)),
            reverse=True,
        )
        for tenant in tenants:
            candidates = [r for r in by_tenant[tenant] if r.request_id not in self._yielded]
            if candidates:
                return min(reversed(candidates), key=lambda r: r.num_computed_tokens)
        return None


RequestQueue = FirstComeQueue | FairQueue  # which waiting request goes next: the scheduler's choice

"""Tenant fairness (engine/fairness.py): the virtual token counters' invariants, on the torch-free
scheduler with a fake model (every sampled token is 7), and the issue's flooding-tenant scenario on a
tiny engine, counted in steps.

Service is measured here from what the scheduler does, not read from the counters: w_p per prompt token
when a request is first scheduled (the paper charges the prompt at admission), w_q per appended token.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplex.engine.fairness import FairQueue, VirtualTokenCounter
from loraplex.engine.lora.registry import AdapterRegistry
from loraplex.engine.pool import PagePool
from loraplex.engine.request import Request
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.scheduler import Scheduler, StepPlan

from .test_scheduler import TOKEN, FakeSource, check_pages, load_all

W_P, W_Q = 1.0, 2.0


def make(tenant: str, index: int, prompt: int, tokens: int, weight: float = 1.0, adapter: str | None = None):
    params = SamplingParams(max_tokens=tokens)
    return Request(
        f"{tenant}{index}", [1] * prompt, params, index, adapter=adapter, tenant=tenant, tenant_weight=weight
    )


class Run:
    """Steps a scheduler with fairness and records each tenant's service per step."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.admitted: set[str] = set()
        self.steps = 0
        self.plan = StepPlan()  # the last step's

    def step(self) -> dict[str | None, float]:
        served: dict[str | None, float] = {}
        plan = self.plan = self.scheduler.schedule()
        load_all(self.scheduler.adapters, plan)
        for chunk in plan.chunks:
            request = chunk.request
            if request.request_id not in self.admitted:
                self.admitted.add(request.request_id)
                served[request.tenant] = served.get(request.tenant, 0) + W_P * len(request.prompt_token_ids)
        check_pages(self.scheduler)
        for request in self.scheduler.postprocess(plan, [TOKEN] * len(plan.sampling)):
            served[request.tenant] = served.get(request.tenant, 0) + W_Q
        self.steps += 1
        if isinstance(self.scheduler.queue, FairQueue):  # the incrementally kept set the newcomer check reads
            vtc = self.scheduler.queue.vtc
            assert vtc._unserved == {t for t, s in vtc.tenants.items() if s.waiting and not s.running}
        return served

    def waiting_tenants(self) -> set[str | None]:
        return {r.tenant for r in self.scheduler.waiting}

    def flood(self, count: int, prompt: int, tokens: int, steps: int) -> None:
        """Tenant A queues `count` requests alike, then `steps` steps run."""
        for i in range(count):
            self.scheduler.add(make("A", i, prompt, tokens))
        for _ in range(steps):
            self.step()


def fair_scheduler(pages: int, page_size: int, seqs: int, budget: int, **kwargs) -> Scheduler:
    """A scheduler with the tenant-fair queue; `kwargs` are FairQueue's."""
    queue = FairQueue(VirtualTokenCounter(W_P, W_Q), **kwargs)
    return Scheduler(PagePool(pages), page_size, seqs, budget, queue=queue)


def backlogged_differences(run: Run, weights: dict[str, float], max_steps: int = 5000) -> list[float]:
    """Step while both tenants have requests waiting; return D(t) = W_A(0,t)/w_A - W_B(0,t)/w_B per step
    boundary, so the largest window difference is max(D) - min(D)."""
    difference, out = 0.0, [0.0]
    while run.waiting_tenants() == {"A", "B"}:
        assert run.steps < max_steps, "no progress"
        served = run.step()
        difference += served.get("A", 0) / weights["A"] - served.get("B", 0) / weights["B"]
        out.append(difference)
    return out


@settings(max_examples=40, deadline=None)
@given(
    a=st.lists(st.tuples(st.integers(1, 48), st.integers(1, 24)), min_size=4, max_size=16),
    b=st.lists(st.tuples(st.integers(1, 48), st.integers(1, 24)), min_size=4, max_size=16),
    page_size=st.sampled_from([4, 16]),
    seqs=st.integers(1, 6),
    budget=st.integers(6, 64),
    slack_pages=st.integers(0, 12),
)
def test_two_backlogged_equal_tenants_stay_within_the_papers_bound(
    a: list[tuple[int, int]],
    b: list[tuple[int, int]],
    page_size: int,
    seqs: int,
    budget: int,
    slack_pages: int,
) -> None:
    """Theorem (VTC paper, 4.4, this cost function): for two backlogged clients f, g over any [t1, t2),
    |W_f - W_g| <= 2 * U with U = max(w_p * L_input, w_q * M), L_input the longest prompt and M the most
    tokens the running batch holds (here the pool: pages * page_size). Preemption included (small pools)."""
    budget = max(budget, seqs)
    longest = max(p + m for p, m in a + b)
    pages = -(-longest // page_size) + slack_pages
    run = Run(fair_scheduler(pages, page_size, seqs, budget))
    for i, (p, m) in enumerate(a):
        run.scheduler.add(make("A", i, p, m))
    for i, (p, m) in enumerate(b):
        run.scheduler.add(make("B", i, p, m))
    d = backlogged_differences(run, {"A": 1.0, "B": 1.0})
    bound = 2 * max(W_P * max(p for p, _ in a + b), W_Q * pages * page_size)
    assert max(d) - min(d) <= bound


def test_weights_give_proportional_shares() -> None:
    """A of weight 2 and B of weight 1, same requests, both backlogged: A gets about twice B's service
    (each normalized by its weight stays within the bound), where FCFS would serve A's queue first."""
    run = Run(fair_scheduler(pages=64, page_size=4, seqs=4, budget=32))
    for i in range(60):
        run.scheduler.add(make("A", i, 8, 8, weight=2.0))
        run.scheduler.add(make("B", i, 8, 8, weight=1.0))
    served = {"A": 0.0, "B": 0.0}
    while run.waiting_tenants() == {"A", "B"}:
        for tenant, cost in run.step().items():
            served[tenant] += cost  # type: ignore[index]
    ratio = served["A"] / served["B"]
    assert 1.8 < ratio < 2.2, ratio


def test_a_newly_active_tenant_goes_before_the_backlogged_one() -> None:
    run = Run(fair_scheduler(pages=64, page_size=4, seqs=2, budget=32))
    run.flood(10, prompt=8, tokens=3, steps=5)
    newcomer = make("B", 0, 8, 3)
    run.scheduler.add(newcomer)
    # The next request to join the batch is B's, although A's have waited longer.
    while newcomer not in run.scheduler.running:
        before = set(map(id, run.scheduler.running))
        run.step()
        joined = [r for r in run.scheduler.running if id(r) not in before]
        assert not joined or joined[0] is newcomer, [r.request_id for r in joined]


def _first_step_of(run: Run, request: Request) -> list[tuple[str, int]]:
    """Step until `request` is scheduled; return that step's chunks as (request id, tokens)."""
    while not any(c.request is request for c in run.plan.chunks):
        run.step()
    return [(c.request.request_id, c.num_tokens) for c in run.plan.chunks]


def test_a_newcomers_first_step_carries_no_other_prefill() -> None:
    """A's long prompts are being prefilled in chunks, more of A's wait; B arrives. The step that runs
    B's first chunk runs nothing else but decodes (A's prefill waits a step, A's queue does not join), so
    B's first token costs about an idle step; with the setting off, A's prefill shares B's step."""
    for light in (True, False):
        run = Run(fair_scheduler(pages=256, page_size=4, seqs=4, budget=48, light_newcomer_steps=light))
        for i in range(8):
            run.scheduler.add(make("A", i, 40 if i % 2 else 3, 6))
        for _ in range(3):
            run.step()
        newcomer = make("B", 0, 8, 2)
        run.scheduler.add(newcomer)
        chunks = _first_step_of(run, newcomer)
        others = [n for rid, n in chunks if rid != "B0"]
        assert ("B0", 8) in chunks
        if light:
            assert others and all(n == 1 for n in others), chunks  # A's decodes only
        else:
            assert any(n > 1 for n in others), chunks  # the scenario does have A's prefill to hold back
        while run.scheduler.has_unfinished():
            run.step()


def test_newcomers_every_step_do_not_starve_a_prefill() -> None:
    """A new tenant arrives before every step: each request's prefill is held back at most once, so A's
    long prompt still finishes, a few steps later than without newcomers."""
    run = Run(fair_scheduler(pages=256, page_size=4, seqs=4, budget=16))
    long = make("A", 0, 64, 2)
    run.scheduler.add(long)
    for step in range(200):
        if long.finished:
            break
        run.scheduler.add(make(f"T{step}", 0, 2, 1))
        run.step()
    assert long.finished and run.steps <= 64 // 16 + 2 + 1, run.steps


def test_a_newcomer_takes_a_slot_from_the_tenant_running_the_most() -> None:
    """The batch is full of A's long requests when B arrives: one of A's gives its slot up (preempted,
    the least computed), so B's first token comes in the next step instead of after A's next finish.
    Each request yields at most once; a tenant never loses its last running request; with the setting
    off, B waits for one of A's to end."""

    def first_step_of_b(light: bool, seqs: int) -> tuple[int, list[str]]:
        run = Run(fair_scheduler(pages=256, page_size=4, seqs=seqs, budget=64, light_newcomer_steps=light))
        run.flood(6, prompt=8, tokens=30, steps=3)
        newcomer = make("B", 0, 4, 2)
        run.scheduler.add(newcomer)
        yielded: list[str] = []
        start = run.steps
        while newcomer.num_computed_tokens == 0:
            run.step()
            yielded += [r.request_id for r in run.plan.preempted]
        return run.steps - start, yielded

    assert first_step_of_b(light=True, seqs=3) == (1, ["A2"])  # A2 joined last: A0-A2 computed alike
    steps, yielded = first_step_of_b(light=False, seqs=3)
    assert steps > 20 and not yielded  # B waited for A0 (30 tokens) to end
    assert first_step_of_b(light=True, seqs=1)[1] == []  # A's only running request keeps its slot

    run = Run(fair_scheduler(pages=256, page_size=4, seqs=2, budget=64))
    run.flood(4, prompt=8, tokens=40, steps=1)
    victims, joined = [], []
    for b in range(3):  # B after B, each under-served again by then
        newcomer = make("B", b, 4, 1)
        run.scheduler.add(newcomer)
        run.step()
        victims += [r.request_id for r in run.plan.preempted]
        joined.append(newcomer in [c.request for c in run.plan.chunks])
        while not newcomer.finished:
            run.step()
        for _ in range(4):  # the yielded request is back first, and A's service passes B's again
            run.step()
    # A1 then A0 yielded; they came back first, so at B2 both running requests have yielded once.
    assert victims == ["A1", "A0"] and joined == [True, True, False], (victims, joined)


def test_no_slot_is_taken_for_a_newcomer_whose_adapter_is_not_resident() -> None:
    """A newcomer that would wait for its adapter's pages anyway takes nobody's slot."""
    pool = PagePool(64)
    registry = AdapterRegistry(pool)
    registry.register("cold", FakeSource(), num_pages=4)
    scheduler = Scheduler(pool, 4, 2, 64, adapters=registry, queue=FairQueue(VirtualTokenCounter(W_P, W_Q)))
    run = Run(scheduler)
    for i in range(3):
        scheduler.add(make("A", i, 8, 30))
    run.step()
    scheduler.add(make("C", 0, 4, 2, adapter="cold"))
    plan = scheduler.schedule()
    assert plan.preempted == [] and len(scheduler.running) == 2


def test_fcfs_within_a_tenant_and_a_preempted_request_is_first_of_its_tenant_again() -> None:
    scheduler = fair_scheduler(pages=10, page_size=4, seqs=4, budget=64)
    first, second = make("A", 0, 12, 20), make("A", 1, 12, 20)
    scheduler.add(first)
    scheduler.add(second)
    order = []
    run = Run(scheduler)
    while scheduler.has_unfinished():
        plan_running = list(scheduler.running)
        run.step()
        order += [r.request_id for r in scheduler.running if r not in plan_running]
    assert order[0] == "A0" and first.num_preemptions == 0
    assert second.num_preemptions > 0  # the pool of 10 pages cannot hold both to the end


def test_a_request_whose_adapter_cannot_fit_is_passed_over_but_not_starved() -> None:
    """Tenant C's adapter needs more pages than are free while tenant A keeps the pool busy (A's
    requests take the pages others free, so without a limit C would wait forever: checked with an
    unbounded limit): other tenants go ahead of it for max_bypass_steps steps, then admission stops
    behind it until the running batch drains enough pages, and it runs."""

    def steps_until_admitted(max_bypass_steps: int) -> int | None:
        pool = PagePool(16)
        registry = AdapterRegistry(pool)
        registry.register("big", FakeSource(), num_pages=8)
        queue = FairQueue(VirtualTokenCounter(W_P, W_Q), max_bypass_steps=max_bypass_steps)
        scheduler = Scheduler(pool, 4, 4, 64, adapters=registry, queue=queue)
        run = Run(scheduler)
        index = itertools.count()

        def flood() -> None:  # A keeps 3 requests queued, of staggered lengths
            while sum(r.tenant == "A" for r in scheduler.waiting) < 3:
                i = next(index)
                scheduler.add(make("A", i, 12, (8, 4, 6)[i % 3]))

        flood()
        for _ in range(3):
            run.step()
        starved = make("C", 0, 4, 2, adapter="big")
        scheduler.add(starved)
        start = run.steps
        while starved not in scheduler.running:
            if run.steps - start > 300:
                return None
            flood()
            run.step()
        assert starved.request_id not in queue.bypassed  # admitted: its count is gone
        return run.steps - start

    assert steps_until_admitted(10**9) is None  # the scenario starves C without the limit
    steps = steps_until_admitted(5)
    assert steps is not None and 5 < steps <= 5 + 8 + 2  # passed over 5 steps, then A's drain (<= 8)


def test_fcfs_setting_keeps_arrival_order() -> None:
    scheduler = Scheduler(PagePool(64), 4, 1, 32)
    for i in range(3):
        scheduler.add(make("A", i, 4, 2))
    late = make("B", 0, 4, 2)
    scheduler.add(late)
    run = Run(scheduler)
    while late not in scheduler.running:
        run.step()
    assert run.steps == 7  # A0, A1, A2 two steps each (prefill, then its last token), then B joins


def test_counter_lift_does_not_bank_idle_time() -> None:
    vtc = VirtualTokenCounter(W_P, W_Q)
    busy = make("A", 0, 100, 1)
    vtc.queued(busy)
    vtc.queued(make("A", 1, 100, 1))
    vtc.admitted(busy)
    vtc.generated(busy, 10)
    assert vtc.counter("A") == 100 + 20
    vtc.queued(make("B", 0, 1, 1))  # B was idle: lifted to A's counter, not left at 0
    assert vtc.counter("B") == 120
    with pytest.raises(ValueError, match="token weights"):
        VirtualTokenCounter(-1.0, 2.0)


def test_engine_flooding_tenant_scenario_in_steps() -> None:
    """The issue's scenario on a tiny engine, in steps: A keeps 32 long requests queued, B sends a short
    one every 7 steps. FCFS: B's time to first token grows with A's queue; fair: within 2x of idle."""
    from loraplex.bench.fairness import Scenario, engine_ttfts, make_engine

    scenario = Scenario(a_queue=32, a_prompt=64, a_tokens=16, b_prompt=16, b_tokens=2, b_requests=6, period=7)
    clock = [0]

    def tick() -> None:
        clock[0] += 1

    ttfts = {}
    for label, scheduling, queue in (("idle", "fair", 0), ("fcfs", "fcfs", 32), ("fair", "fair", 32)):
        engine = make_engine("random:tiny", scheduling, max_num_seqs=8, max_batch_tokens=64, num_pages=256)
        run = Scenario(**{**scenario.__dict__, "a_queue": queue})
        ttfts[label] = engine_ttfts(engine, run, lambda: clock[0], tick)
    idle = max(ttfts["idle"])
    assert max(ttfts["fair"]) <= 2 * idle, ttfts
    assert min(ttfts["fcfs"][1:]) > 10 * idle, ttfts  # behind A's queue (the first came before it)


def test_queue_counts_follow_aborts_from_the_queue_and_the_batch() -> None:
    """Aborts (finish) from the queue and from the running batch, and a finish of a request that was
    never queued, leave each tenant's waiting and running counts exact: the lift relies on them."""
    scheduler = fair_scheduler(pages=64, page_size=4, seqs=1, budget=32)
    first, second = make("A", 0, 4, 5), make("A", 1, 4, 5)
    scheduler.add(first)
    scheduler.add(second)
    Run(scheduler).step()  # first runs, second waits (one slot)
    state = scheduler.queue.vtc.tenants["A"]  # type: ignore[union-attr]
    assert (state.waiting, state.running) == (1, 1)
    scheduler.finish(second, "abort")
    scheduler.finish(make("A", 9, 4, 5), "abort")  # never queued
    assert (state.waiting, state.running) == (0, 1)
    scheduler.finish(first, "abort")
    assert (state.waiting, state.running) == (0, 0)


@settings(max_examples=40, deadline=None)
@given(
    arrivals=st.lists(
        st.tuples(st.integers(0, 9), st.integers(1, 40), st.integers(1, 12), st.integers(0, 3)),
        min_size=1,
        max_size=40,
    ),
    seqs=st.integers(1, 4),
    pages=st.integers(12, 40),
    abort_every=st.integers(0, 7),
)
def test_forgetting_idle_tenants_changes_no_decision(
    arrivals: list[tuple[int, int, int, int]], seqs: int, pages: int, abort_every: int
) -> None:
    """Two schedulers see the same requests (ten tenants coming and going, aborts, preemption in small
    pools); one forgets idle tenants at every chance, the other never: every step's plan, every
    admission and every active tenant's counter are the same."""
    page_size = 4
    pages = max(pages, -(-max(p + m for _, p, m, _ in arrivals) // page_size))
    twins = []
    for prune in (True, False):
        vtc = VirtualTokenCounter(W_P, W_Q, prune=prune, sweep_minimum=1)
        twins.append((Scheduler(PagePool(pages), page_size, seqs, 24, queue=FairQueue(vtc)), vtc))
    pending = list(enumerate(arrivals))
    step = 0
    while pending or any(s.has_unfinished() for s, _ in twins):
        # Requests arrive in bursts: the gap (0-3 steps) before each says when.
        while pending and pending[0][1][3] <= 0:
            index, (tenant, prompt, tokens, _) = pending.pop(0)
            for scheduler, _ in twins:
                scheduler.add(make(f"t{tenant}", index, prompt, tokens))
        if pending:
            index, (tenant, prompt, tokens, gap) = pending[0]
            pending[0] = (index, (tenant, prompt, tokens, gap - 1))
        decisions = []
        for scheduler, _ in twins:
            plan = scheduler.schedule()
            chunks = [(c.request.request_id, c.num_tokens) for c in plan.chunks]
            decisions.append((chunks, [r.request_id for r in plan.preempted]))
            check_pages(scheduler)
            scheduler.postprocess(plan, [TOKEN] * len(plan.sampling))
            if abort_every and step % abort_every == abort_every - 1 and scheduler.running:
                scheduler.finish(scheduler.running[-1], "abort")
        assert decisions[0] == decisions[1], f"step {step}"
        pruned, full = twins[0][1], twins[1][1]
        for tenant, state in pruned.tenants.items():
            assert state.counter == full.tenants[tenant].counter
        active = {t for t, s in full.tenants.items() if s.waiting or s.running}
        assert active <= set(pruned.tenants)
        for vtc in (pruned, full):  # the incrementally kept set the newcomer check reads, after aborts
            assert vtc._unserved == {t for t, s in vtc.tenants.items() if s.waiting and not s.running}
        step += 1
        assert step < 2000, "no progress"


def test_many_short_lived_tenants_leave_bounded_state() -> None:
    """A replica that sees 5,000 tenants, each sending one request while one tenant stays busy, keeps the
    counters of a few dozen, not of every tenant it ever served."""
    scheduler = fair_scheduler(pages=256, page_size=4, seqs=4, budget=64)
    assert isinstance(scheduler.queue, FairQueue)
    vtc = scheduler.queue.vtc
    run = Run(scheduler)
    for i in range(5000):
        scheduler.add(make(f"once{i}", i, 8, 2))
        if not any(r.tenant == "busy" for r in (*scheduler.waiting, *scheduler.running)):
            scheduler.add(make("busy", i, 32, 8))
        run.step()
    while scheduler.has_unfinished():
        run.step()
    assert len(vtc.tenants) <= 2 * vtc.sweep_minimum + 2, len(vtc.tenants)
    assert len(vtc._idle) <= 2 * vtc.sweep_minimum + 2

"""Continuous batching bookkeeping, driven by a fake model that needs no torch: every sampled token is 7,
every adapter load succeeds at once (the registry is told so, as the loader would)."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplex.adapters import AdapterError
from loraplex.engine.lora.registry import AdapterRegistry
from loraplex.engine.pool import PageKind, PagePool
from loraplex.engine.request import Request, RequestStatus
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.scheduler import Scheduler, StepPlan
from loraplex.engine.stopping import StopChecker

TOKEN = 7


def make_request(index: int, prompt_len: int, max_tokens: int, adapter: str | None = None) -> Request:
    params = SamplingParams(max_tokens=max_tokens)
    return Request(f"r{index}", list(range(1, prompt_len + 1)), params, index, adapter=adapter)


@dataclass(frozen=True)
class FakeSource:
    """What the registry keeps of a source: its manifest's digest (the weights are the loader's)."""

    sha256: str = "0" * 64

    @property
    def manifest(self) -> Any:
        return SimpleNamespace(sha256=self.sha256)


@dataclass
class Listener:
    dropped_names: list[str] = field(default_factory=list)
    forgotten_names: list[str] = field(default_factory=list)

    def dropped(self, name: str) -> None:
        self.dropped_names.append(name)

    def forgotten(self, name: str) -> None:
        self.forgotten_names.append(name)


def load_all(registry: AdapterRegistry | None, plan: StepPlan) -> None:
    """The loader's part: every load succeeds."""
    for load in plan.adapter_loads:
        assert registry is not None
        assert all(registry.pool.owner_of(p) == ("adapter", load.name) for p in load.pages)
        registry.loaded(load.name)


def check_pages(scheduler: Scheduler) -> None:
    """Every page is free, the zero page, a running request's, or a resident adapter's: once."""
    owned = [p for r in scheduler.running for p in r.pages]
    registry = scheduler.adapters
    if registry is not None:
        for name in registry.resident_names():
            entry = registry.entry(name)
            assert entry is not None and entry.pages is not None
            owned += entry.pages
    assert len(owned) == len(set(owned)), "a page is owned twice"
    assert len(owned) + scheduler.pool.num_free == scheduler.pool.num_pages, "a page leaked"
    by_kind = scheduler.pool.pages_by_kind()
    assert by_kind["kv"] == sum(len(r.pages) for r in scheduler.running)
    assert by_kind["kv"] + by_kind["adapter"] + by_kind["free"] == scheduler.pool.num_pages


def run_to_completion(
    scheduler: Scheduler, requests: list[Request], max_steps: int = 10_000
) -> dict[str, int]:
    """Step a fake model: each sampled chunk appends token 7. Checks invariants after every step."""
    stats = {"steps": 0, "preemptions": 0, "max_batch": 0}
    for request in requests:
        scheduler.add(request)
    while scheduler.has_unfinished():
        stats["steps"] += 1
        assert stats["steps"] < max_steps, "no progress"
        out = scheduler.schedule()
        load_all(scheduler.adapters, out)
        assert out.chunks, "an unfinished scheduler scheduled nothing"
        assert out.num_tokens <= scheduler.max_batch_tokens
        assert len(scheduler.running) <= scheduler.max_num_seqs
        assert len({id(c.request) for c in out.chunks}) == len(out.chunks), "a request twice in one step"
        stats["preemptions"] += len(out.preempted)
        stats["max_batch"] = max(stats["max_batch"], len(out.chunks))
        for chunk in out.chunks:
            request = chunk.request
            assert chunk.start == request.num_computed_tokens
            assert len(request.pages) * scheduler.page_size >= chunk.end, "chunk runs past its pages"
            assert request.status is RequestStatus.RUNNING
            if request.adapter is not None:
                assert request.holds_adapter
        check_pages(scheduler)
        sampled = scheduler.postprocess(out, [TOKEN] * len(out.sampling))
        assert sampled == [c.request for c in out.chunks if c.samples]
        check_pages(scheduler)
    kv = scheduler.pool.pages_by_kind()["kv"]
    assert kv == 0 and not scheduler.running and not scheduler.waiting
    return stats


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(1, 80), st.integers(1, 40)), min_size=1, max_size=12),
    page_size=st.sampled_from([1, 4, 16]),
    budget=st.integers(8, 96),
    slack_pages=st.integers(0, 40),
)
def test_every_request_finishes_and_no_page_leaks(
    lengths: list[tuple[int, int]], page_size: int, budget: int, slack_pages: int
) -> None:
    longest = max(p + m for p, m in lengths)
    pool = PagePool(-(-longest // page_size) + slack_pages)
    scheduler = Scheduler(pool, page_size, max_num_seqs=8, max_batch_tokens=budget)
    requests = [make_request(i, p, m) for i, (p, m) in enumerate(lengths)]
    run_to_completion(scheduler, requests)
    for request, (_, max_tokens) in zip(requests, lengths, strict=True):
        assert request.status is RequestStatus.FINISHED
        assert len(request.output_token_ids) == max_tokens


def test_small_pool_forces_preemption_by_recompute() -> None:
    pool = PagePool(12)
    scheduler = Scheduler(pool, page_size=4, max_num_seqs=8, max_batch_tokens=64)
    requests = [make_request(i, 10, 20) for i in range(4)]
    stats = run_to_completion(scheduler, requests)
    assert stats["preemptions"] > 0
    assert sum(r.num_preemptions for r in requests) == stats["preemptions"]
    # The earliest request is never the victim: it always has priority.
    assert requests[0].num_preemptions == 0


def test_chunked_prefill_splits_long_prompts_under_the_budget() -> None:
    pool = PagePool(64)
    scheduler = Scheduler(pool, page_size=16, max_num_seqs=4, max_batch_tokens=32)
    long_request = make_request(0, 100, 2)
    scheduler.add(long_request)
    starts = []
    while long_request.num_computed_tokens < 100:
        out = scheduler.schedule()
        (chunk,) = out.chunks
        assert chunk.num_tokens <= 32
        starts.append(chunk.start)
        assert chunk.samples == (chunk.end == 100)
        sampled = scheduler.postprocess(out, [TOKEN] * chunk.samples)
        assert sampled == ([long_request] if chunk.samples else [])
    assert starts == [0, 32, 64, 96] and long_request.output_token_ids == [TOKEN]


def test_requests_join_a_running_batch_between_steps() -> None:
    pool = PagePool(64)
    scheduler = Scheduler(pool, page_size=4, max_num_seqs=4, max_batch_tokens=64)
    first = make_request(0, 5, 10)
    scheduler.add(first)
    scheduler.postprocess(scheduler.schedule(), [TOKEN])
    second = make_request(1, 3, 10)
    scheduler.add(second)
    out = scheduler.schedule()
    assert [(c.request.request_id, c.num_tokens) for c in out.chunks] == [("r0", 1), ("r1", 3)]


def test_max_num_seqs_caps_the_running_batch() -> None:
    pool = PagePool(100)
    scheduler = Scheduler(pool, page_size=4, max_num_seqs=2, max_batch_tokens=64)
    stats = run_to_completion(scheduler, [make_request(i, 3, 5) for i in range(5)])
    assert stats["max_batch"] == 2


def test_a_request_waits_until_its_adapter_and_its_chunk_fit_together() -> None:
    """Admission counts the adapter's pages: with room for the adapter but not for it and the prompt's
    pages, the request waits, and no pages are handed to its adapter (only to be evicted again at once)."""
    pool = PagePool(12)
    registry = AdapterRegistry(pool)
    registry.register("a", FakeSource(), num_pages=4)
    scheduler = Scheduler(pool, page_size=4, max_num_seqs=4, max_batch_tokens=64, adapters=registry)
    hog = make_request(0, prompt_len=24, max_tokens=4)  # 6 pages of 12: 6 left
    scheduler.add(hog)
    plan = scheduler.schedule()
    assert [c.request for c in plan.chunks] == [hog] and not plan.adapter_loads
    scheduler.postprocess(plan, [TOKEN])  # prefilled; its first decode takes a page
    tenant = make_request(1, prompt_len=12, max_tokens=2, adapter="a")  # 3 pages + 4: 7 > 5 free
    scheduler.add(tenant)
    plan = scheduler.schedule()
    assert [c.request for c in plan.chunks] == [hog] and list(scheduler.waiting) == [tenant]
    assert not plan.adapter_loads and pool.num_free == 5
    scheduler.finish(hog, "length")
    plan = scheduler.schedule()
    assert [c.request for c in plan.chunks] == [tenant]
    assert [(load.name, len(load.pages)) for load in plan.adapter_loads] == [("a", 4)]
    assert pool.pages_by_kind()["adapter"] == 4  # counted against the pool before any copy


@settings(max_examples=60, deadline=None)
@given(
    requests=st.lists(
        st.tuples(st.integers(1, 40), st.integers(1, 12), st.sampled_from([None, "a", "b", "c", "d"])),
        min_size=1,
        max_size=12,
    ),
    adapter_pages=st.integers(1, 4),
    slack_pages=st.integers(0, 24),
    max_resident=st.sampled_from([None, 1, 2]),
)
def test_adapters_and_requests_share_the_pool_without_leaks(
    requests: list[tuple[int, int, str | None]],
    adapter_pages: int,
    slack_pages: int,
    max_resident: int | None,
) -> None:
    page_size = 4
    longest = max(p + m for p, m, _ in requests)
    pool = PagePool(-(-longest // page_size) + adapter_pages + slack_pages)
    registry = AdapterRegistry(pool, max_resident)
    for name in "abcd":
        registry.register(name, FakeSource(), num_pages=adapter_pages)
    scheduler = Scheduler(pool, page_size, max_num_seqs=4, max_batch_tokens=32, adapters=registry)
    made = [make_request(i, p, m, a) for i, (p, m, a) in enumerate(requests)]
    run_to_completion(scheduler, made)
    assert all(len(r.output_token_ids) == r.params.max_tokens for r in made)
    # Unused adapters stay resident until their pages are wanted; nothing else is left.
    assert pool.pages_by_kind()["adapter"] == adapter_pages * len(registry.resident_names())
    assert max_resident is None or len(registry.resident_names()) <= max_resident
    assert all(registry.entry(n).users == 0 for n in "abcd")


def test_postprocess_finishes_on_eos_stop_tokens_and_length() -> None:
    pool = PagePool(32)
    scheduler = Scheduler(pool, 4, 8, 64, stop=StopChecker(eos_token_ids=[2], max_model_len=9))
    eos, stop_token, long = make_request(0, 3, 10), make_request(1, 3, 10), make_request(2, 3, 10)
    stop_token.params = SamplingParams(max_tokens=10, stop_token_ids=[5])
    for request in (eos, stop_token, long):
        scheduler.add(request)
    plan = scheduler.schedule()
    assert scheduler.postprocess(plan, [2, 5, 4]) == [eos, stop_token, long]
    assert (eos.finish_reason, stop_token.finish_reason, stop_token.output.stop_reason) == ("stop", "stop", 5)
    assert not long.finished
    for _ in range(5):  # the context holds 9 tokens: 3 of prompt, 6 of output
        scheduler.postprocess(scheduler.schedule(), [4])
    assert long.finish_reason == "length" and long.num_tokens == 9
    with pytest.raises(ValueError, match="sampled 2 tokens for 0 requests"):
        scheduler.postprocess(StepPlan(), [1, 2])
    assert pool.num_free == pool.num_pages


def test_a_request_whose_adapter_is_refused_while_it_waits_is_refused_not_run() -> None:
    pool = PagePool(16)
    registry = AdapterRegistry(pool)
    registry.register("bad", FakeSource(), num_pages=2)
    scheduler = Scheduler(pool, 4, 4, 64, adapters=registry)
    doomed, fine = make_request(0, 3, 2, adapter="bad"), make_request(1, 3, 2)
    scheduler.add(doomed)
    scheduler.add(fine)
    registry.mark_failed("bad", "its weights are NaN")
    plan = scheduler.schedule()
    assert plan.refused == [doomed] and doomed.finish_reason == "error"
    assert [c.request for c in plan.chunks] == [fine] and not plan.adapter_loads


def test_unregister_drains_then_forgets_and_the_name_can_come_back() -> None:
    pool = PagePool(16)
    registry = AdapterRegistry(pool)
    listener = Listener()
    registry.listeners.append(listener)
    registry.register("gone", FakeSource(), num_pages=3)
    scheduler = Scheduler(pool, 4, 4, 64, adapters=registry)
    running, queued = make_request(0, 3, 3, adapter="gone"), make_request(1, 3, 3, adapter="gone")
    scheduler.max_num_seqs = 1  # `queued` waits behind `running`
    scheduler.add(running)
    scheduler.add(queued)
    plan = scheduler.schedule()
    load_all(registry, plan)
    assert registry.unregister("gone") is False  # two requests use it: it drains
    assert "gone" not in registry and registry.names() == []
    with pytest.raises(AdapterError, match="not registered"):
        registry.add_user("gone")  # a new request naming it is refused at once
    with pytest.raises(AdapterError, match="not registered"):
        registry.unregister("gone")
    with pytest.raises(AdapterError, match="being unregistered"):
        registry.register("gone", FakeSource(), num_pages=3)
    run_to_completion(scheduler, [])
    assert running.finish_reason == queued.finish_reason == "length"  # both served to the end
    assert registry.entry("gone") is None and listener.forgotten_names == ["gone"]
    assert pool.pages_by_kind()[PageKind.ADAPTER] == 0 and pool.num_free == pool.num_pages
    registry.register("gone", FakeSource("1" * 64), num_pages=3)  # the name is free again
    assert "gone" in registry and registry.unregister("gone") is True


def _fake_token(request: Request) -> int:
    """The fake model's next token: a function of the request and the output position (0 is the end
    of sequence), as a seeded draw is, so the plain and the pipelined loop must agree."""
    return (sum(map(ord, request.request_id)) * 31 + request.num_generated * 17) % 23


def _drive(
    scheduler: Scheduler, requests: list[Request], pipelined: bool
) -> dict[str, tuple[list[int], str]]:
    for request in requests:
        scheduler.add(request)
    in_flight: tuple[StepPlan, list[int]] | None = None
    steps = 0
    while scheduler.has_unfinished():
        steps += 1
        assert steps < 10_000, "no progress"
        plan = scheduler.schedule()
        load_all(scheduler.adapters, plan)
        for chunk in plan.chunks:
            assert chunk.start == chunk.request.num_computed_tokens
            assert len(chunk.request.pages) * scheduler.page_size >= chunk.end
        tokens = [_fake_token(r) for r in plan.sampling]  # drawn on the device, at launch
        if not pipelined:
            scheduler.postprocess(plan, tokens)
            check_pages(scheduler)
            continue
        scheduler.advance(plan)
        if in_flight is not None:
            scheduler.land(*in_flight)
        in_flight = (plan, tokens) if plan.chunks else None
        assert in_flight is not None or not scheduler.running or scheduler.waiting, "stalled"
    assert scheduler.pool.pages_by_kind()["kv"] == 0
    return {r.request_id: (r.output_token_ids, r.finish_reason or "") for r in requests}


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 24)), min_size=1, max_size=10),
    page_size=st.sampled_from([1, 4]),
    budget=st.integers(8, 64),
    slack_pages=st.integers(0, 24),
    seqs=st.integers(1, 6),
)
def test_pipelined_steps_give_the_plain_loop_s_outputs(
    lengths: list[tuple[int, int]], page_size: int, budget: int, slack_pages: int, seqs: int
) -> None:
    """Async scheduling's bookkeeping: planning step n+1 after `advance(n)` and landing n afterwards
    gives every request the tokens and finish reason of the plain loop, with preemption (small pools),
    end-of-sequence stops that the next plan did not know of, and no page left behind."""
    budget = max(budget, seqs)
    longest = max(p + m for p, m in lengths)
    pages = -(-longest // page_size) + 1 + slack_pages

    def run(pipelined: bool) -> dict[str, tuple[list[int], str]]:
        scheduler = Scheduler(
            PagePool(pages),
            page_size,
            seqs,
            budget,
            stop=StopChecker(eos_token_ids=(0,), max_model_len=10**6),
        )
        requests = [make_request(i, p, m) for i, (p, m) in enumerate(lengths)]
        return _drive(scheduler, requests, pipelined)

    plain = run(pipelined=False)
    assert run(pipelined=True) == plain

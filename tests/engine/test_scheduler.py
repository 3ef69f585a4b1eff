"""Continuous batching bookkeeping, driven by a fake model that needs no torch."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from loraplex.engine.pool import PagePool
from loraplex.engine.request import Request, RequestStatus
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.scheduler import Scheduler


def make_request(index: int, prompt_len: int, max_tokens: int) -> Request:
    return Request(f"r{index}", list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens), index)


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
        owned = [p for r in scheduler.running for p in r.pages]
        assert len(owned) == len(set(owned)), "a page is owned by two requests"
        assert len(owned) + scheduler.pool.num_free == scheduler.pool.num_pages, "a page leaked"
        for chunk in out.chunks:
            chunk.request.num_computed_tokens = chunk.end
            if chunk.samples:
                chunk.request.output_token_ids.append(7)
                if len(chunk.request.output_token_ids) >= chunk.request.params.max_tokens:
                    scheduler.finish(chunk.request, "length")
    assert scheduler.pool.num_free == scheduler.pool.num_pages
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
        long_request.num_computed_tokens = chunk.end
    assert starts == [0, 32, 64, 96]


def test_requests_join_a_running_batch_between_steps() -> None:
    pool = PagePool(64)
    scheduler = Scheduler(pool, page_size=4, max_num_seqs=4, max_batch_tokens=64)
    first = make_request(0, 5, 10)
    scheduler.add(first)
    out = scheduler.schedule()
    first.num_computed_tokens = out.chunks[0].end
    first.output_token_ids.append(7)
    second = make_request(1, 3, 10)
    scheduler.add(second)
    out = scheduler.schedule()
    assert [(c.request.request_id, c.num_tokens) for c in out.chunks] == [("r0", 1), ("r1", 3)]


def test_max_num_seqs_caps_the_running_batch() -> None:
    pool = PagePool(100)
    scheduler = Scheduler(pool, page_size=4, max_num_seqs=2, max_batch_tokens=64)
    stats = run_to_completion(scheduler, [make_request(i, 3, 5) for i in range(5)])
    assert stats["max_batch"] == 2


class CountingAdapters:
    """Adapter residency as the scheduler sees it: each adapter takes `pages` pool pages when loaded."""

    def __init__(self, pool: PagePool, pages: int):
        self.pool, self.pages = pool, pages
        self.held: dict[str, list[int]] = {}
        self.references: dict[str, int] = {}
        self.loads = 0

    def pages_needed(self, name: str) -> int:
        return 0 if name in self.held else self.pages

    def acquire(self, name: str) -> bool:
        if name not in self.held:
            if not self.pool.can_allocate(self.pages):
                return False
            self.held[name] = self.pool.allocate(self.pages, ("adapter", name))
            self.loads += 1
        self.references[name] = self.references.get(name, 0) + 1
        return True

    def release(self, name: str) -> None:
        self.references[name] -= 1

    def evict_unused(self, pages_wanted: int) -> int:
        freed = 0
        for name in [n for n, refs in self.references.items() if refs == 0]:
            if self.pool.num_free >= pages_wanted:
                break
            self.pool.free(self.held.pop(name), ("adapter", name))
            del self.references[name]
            freed += self.pages
        return freed

    def evictable_pages(self) -> int:
        return sum(len(self.held[n]) for n, refs in self.references.items() if refs == 0)


def test_a_request_waits_until_its_adapter_and_its_chunk_fit_together() -> None:
    """Admission counts the adapter's pages: with room for the adapter but not for it and the prompt's
    pages, the request waits, and its adapter is not loaded (only to be evicted again at once)."""
    pool = PagePool(12)
    adapters = CountingAdapters(pool, pages=4)
    scheduler = Scheduler(pool, page_size=4, max_num_seqs=4, max_batch_tokens=64, adapters=adapters)
    hog = make_request(0, prompt_len=24, max_tokens=4)  # 6 pages of 12: 6 left
    scheduler.add(hog)
    assert [c.request for c in scheduler.schedule().chunks] == [hog]
    hog.num_computed_tokens, hog.output_token_ids = 24, [7]  # prefilled; its first decode takes a page
    tenant = make_request(1, prompt_len=12, max_tokens=2)  # 3 pages + 4 for its adapter: 7 > 5 free
    tenant.adapter = "a"
    scheduler.add(tenant)
    out = scheduler.schedule()
    assert [c.request for c in out.chunks] == [hog] and list(scheduler.waiting) == [tenant]
    assert adapters.loads == 0 and pool.num_free == 5
    scheduler.finish(hog, "length")
    out = scheduler.schedule()
    assert [c.request for c in out.chunks] == [tenant] and adapters.loads == 1

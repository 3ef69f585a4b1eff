"""Prefix caching in the scheduler and the pool, with a fake model whose "keys and values" are real data:
every computed slot of the pool stores a digest of (adapter weights, the tokens up to it), and the sampled
token is a function of the slots a step reads. A stale, wrong or overwritten cached page changes the
outputs, so "the same outputs with the cache as without" is a real check, under preemption, eviction and
an adapter registered again with other weights."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplex.engine import EngineConfig, LLMEngine
from loraplex.engine.lora.registry import AdapterRegistry
from loraplex.engine.lora.synthetic import SyntheticAdapter
from loraplex.engine.pool import PageKind, PagePool
from loraplex.engine.prefix_cache import CACHE_OWNER, NoPrefixCache, PrefixCache
from loraplex.engine.request import Request, RequestStatus
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.scheduler import Scheduler

from .test_scheduler import FakeSource, load_all


@dataclass
class FakeModel:
    """Pool memory as a dict (page, offset) -> what was computed there; freed pages keep their contents."""

    memory: dict[tuple[int, int], bytes] = field(default_factory=dict)
    computed_tokens: int = 0

    def run(self, scheduler: Scheduler, digest_of: dict[str | None, str]) -> list[int]:
        plan = scheduler.schedule()
        load_all(scheduler.adapters, plan)
        assert plan.chunks, "an unfinished scheduler scheduled nothing"
        sampled = []
        page_size = scheduler.page_size
        for chunk in plan.chunks:
            request = chunk.request
            digest = digest_of[request.adapter]
            for pos in range(chunk.start, chunk.end):
                page = request.pages[pos // page_size]
                # A request writes only into its own pages, never into a shared cached one.
                assert scheduler.pool.owner_of(page) == request.request_id, (page, pos)
                self.memory[page, pos % page_size] = truth(digest, request.tokens(0, pos + 1))
            self.computed_tokens += chunk.num_tokens
            if chunk.samples:
                read = hashlib.sha256()
                for pos in range(chunk.end):
                    read.update(self.memory[request.pages[pos // page_size], pos % page_size])
                sampled.append(1 + read.digest()[0] % 50)
        scheduler.postprocess(plan, sampled)
        return sampled


def truth(digest: str, tokens: list[int]) -> bytes:
    return hashlib.sha256(digest.encode() + bytes(str(tokens), "ascii")).digest()


def check_pool(scheduler: Scheduler, cache: PrefixCache | NoPrefixCache | None) -> None:
    """Each page is free or has one owner; a request's own pages are its alone; a cached page's
    reference count is the number of requests holding it."""
    pool = scheduler.pool
    holders: dict[int, int] = {}
    for request in scheduler.running:
        assert len(set(request.pages)) == len(request.pages)
        for page in request.pages:
            holders[page] = holders.get(page, 0) + 1
            owner = pool.owner_of(page)
            assert owner in (request.request_id, CACHE_OWNER), (page, owner)
            if owner == request.request_id:
                assert holders[page] == 1, f"private page {page} in two requests"
    for request in scheduler.waiting:
        assert not request.pages
    if isinstance(cache, PrefixCache):
        for page, entry in cache._pages.items():
            assert pool.owner_of(page) == CACHE_OWNER
            assert entry.references == holders.get(page, 0), page
            assert (page in cache._unused) == (entry.references == 0 and entry.hashed)
    by_kind = pool.pages_by_kind()
    assert sum(by_kind.values()) == pool.num_pages
    assert by_kind["free"] == pool.num_free


def run_all(
    scheduler: Scheduler, requests: list[Request], digest_of: dict[str | None, str], model: FakeModel
) -> None:
    for request in requests:
        scheduler.add(request)
    steps = 0
    while scheduler.has_unfinished():
        steps += 1
        assert steps < 5000, "no progress"
        model.run(scheduler, digest_of)
        check_pool(scheduler, scheduler.prefix_cache)
    assert scheduler.pool.pages_by_kind()["kv"] == 0
    assert all(r.status is RequestStatus.FINISHED for r in requests)


def build(
    num_pages: int, page_size: int, budget: int, caching: bool, digests: dict[str, str]
) -> tuple[Scheduler, PrefixCache | None]:
    pool = PagePool(num_pages)
    pool.allocate(1, "zero-page", PageKind.RESERVED)
    registry = AdapterRegistry(pool)
    for name, digest in digests.items():
        registry.register(name, FakeSource(digest), num_pages=2)  # type: ignore[arg-type]
    cache = None
    if caching:
        cache = PrefixCache(pool, page_size, lambda name: registry.view[name].sha256)
        registry.listeners.append(cache)
    scheduler = Scheduler(pool, page_size, 4, budget, registry, prefix_cache=cache)
    return scheduler, cache


SYSTEM = list(range(100, 120))  # a shared system prompt


def make_requests(specs: list[tuple[int, int, int, str | None]], tag: str) -> list[Request]:
    """(conversation, turn, max_tokens, adapter): later turns of a conversation extend earlier ones."""
    requests = []
    for i, (conversation, turn, max_tokens, adapter) in enumerate(specs):
        prompt = SYSTEM + [conversation] * 3 + [200 + t for t in range(turn * 5)]
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        requests.append(Request(f"{tag}{i}", prompt, params, i, adapter=adapter))
    return requests


def outputs(
    specs: list[tuple[int, int, int, str | None]],
    caching: bool,
    num_pages: int,
    page_size: int,
    budget: int,
    reregister: bool,
) -> tuple[list[list[int]], FakeModel, PrefixCache | None]:
    """Run the requests (in two waves; between them, with `reregister`, adapter a is unregistered and
    registered again with other weights) and return every request's output tokens."""
    digests = {"a": "a" * 64, "b": "b" * 64}
    scheduler, cache = build(num_pages, page_size, budget, caching, digests)
    assert scheduler.adapters is not None
    model = FakeModel()
    digest_of: dict[str | None, str] = {None: "base", **digests}
    first = make_requests(specs, "x")
    run_all(scheduler, first, digest_of, model)
    if reregister:
        scheduler.adapters.unregister("a")
        digests["a"] = digest_of["a"] = "c" * 64
        scheduler.adapters.register("a", FakeSource(digests["a"]), num_pages=2)  # type: ignore[arg-type]
    second = make_requests(specs, "y")
    run_all(scheduler, second, digest_of, model)
    return [r.output_token_ids for r in first + second], model, cache


spec = st.tuples(st.integers(0, 3), st.integers(0, 4), st.integers(1, 12), st.sampled_from([None, "a", "b"]))


@settings(max_examples=40, deadline=None)
@given(
    specs=st.lists(spec, min_size=1, max_size=10),
    page_size=st.sampled_from([1, 4, 8]),
    slack=st.integers(0, 30),
    budget=st.integers(16, 64),
    reregister=st.booleans(),
)
def test_same_outputs_with_and_without_the_cache(
    specs: list[tuple[int, int, int, str | None]], page_size: int, slack: int, budget: int, reregister: bool
) -> None:
    # The pool holds one longest request and both adapters, plus slack: small pools preempt and evict.
    longest = len(SYSTEM) + 3 + 4 * 5 + 12
    num_pages = 1 + 4 + -(-longest // page_size) + slack
    without, _, _ = outputs(specs, False, num_pages, page_size, budget, reregister)
    with_cache, _, cache = outputs(specs, True, num_pages, page_size, budget, reregister)
    assert with_cache == without
    assert cache is not None and cache.hit_tokens <= cache.queried_tokens


def test_second_wave_hits_and_computes_less() -> None:
    specs = [(c, t, 4, adapter) for c in range(2) for t in range(3) for adapter in (None, "a")]
    _, plain, _ = outputs(specs, False, 200, 4, 64, reregister=False)
    _, cached, cache = outputs(specs, True, 200, 4, 64, reregister=False)
    assert cache is not None
    stats = cache.stats()
    # The second wave repeats the first: all but the last page of each prompt is found.
    assert stats.hit_tokens > stats.queried_tokens / 2 and stats.cached_pages > 0
    assert cached.computed_tokens < plain.computed_tokens - stats.hit_tokens // 2


def test_tenants_never_hit_each_others_pages() -> None:
    scheduler, cache = build(64, 4, 64, True, {})
    assert cache is not None
    first, same, other = make_requests([(0, 2, 2, None)] * 3, "t")
    first.tenant = same.tenant = "acme"
    other.tenant = "globex"
    for request in (first, same, other):
        scheduler.add(request)
        while not request.finished:
            plan = scheduler.schedule()
            scheduler.postprocess(plan, [7] * len(plan.sampling))
    assert same.num_cached_tokens > 0  # its own tenant's pages are found
    assert other.num_cached_tokens == 0  # the same prompt from another tenant finds none of them


def test_reregistered_adapter_never_hits_its_old_pages() -> None:
    specs = [(0, 2, 3, "a")]
    _, _, cache = outputs(specs, True, 100, 4, 64, reregister=True)
    assert cache is not None
    # The first run cached a's pages; after re-registering, the second run found none of them.
    assert cache.hit_tokens == 0
    assert all(entry.adapter != "a" or entry.references == 0 for entry in cache._pages.values())


def test_base_and_adapter_pages_are_kept_apart() -> None:
    specs = [(0, 1, 2, None), (0, 1, 2, "a"), (0, 1, 2, "b")]
    scheduler, cache = build(100, 4, 64, True, {"a": "a" * 64, "b": "b" * 64})
    assert cache is not None
    model = FakeModel()
    digest_of: dict[str | None, str] = {None: "base", "a": "a" * 64, "b": "b" * 64}
    for request in make_requests(specs, "z"):  # one at a time: each could only hit another's pages
        run_all(scheduler, [request], digest_of, model)
    assert cache.hit_tokens == 0 and cache.stats().cached_pages == 3 * ((len(SYSTEM) + 3 + 5 + 2) // 4)


def test_cached_pages_and_unused_adapters_share_one_lru_budget() -> None:
    scheduler, cache = build(16, 4, 64, True, {"a": "a" * 64})
    assert cache is not None and scheduler.adapters is not None
    pool, model = scheduler.pool, FakeModel()
    digest_of: dict[str | None, str] = {None: "base", "a": "a" * 64}
    (adapter_request,) = make_requests([(0, 0, 1, "a")], "p")
    run_all(scheduler, [adapter_request], digest_of, model)  # a resident, unused; its pages cached
    (base_request,) = make_requests([(1, 0, 1, None)], "q")
    run_all(scheduler, [base_request], digest_of, model)  # later: base pages cached
    # 23-token prompts on pages of 4: five full pages cached per request, plus a's two pages.
    assert "a" in scheduler.adapters.resident_names() and pool.reclaimable_pages() == 5 + 5 + 2
    assert pool.num_free == 16 - 1 - 12
    # The oldest go first: a's cached pages (used before the adapter was released), then the adapter.
    a_pages = [p for p, e in cache._pages.items() if e.adapter == "a"]
    pool.reclaim(pool.num_free + len(a_pages))
    assert "a" in scheduler.adapters.resident_names()
    assert all(e.adapter is None for e in cache._pages.values())
    pool.reclaim(pool.num_free + 1)
    assert "a" not in scheduler.adapters.resident_names() and cache.stats().cached_pages > 0
    pool.reclaim(pool.num_pages)
    assert pool.num_free == pool.num_pages - 1 and cache.stats().cached_pages == 0


def test_the_last_token_is_always_computed() -> None:
    scheduler, cache = build(100, 4, 64, True, {})
    assert cache is not None
    model = FakeModel()
    prompt = list(range(1, 17))  # exactly four pages
    first = Request("one", prompt, SamplingParams(max_tokens=1), 0)
    run_all(scheduler, [first], {None: "base"}, model)
    again = Request("two", prompt, SamplingParams(max_tokens=1), 1)
    scheduler.add(again)
    plan = scheduler.schedule()
    (chunk,) = plan.chunks
    # Three pages are shared; the fourth, holding the last token, is recomputed into a page of its own.
    assert chunk.start == 12 and chunk.samples and again.num_cached_tokens == 12
    assert [scheduler.pool.owner_of(p) for p in again.pages] == [CACHE_OWNER] * 3 + ["two"]


def test_pool_transfer_checks_the_owner() -> None:
    pool = PagePool(4)
    (page,) = pool.allocate(1, "r")
    with pytest.raises(ValueError, match="not owned"):
        pool.transfer(page, "someone", CACHE_OWNER, PageKind.PREFIX)
    pool.transfer(page, "r", CACHE_OWNER, PageKind.PREFIX)
    assert pool.pages_by_kind()["prefix"] == 1 and pool.pages_by_kind()["kv"] == 0
    with pytest.raises(ValueError, match="not owned"):
        pool.free([page], "r")
    pool.free([page], CACHE_OWNER)
    assert pool.num_free == 4


# -- the engine: real keys and values -----------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model():  # type: ignore[no-untyped-def]
    return LLMEngine(EngineConfig(model="random:tiny", device="cpu", dtype="float32", num_pages=8)).loaded


def tiny_engine(loaded, caching: bool, num_pages: int, adapters: dict[str, int]) -> LLMEngine:  # type: ignore[no-untyped-def]
    config = EngineConfig(
        model="random:tiny",
        device="cpu",
        dtype="float32",
        num_pages=num_pages,
        page_size=4,
        max_batch_tokens=64,
        prefix_caching=caching,
    )
    engine = LLMEngine(config, loaded=loaded)
    shape = loaded.config.lora_shape()
    for name, seed in adapters.items():
        engine.register_adapter(name, SyntheticAdapter(shape, seed=seed, rank=4, strength=2.0))
    return engine


def chat_turns(engine: LLMEngine, conversations: list[str | None], turns: int) -> list[list[int]]:
    """Multi-turn chats, all conversations at once: each turn's prompt is the last prompt, its answer
    and a new user message (all sharing a system prompt)."""
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    prompts = [[9, 8, 7, 6, 5, 4, 3] + [20 + i] * 3 for i in range(len(conversations))]
    answers = []
    for turn in range(turns):
        outputs = engine.generate(prompts, greedy, adapters=conversations)
        answers += [o.token_ids for o in outputs]
        prompts = [p + o.token_ids + [40 + turn, 41] for p, o in zip(prompts, outputs, strict=True)]
    return answers


# 80 pages: room for all; 24 pages: six conversations of up to 8 pages and two adapters of 7 do not fit,
# so requests are preempted and cached pages and adapters evicted.
@pytest.mark.parametrize("num_pages", [80, 24])
def test_engine_greedy_outputs_equal_with_the_cache(tiny_model, num_pages: int) -> None:  # type: ignore[no-untyped-def]
    adapters = {"a": 1, "b": 2}
    conversations: list[str | None] = [None, "a", "b", "a", None, "b"]
    plain = tiny_engine(tiny_model, False, num_pages, adapters)
    cached = tiny_engine(tiny_model, True, num_pages, adapters)
    preempted: list[str] = []
    preempt = cached.scheduler.preempt
    cached.scheduler.preempt = lambda r: (preempted.append(r.request_id), preempt(r))[1]  # type: ignore[method-assign]
    assert chat_turns(cached, conversations, 3) == chat_turns(plain, conversations, 3)
    stats = cached.stats().prefix
    assert stats is not None and stats.hit_tokens > 0
    assert cached.pool.pages_by_kind()["kv"] == 0 and plain.stats().prefix is None
    if num_pages == 24:
        assert preempted and stats.evictions > 0 and cached.stats().adapter_evictions > 0


def test_engine_reregistered_adapter_gets_no_stale_pages(tiny_model) -> None:  # type: ignore[no-untyped-def]
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompt = list(range(3, 20))
    engine = tiny_engine(tiny_model, True, 40, {"x": 1})
    first = engine.generate([prompt], greedy, adapters="x")[0]
    again = engine.generate([prompt], greedy, adapters="x")[0]
    assert again.num_cached_tokens == 16 and again.token_ids == first.token_ids
    engine.unregister_adapter("x")
    shape = tiny_model.config.lora_shape()
    engine.register_adapter("x", SyntheticAdapter(shape, seed=2, rank=4, strength=2.0))
    other = engine.generate([prompt], greedy, adapters="x")[0]
    assert other.num_cached_tokens == 0
    fresh = tiny_engine(tiny_model, False, 40, {"x": 2})
    assert other.token_ids == fresh.generate([prompt], greedy, adapters="x")[0].token_ids


def test_hit_rate_metrics_follow_the_engine_totals() -> None:
    from dataclasses import replace

    from loraplex.engine.prefix_cache import PrefixStats
    from loraplex.engine.server.metrics import ServerMetrics
    from loraplex.engine.stats import EngineStats

    metrics = ServerMetrics()
    pages = {"free": 4, "kv": 1, "prefix": 2, "adapter": 0, "reserved": 1}
    stats = EngineStats(8, pages, 0, 1, 0, 0, 0, 0, 0, 0, 0.0, 0, 0, 0, 0, prefix=PrefixStats(40, 16, 2, 0))
    metrics.observe_engine(stats)
    metrics.observe_engine(replace(stats, prefix=PrefixStats(100, 64, 3, 1)))
    registry = metrics.registry
    assert registry.get_sample_value("loraplex_prefix_cache_queried_tokens_total") == 100
    assert registry.get_sample_value("loraplex_prefix_cache_hit_tokens_total") == 64
    assert registry.get_sample_value("loraplex_prefix_cache_evictions_total") == 1
    assert registry.get_sample_value("loraplex_prefix_cache_pages") == 3
    assert registry.get_sample_value("loraplex_pool_pages", {"kind": "prefix"}) == 2

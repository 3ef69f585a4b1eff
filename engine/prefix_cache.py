"""Prefix caching: full KV pages, found again by what produced them, shared by the requests that read them.

A page's keys and values depend on the adapter's weights and on every token up to the page's end, so a
full page is keyed by sha256(parent page's key, the page's token ids), chained from a root that names the
adapter by its content digest (the registry's sha256 of its weights; "base" for none) and the tenant (no
tenant can learn from a hit what another tenant sent; requests without one share a chain). A name is never
part of a key: an adapter deleted and registered again under the same name with other weights gets
another digest, and its old pages are dropped anyway when the registry forgets it.

A page becomes cached after the step that filled it: the pool hands it from its request to the cache
(kind `prefix`), and it is then shared, refcounted by the requests whose block tables hold it. A new
request takes the longest chain of cached pages that matches its tokens and computes the rest. It never
takes the page holding its last token, which it must compute so the step samples: so a request only ever
writes into its own pages, never into a shared one, and no copy-on-write is needed. (The cost of that
rule is at most one page recomputed, when the tokens end exactly on a page boundary.)

Cached pages no request reads are kept, least recently used first out, in the pool's one budget with
unused adapters (PagePool.reclaim). Plain bookkeeping: no torch (hashlib and array), like the scheduler.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from .pool import PageKind, PagePool
from .request import Request

CACHE_OWNER = "prefix-cache"
BASE_DIGEST = "base"


@dataclass
class CachedPage:
    key: bytes
    adapter: str | None  # the adapter's name, so its pages can be dropped when it is forgotten
    references: int = 0  # requests whose pages hold it
    hashed: bool = True  # False: dropped from the index (adapter forgotten); freed when unreferenced


@dataclass
class _RequestState:
    keys: list[bytes]  # keys of the request's full pages, in order, computed as far as needed
    committed: int = 0  # the request's pages already offered to the cache


@dataclass(frozen=True)
class PrefixStats:
    queried_tokens: int  # prompt tokens of the admissions that looked in the cache
    hit_tokens: int  # of those, the ones found cached
    cached_pages: int  # pages in the cache, read or not
    evictions: int


class PrefixCache:
    def __init__(self, pool: PagePool, page_size: int, digest_of: Callable[[str], str]):
        """`digest_of(name)` is the content digest of a registered adapter's weights."""
        self.pool = pool
        self.page_size = page_size
        self.digest_of = digest_of
        self._index: dict[bytes, int] = {}  # key -> page
        self._pages: dict[int, CachedPage] = {}
        self._unused: OrderedDict[int, int] = OrderedDict()  # unreferenced page -> last use, oldest first
        self._requests: dict[str, _RequestState] = {}
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.evictions = 0
        pool.add_evictable(self)

    # -- what the scheduler calls -------------------------------------------------------------------

    def peek(self, request: Request) -> int:
        """Tokens that `take` would find cached for a request holding no pages (nothing changes)."""
        return len(self._match(request)) * self.page_size

    def take(self, request: Request) -> None:
        """At admission of a request holding no pages: its pages start with the longest cached chain of
        its tokens, and its computed tokens start past them."""
        assert not request.pages and request.num_computed_tokens == 0, request.request_id
        pages = self._match(request)
        for page in pages:
            entry = self._pages[page]
            entry.references += 1
            self._unused.pop(page, None)
        request.pages = list(pages)
        request.num_computed_tokens = len(pages) * self.page_size
        state = self._state(request)
        state.committed = len(pages)
        prompt = len(request.prompt_token_ids)
        request.num_cached_tokens = min(request.num_computed_tokens, prompt)
        self.queried_tokens += prompt
        self.hit_tokens += request.num_cached_tokens

    def commit(self, request: Request, upto: int | None = None) -> None:
        """After a step computed more of the request: its pages that are now full join the cache (a page
        another request cached first stays the request's own). `upto`: only pages within its first
        `upto` tokens (async scheduling: a later step in flight computed more, not yet checked)."""
        state = self._state(request)
        computed = request.num_computed_tokens if upto is None else min(upto, request.num_computed_tokens)
        full = min(computed // self.page_size, len(request.pages))
        self._extend_keys(request, state, full)
        for index in range(state.committed, full):
            page, key = request.pages[index], state.keys[index]
            if key in self._index:
                continue
            self.pool.transfer(page, request.request_id, CACHE_OWNER, PageKind.PREFIX)
            self._index[key] = page
            self._pages[page] = CachedPage(key, request.adapter, references=1)
        state.committed = max(state.committed, full)

    def release(self, request: Request) -> None:
        """The request gives up its pages: its own are freed, cached ones lose a reader."""
        own = []
        for page in request.pages:
            entry = self._pages.get(page)
            if entry is None:
                own.append(page)
                continue
            entry.references -= 1
            assert entry.references >= 0, page
            if entry.references:
                continue
            if entry.hashed:
                self._unused[page] = self.pool.tick()
            else:
                self._free(page)
        self.pool.free(own, request.request_id)
        request.pages = []
        state = self._requests.get(request.request_id)
        if state is not None:
            state.committed = 0

    def forget_request(self, request: Request) -> None:
        """The request ended: drop its keys."""
        self._requests.pop(request.request_id, None)

    def stats(self) -> PrefixStats:
        return PrefixStats(self.queried_tokens, self.hit_tokens, len(self._pages), self.evictions)

    # -- Evictable (PagePool.reclaim) ------------------------------------------------------------------

    def oldest_unused(self) -> int | None:
        return next(iter(self._unused.values()), None)

    def evict_oldest(self) -> int:
        page, _ = self._unused.popitem(last=False)
        del self._index[self._pages[page].key]
        self._free(page)
        self.evictions += 1
        return 1

    def evictable_pages(self) -> int:
        return len(self._unused)

    # -- ResidencyListener (AdapterRegistry) --------------------------------------------------------

    def dropped(self, name: str) -> None:
        """The adapter left the pool: its weights are the same, so its cached pages stay valid."""

    def forgotten(self, name: str) -> None:
        """The adapter is unregistered or refused: none of its pages may be found again."""
        for page, entry in list(self._pages.items()):
            if entry.adapter != name or not entry.hashed:
                continue
            entry.hashed = False
            del self._index[entry.key]
            if not entry.references:
                del self._unused[page]
                self._free(page)

    # -- inside ---------------------------------------------------------------------------------------

    def _match(self, request: Request) -> list[int]:
        # The page holding the last token is never taken: that token must be computed to sample. A request
        # that scores its prompt (echo with logprobs) takes none until scored: it needs every position's
        # logits (once scored, say after a preemption, it takes what it finds).
        if request.prompt_logprobs is not None and not request.output.prompt_logprobs_done():
            return []
        limit = (request.num_tokens - 1) // self.page_size
        state = self._state(request)
        pages = []
        for index in range(limit):
            self._extend_keys(request, state, index + 1)
            page = self._index.get(state.keys[index])
            if page is None:
                break
            pages.append(page)
        return pages

    def _state(self, request: Request) -> _RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = _RequestState([])
        return state

    def _extend_keys(self, request: Request, state: _RequestState, count: int) -> None:
        """Compute the keys of the request's first `count` full pages (tokens never change once there)."""
        if len(state.keys) >= count:
            return
        if not state.keys:
            digest = BASE_DIGEST if request.adapter is None else self.digest_of(request.adapter)
            # Each tenant's chain is its own: a hit (cached_tokens in usage, a faster first token) must
            # not tell one tenant what another sent. Requests without a tenant share one chain.
            tenant = b"" if request.tenant is None else b"t:" + request.tenant.encode()
            root = b"loraplex-prefix\0" + len(tenant).to_bytes(4, "big") + tenant + digest.encode()
            parent = hashlib.sha256(root).digest()
        else:
            parent = state.keys[-1]
        for index in range(len(state.keys), count):
            start = index * self.page_size
            tokens = array("q", request.tokens(start, start + self.page_size)).tobytes()
            parent = hashlib.sha256(parent + tokens).digest()
            state.keys.append(parent)

    def _free(self, page: int) -> None:
        del self._pages[page]
        self.pool.free([page], CACHE_OWNER)


class NoPrefixCache:
    """Prefix caching off: nothing is found or kept, and a request's pages go straight back to the pool
    (the scheduler's null policy, so it asks the same questions either way)."""

    def __init__(self, pool: PagePool):
        self.pool = pool

    def peek(self, request: Request) -> int:
        return 0

    def take(self, request: Request) -> None:
        pass

    def commit(self, request: Request, upto: int | None = None) -> None:
        pass

    def release(self, request: Request) -> None:
        self.pool.free(request.pages, request.request_id)
        request.pages = []

    def forget_request(self, request: Request) -> None:
        pass

    def stats(self) -> None:
        """None: no cache to report on (EngineStats.prefix)."""
        return None

    def dropped(self, name: str) -> None:
        pass

    def forgotten(self, name: str) -> None:
        pass

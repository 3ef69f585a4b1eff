"""The page allocator of the one device pool that the KV cache, cached prefixes and adapter weights share.

Plain bookkeeping, no torch: which page is free, which is owned, by whom and for what. The device
memory itself is kv_cache.KVCache's tensor; a page index means the same slot there.

Pages nobody needs right now but that are worth keeping (resident adapters no request holds, cached
prefix pages no request reads) stay owned until their pages are wanted. Their holders register with the
pool as `Evictable`; `reclaim` then frees the least recently used of all of them first, so adapters and
cached prefixes share one LRU budget with the KV cache.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable
from enum import StrEnum
from typing import Protocol


class PageKind(StrEnum):
    KV = "kv"
    ADAPTER = "adapter"
    PREFIX = "prefix"  # a full KV page in the prefix cache, shared by the requests that read it
    RESERVED = "reserved"  # page 0: always zero, the target of padding in block tables and LoRA stacks


class PoolExhausted(RuntimeError):
    """More pages were asked for than are free; callers check can_allocate first."""


class Evictable(Protocol):
    """A holder of pages that no request needs now (unused adapters, unread cached prefixes)."""

    def oldest_unused(self) -> int | None:
        """The last-use stamp (PagePool.tick) of what evict_oldest would free; None if nothing."""
        ...

    def evict_oldest(self) -> int:
        """Free the least recently used unneeded item; returns the pages freed."""
        ...

    def evictable_pages(self) -> int: ...


class PagePool:
    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise ValueError(f"a page pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        # Popped from the end: the lowest page numbers are handed out first, which keeps tests readable.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._owner: dict[int, tuple[Hashable, PageKind]] = {}
        self._owned_by_kind: Counter[PageKind] = Counter()  # kept as pages move: stats every step are free
        self._evictables: list[Evictable] = []
        self._clock = 0  # logical time of last use, one scale for every Evictable

    def tick(self) -> int:
        """A last-use stamp: later calls return larger numbers."""
        self._clock += 1
        return self._clock

    def add_evictable(self, holder: Evictable) -> None:
        self._evictables.append(holder)

    def reclaimable_pages(self) -> int:
        """Pages that reclaim could free: those of every holder's unneeded items."""
        return sum(holder.evictable_pages() for holder in self._evictables)

    def reclaim(self, pages_wanted: int) -> int:
        """Evict unneeded items, least recently used first across every holder, until `pages_wanted`
        pages are free or nothing is left to evict; returns the pages freed."""
        freed = 0
        while len(self._free) < pages_wanted:
            stamps = [(holder.oldest_unused(), i) for i, holder in enumerate(self._evictables)]
            candidates = [(stamp, i) for stamp, i in stamps if stamp is not None]
            if not candidates:
                break
            freed += self._evictables[min(candidates)[1]].evict_oldest()
        return freed

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, count: int) -> bool:
        return 0 <= count <= len(self._free)

    def allocate(self, count: int, owner: Hashable, kind: PageKind = PageKind.KV) -> list[int]:
        if count < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({count})")
        if count > len(self._free):
            raise PoolExhausted(f"asked for {count} pages, {len(self._free)} free of {self.num_pages}")
        pages = [self._free.pop() for _ in range(count)]
        for page in pages:
            self._owner[page] = (owner, kind)
        self._owned_by_kind[kind] += count
        return pages

    def free(self, pages: Iterable[int], owner: Hashable) -> None:
        """Return pages to the pool; each must be owned by `owner` (a double free is a bug, and raises)."""
        pages = list(pages)
        for page in pages:
            held = self._owner.get(page)
            if held is None or held[0] != owner:
                raise ValueError(
                    f"page {page} is not owned by {owner!r} (owner: {held[0] if held else None!r})"
                )
        for page in pages:
            self._owned_by_kind[self._owner.pop(page)[1]] -= 1
            self._free.append(page)

    def transfer(self, page: int, owner: Hashable, new_owner: Hashable, kind: PageKind) -> None:
        """Hand an owned page to `new_owner` as `kind` without freeing it (its contents stay)."""
        held = self._owner.get(page)
        if held is None or held[0] != owner:
            raise ValueError(f"page {page} is not owned by {owner!r} (owner: {held[0] if held else None!r})")
        self._owned_by_kind[held[1]] -= 1
        self._owner[page] = (new_owner, kind)
        self._owned_by_kind[kind] += 1

    def owner_of(self, page: int) -> Hashable | None:
        held = self._owner.get(page)
        return held[0] if held else None

    def pages_by_kind(self) -> dict[str, int]:
        return {"free": len(self._free), **{kind.value: self._owned_by_kind[kind] for kind in PageKind}}

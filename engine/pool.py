"""The page allocator of the one device pool that the KV cache (and, later, adapter weights) share.

Plain bookkeeping, no torch: which page is free, which is owned, by whom and for what. The device
memory itself lives in the runner; a page index means the same slot there.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable
from enum import StrEnum


class PageKind(StrEnum):
    KV = "kv"
    ADAPTER = "adapter"
    RESERVED = "reserved"  # page 0: always zero, the target of padding in block tables and LoRA stacks


class PoolExhausted(RuntimeError):
    """More pages were asked for than are free; callers check can_allocate first."""


class PagePool:
    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise ValueError(f"a page pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        # Popped from the end: the lowest page numbers are handed out first, which keeps tests readable.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._owner: dict[int, tuple[Hashable, PageKind]] = {}
        self._owned_by_kind: Counter[PageKind] = Counter()  # kept as pages move: stats every step are free

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

    def owner_of(self, page: int) -> Hashable | None:
        held = self._owner.get(page)
        return held[0] if held else None

    def pages_by_kind(self) -> dict[str, int]:
        return {"free": len(self._free), **{kind.value: self._owned_by_kind[kind] for kind in PageKind}}

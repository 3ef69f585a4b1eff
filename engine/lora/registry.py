"""Which adapters the engine serves, which sit in the pool, and which are refused: plain bookkeeping.

Three tiers, as in S-LoRA: a registered adapter is a validated source (a manifest and a way to read the
weights later); the loader's host cache (`loader.py`) holds packed copies of recently used ones; an
adapter is resident while it owns pages of the pool (kind `adapter`, the same allocator and budget as
the KV cache). This module is the part the scheduler talks to, so it imports no torch and reads no file:
it hands out pages and records what the loader must copy (`pending_loads`), and the loader tells it how
that went (`loaded` / `load_failed`).

Every request naming an adapter is one of its users from the moment it is added until it ends; an
admitted request also holds a reference that keeps the adapter resident. Adapters nobody holds stay
resident until their pages are wanted, then the least recently used goes first. Unregistering is at once
for new requests (the name is unknown from then on) and deferred for the requests already there: the
adapter drains, and when its last user ends its pages and its host copy are freed.

Pinned adapters (`pin`) stay resident while pinned: once placed they are never in the unused list, so
neither eviction nor the KV cache's wants take their pages; their pages come out of the pool before any
other adapter or request is admitted. Pins fit a budget (`pin_budget`): the usable pool less one request at
the full context (or less half the pool, when that is smaller), so the engine can always serve requests
beside them. A pin
that does not fit is refused (`PinRefused`) and changes nothing.

Faults stay with their adapter: weights the loader cannot read, verify or fit, and a step failure the
engine attributes to it (`mark_failed`), refuse the adapter (`failed`, with the reason) until it is
registered again with other weights (another digest) or unregistered.

Other threads (the server's event loop) read `view`: an immutable snapshot of the registration facts,
rebuilt and swapped in by one reference assignment at the end of every operation that changes them
(register, unregister, a refusal, a drained adapter forgotten). Reading it needs no lock and waits for no
step; residency and use counts stay out of it, as they change every step.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Protocol

from loraplex.adapters import AdapterError, AdapterManifest

from ..pool import PageKind, PagePool
from ..stats import AdapterFacts

if TYPE_CHECKING:  # sources read weights with torch; the registry only holds them
    from .sources import AdapterSource

log = logging.getLogger(__name__)


class PinRefused(AdapterError):
    """A pin that would not fit the pool's pin budget; nothing changed."""


@dataclass
class AdapterEntry:
    name: str
    source: AdapterSource
    num_pages: int  # pool pages it occupies when resident
    users: int = 0  # requests in the engine that name it, waiting or running
    references: int = 0  # admitted requests, which keep it resident
    pages: list[int] | None = None  # its pool pages while resident
    loaded: bool = False  # its rows are in those pages (False: pages handed out, the copy still to do)
    draining: bool = False  # unregistered: it serves its users, then it is forgotten
    # Since it was registered (GET /internal/adapters shows them, per adapter and pod, so the gateway's
    # placement can be checked where it lands): requests admitted with it (`acquire`; one put back for
    # want of KV pages counts again when it is admitted again), those that found its rows not yet in the
    # pool (they waited for a load: what prewarm spares), and copies of its rows into the pool.
    admissions: int = 0
    cold_admissions: int = 0
    loads: int = 0

    @property
    def manifest(self) -> AdapterManifest:
        return self.source.manifest

    @property
    def resident(self) -> bool:
        return self.pages is not None


@dataclass(frozen=True)
class AdapterLoad:
    """An adapter to copy into the pool before the step runs: its pages are already its own."""

    name: str
    pages: list[int]
    source: AdapterSource


class ResidencyListener(Protocol):
    """Told when an adapter leaves the pool (its rows are stale) or the engine forgets it entirely."""

    def dropped(self, name: str) -> None: ...

    def forgotten(self, name: str) -> None: ...


class AdapterRegistry:
    def __init__(self, pool: PagePool, max_resident: int | None = None, pin_budget: int | None = None):
        if max_resident is not None and max_resident < 1:
            raise ValueError(f"max_resident must be at least 1, got {max_resident}")
        self.pool = pool
        self.max_resident = max_resident
        # Pool pages pinned adapters may hold in all (None: the usable pool less one page).
        self.pin_budget = pin_budget if pin_budget is not None else pool.num_pages - 1
        self.pinned: dict[str, None] = {}  # pinned adapters, in the order they were pinned
        self.failed: dict[str, str] = {}  # name -> why it is refused (the adapter is at fault)
        self.evictions = 0
        self.version = 0  # changes whenever an adapter's pages change: stacked gathers are stale then
        self.listeners: list[ResidencyListener] = []
        self._entries: dict[str, AdapterEntry] = {}  # registered and draining
        # Resident, unreferenced, oldest first -> last use (PagePool.tick: one clock with cached prefixes)
        self._unused: OrderedDict[str, int] = OrderedDict()
        self._loading: dict[str, None] = {}  # resident, rows not copied yet, in the order handed out
        self._resident: dict[str, None] = {}  # in the order they were placed
        self._num_draining = 0
        # Registered and draining adapters by name, for other threads: replaced whole, never changed.
        self.view: Mapping[str, AdapterFacts] = MappingProxyType({})
        self.largest_pages = 0  # pages of the largest adapter registered or draining (metrics), with the view
        pool.add_evictable(self)  # unused adapters give way to the KV cache, LRU with cached prefixes

    # -- what the engine asks -----------------------------------------------------------------------

    def __contains__(self, name: object) -> bool:
        """Registered and not unregistered: a new request may name it."""
        entry = self._entries.get(name) if isinstance(name, str) else None
        return entry is not None and not entry.draining

    def names(self) -> list[str]:
        """Registered adapters (not those draining), sorted."""
        return sorted(name for name, entry in self._entries.items() if not entry.draining)

    def entry(self, name: str) -> AdapterEntry | None:
        """Registered or draining."""
        return self._entries.get(name)

    def resident_names(self) -> list[str]:
        return list(self._resident)

    def num_resident(self) -> int:
        return len(self._resident)

    def num_registered(self) -> int:
        return len(self._entries) - self._num_draining

    def num_draining(self) -> int:
        return self._num_draining

    # -- registration -------------------------------------------------------------------------------

    def register(self, name: str, source: AdapterSource, num_pages: int) -> AdapterManifest:
        """Make `source` servable under `name`; it takes `num_pages` pages when resident. Registering a
        name again replaces it, unless requests are using it (or still draining it)."""
        if not name:
            raise AdapterError("an adapter needs a non-empty name")
        if num_pages > self.pool.num_pages - 1:
            usable = self.pool.num_pages - 1
            raise AdapterError(f"adapter {name!r} needs {num_pages} pages; the pool has {usable}")
        manifest = source.manifest
        fault = None
        old = self._entries.get(name)
        if old is not None:
            if old.users:
                if old.draining:
                    raise AdapterError(
                        f"adapter {name!r} is being unregistered and {old.users} request(s) still use it; "
                        "register it again when they finish"
                    )
                raise AdapterError(
                    f"adapter {name!r} is serving {old.users} request(s); register the new version under "
                    "another name"
                )
            # The same weights again are the same fault: only other weights clear it.
            if old.manifest.sha256 == manifest.sha256:
                fault = self.failed.get(name)
            self._forget(name)
        self._entries[name] = AdapterEntry(name, source, num_pages)
        if fault is not None:
            self.failed[name] = fault
        self._publish()  # once, after the old entry is gone: no reader sees the name missing in between
        return manifest

    def unregister(self, name: str) -> bool:
        """New requests can no longer name `name`; True if it is forgotten now (pages and host copy
        freed), False if it drains: the requests using it finish, then it is forgotten."""
        entry = self._entries.get(name)
        if entry is None or entry.draining:
            raise AdapterError(f"adapter {name!r} is not registered")
        if entry.users:
            entry.draining = True
            self._num_draining += 1
            self._publish()
            log.info("adapter %s drains: %d request(s) still use it", name, entry.users)
            return False
        self._forget(name)
        self._publish()
        return True

    def mark_failed(self, name: str, reason: str) -> None:
        """Refuse `name` from now on (it is at fault). Its pages are freed as soon as no request holds
        it, its host copy at once, so nothing of it is served again."""
        self.failed[name] = reason
        self.pinned.pop(name, None)  # a refused adapter holds no pages for its pin
        for listener in self.listeners:
            listener.forgotten(name)
        entry = self._entries.get(name)
        if entry is not None and entry.resident and not entry.references:
            self._drop(entry)
        self._publish()
        log.warning("adapter %s is refused from now on: %s", name, reason)

    def warm(self, name: str) -> AdapterLoad | None:
        """Place `name` in the pool ahead of its requests (a pod that joins the adapter's replica set loads
        it before it takes the adapter's traffic). It stays unreferenced, the most recently used of the idle
        adapters, so it gives way like any of them. The copy still to make, or None: resident and loaded
        already, or no pages to be had without taking them from a request (its host copy has to do then).
        AdapterError if it is not registered or is refused."""
        entry = self._entries.get(name)
        if entry is None or entry.draining:
            raise AdapterError(f"adapter {name!r} is not registered")
        if name in self.failed:
            raise AdapterError(f"adapter {name!r} is refused: {self.failed[name]}")
        if not entry.resident:
            if not self._place(entry):
                return None
            if name not in self.pinned:
                self._unused[name] = self.pool.tick()
        elif name in self._unused:
            self._unused[name] = self.pool.tick()
            self._unused.move_to_end(name)
        if entry.loaded:
            return None
        assert entry.pages is not None
        return AdapterLoad(name, list(entry.pages), entry.source)

    def unwarm(self, name: str) -> None:
        """A warm load that failed without the adapter being at fault: give its pages back unless a request
        holds them (then that request's step tries the load again)."""
        entry = self._entries.get(name)
        if entry is not None and entry.resident and not entry.loaded and not entry.references:
            self._drop(entry)

    def pinned_pages(self, excluding: str | None = None) -> int:
        """Pool pages the pinned adapters take when resident (`excluding` one of them left out)."""
        return sum(self._entries[name].num_pages for name in self.pinned if name != excluding)

    def pin(self, name: str) -> AdapterLoad | None:
        """Keep `name` resident until `unpin`: placed now when pages can be had without taking them from a
        request (else at its next admission), and never evicted once placed. The copy still to make, as
        `warm`'s. PinRefused when the pinned adapters would pass `pin_budget` or every resident slot;
        AdapterError if it is not registered or is refused. Pinning a pinned adapter is a warm."""
        entry = self._entries.get(name)
        if entry is None or entry.draining:
            raise AdapterError(f"adapter {name!r} is not registered")
        if name in self.failed:
            raise AdapterError(f"adapter {name!r} is refused: {self.failed[name]}")
        if name not in self.pinned:
            held = self.pinned_pages()
            if held + entry.num_pages > self.pin_budget:
                raise PinRefused(
                    f"adapter {name!r} needs {entry.num_pages} pages of the pool to be pinned; pinned "
                    f"adapters hold {held} of the {self.pin_budget} pages pins may take (the pool's "
                    f"{self.pool.num_pages} pages less the KV room kept for requests): unpin another "
                    "adapter first"
                )
            if self.max_resident is not None and len(self.pinned) + 1 >= self.max_resident:
                raise PinRefused(
                    f"adapter {name!r} cannot be pinned: {len(self.pinned)} adapter(s) are pinned and the "
                    f"pool holds at most {self.max_resident} adapters (max_resident_adapters), one of "
                    "them kept for unpinned ones"
                )
            self.pinned[name] = None
            self._unused.pop(name, None)
            self._publish()
            log.info("adapter %s pinned (%d pages)", name, entry.num_pages)
        return self.warm(name)

    def unpin(self, name: str) -> bool:
        """Let `name` be evicted again (the least recently used first, as any unused adapter); whether it
        was pinned."""
        if name not in self.pinned:
            return False
        del self.pinned[name]
        entry = self._entries.get(name)
        if entry is not None and entry.resident and not entry.references:
            if entry.loaded:
                self._unused[name] = self.pool.tick()
            else:
                self._drop(entry)
        self._publish()
        return True

    # -- what the scheduler calls -------------------------------------------------------------------

    def add_user(self, name: str) -> None:
        entry = self._entries.get(name)
        if entry is None or entry.draining:
            raise AdapterError(f"adapter {name!r} is not registered")
        entry.users += 1

    def remove_user(self, name: str) -> None:
        entry = self._entries[name]
        entry.users -= 1
        assert entry.users >= entry.references >= 0, name
        if entry.draining and not entry.users:
            self._forget(name)
            self._publish()
            log.info("adapter %s drained and is forgotten", name)

    def pages_needed(self, name: str) -> int:
        """Pages that acquiring `name` would take now: none if it is resident."""
        entry = self._entries[name]
        return 0 if entry.resident else entry.num_pages

    def pages_of(self, name: str) -> int:
        """Pages the adapter occupies when resident, whether it is now or not."""
        return self._entries[name].num_pages

    def acquire(self, name: str) -> bool:
        """Hold `name` for an admitted request, handing it pages if it is not resident (the loader
        copies its rows before the step runs). False if it is refused or no pages can be had."""
        entry = self._entries[name]
        if name in self.failed:
            return False
        if not entry.resident and not self._place(entry):
            return False
        entry.admissions += 1
        entry.cold_admissions += not entry.loaded
        entry.references += 1
        self._unused.pop(name, None)
        return True

    def release(self, name: str) -> None:
        entry = self._entries[name]
        entry.references -= 1
        assert entry.references >= 0, name
        if entry.references:
            return
        if name in self.failed or not entry.loaded:  # refused, or pages handed out in vain: free them now
            self._drop(entry)
        elif name not in self.pinned:  # a pinned adapter stays resident, out of eviction's reach
            self._unused[name] = self.pool.tick()

    def evict_unused(self, pages_wanted: int) -> int:
        """Free unreferenced adapters and unread cached prefix pages, least recently used first (one
        budget, PagePool.reclaim), until `pages_wanted` are free."""
        return self.pool.reclaim(pages_wanted)

    def evictable_pages(self) -> int:
        """Pages of resident adapters no request holds."""
        return sum(self._entries[name].num_pages for name in self._unused)

    def oldest_unused(self) -> int | None:
        return next(iter(self._unused.values()), None)

    def evict_oldest(self) -> int:
        return self._evict_oldest()

    def pending_loads(self) -> list[AdapterLoad]:
        """Adapters holding pages whose rows are not copied yet, in the order they were handed out."""
        loads = []
        for name in self._loading:
            entry = self._entries[name]
            assert entry.pages is not None
            loads.append(AdapterLoad(name, list(entry.pages), entry.source))
        return loads

    # -- what the loader reports --------------------------------------------------------------------

    def loaded(self, name: str) -> None:
        """The rows of `name` are in its pages: steps may read them."""
        entry = self._entries[name]
        entry.loaded = True
        entry.loads += 1
        self._loading.pop(name, None)
        self.version += 1

    def load_failed(self, name: str, reason: str, at_fault: bool) -> None:
        """The loader could not copy `name`. At fault (unreadable, unverifiable, not finite): refused
        from now on. Otherwise (the store did not answer) the next request that wants it tries again.
        Its pages go back when the requests holding them end (the engine ends them now)."""
        if at_fault:
            self.mark_failed(name, reason)

    # -- inside ---------------------------------------------------------------------------------------

    def _publish(self) -> None:
        """Swap in a new view of the registration facts. A whole new mapping, so a reader on another
        thread holds either the old one or the new one, each complete (one reference read, no lock).
        It costs a pass over the registered adapters, paid per registration change, never per step."""
        self.view = MappingProxyType(
            {
                name: AdapterFacts(
                    name,
                    entry.manifest.sha256,
                    entry.num_pages,
                    self.failed.get(name),
                    entry.draining,
                    pinned=name in self.pinned,
                )
                for name, entry in self._entries.items()
            }
        )
        self.largest_pages = max((entry.num_pages for entry in self._entries.values()), default=0)

    def _place(self, entry: AdapterEntry) -> bool:
        if self.max_resident is not None and len(self._resident) >= self.max_resident:
            if not self._unused:
                return False
            self._evict_oldest()
        if not self.pool.can_allocate(entry.num_pages):
            self.evict_unused(entry.num_pages)
            if not self.pool.can_allocate(entry.num_pages):
                return False
        entry.pages = self.pool.allocate(entry.num_pages, ("adapter", entry.name), PageKind.ADAPTER)
        entry.loaded = False
        self._loading[entry.name] = None
        self._resident[entry.name] = None
        return True

    def _evict_oldest(self) -> int:
        entry = self._entries[next(iter(self._unused))]
        freed = entry.num_pages
        self._drop(entry)
        self.evictions += 1
        return freed

    def _drop(self, entry: AdapterEntry) -> None:
        """Free the adapter's pages (it stays registered)."""
        assert entry.references == 0 and entry.pages is not None, f"adapter {entry.name} is in use"
        self.pool.free(entry.pages, ("adapter", entry.name))
        entry.pages, entry.loaded = None, False
        self._unused.pop(entry.name, None)
        self._loading.pop(entry.name, None)
        self._resident.pop(entry.name, None)
        self.version += 1
        for listener in self.listeners:
            listener.dropped(entry.name)

    def _forget(self, name: str) -> None:
        entry = self._entries.pop(name)
        assert not entry.users, f"adapter {name} is in use"
        self._num_draining -= entry.draining
        self.pinned.pop(name, None)  # a pin is the registration's: gone with it
        if entry.resident:
            self._drop(entry)
        self.failed.pop(name, None)
        for listener in self.listeners:
            listener.forgotten(name)

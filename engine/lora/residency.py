"""Which adapters live in the pool, and loading them into pages on demand.

Registered adapters are validated, read and packed once (the host copy); an adapter is resident while
it owns pages of the pool (kind `adapter`, the same allocator and budget as the KV cache). A running
request holds a reference to its adapter; adapters nobody holds stay resident until their pages are
wanted, then the least recently used goes first. The scheduler only calls acquire / release /
evict_unused: bookkeeping it can reason about without touching the device.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from loraplex.adapters import AdapterError, AdapterManifest, BaseShape, inspect_adapter
from loraplex.adapters.weights import load_lora_weights

from ..pool import PageKind, PagePool
from .layout import PackedAdapter, pack_adapter, physical_rows

log = logging.getLogger(__name__)


@dataclass
class Registered:
    name: str
    path: Path
    manifest: AdapterManifest
    packed: PackedAdapter


@dataclass
class Resident:
    pages: list[int]
    a_rows: dict[str, torch.Tensor]  # group -> [layers, C, in / head_dim] pool rows
    b_rows: dict[str, torch.Tensor]
    references: int = 0


@dataclass
class ResidencyStats:
    loads: int = 0
    evictions: int = 0


class AdapterResidency:
    def __init__(
        self,
        pool: PagePool,
        pool_rows: torch.Tensor,  # [num_pages * rows_per_page, head_dim] view of the pool memory
        base: BaseShape,
        rows_per_page: int,
    ):
        self.pool = pool
        self.pool_rows = pool_rows
        self.base = base
        self.head_dim = pool_rows.shape[1]
        self.rows_per_page = rows_per_page
        self.registered: dict[str, Registered] = {}
        self.resident: dict[str, Resident] = {}
        self._unused: OrderedDict[str, None] = OrderedDict()  # resident, unreferenced, oldest first
        self.version = 0  # changes whenever an adapter's pages change: stacked gathers are stale then
        self.stats = ResidencyStats()

    def register(self, name: str, path: str | Path) -> AdapterManifest:
        """Validate and pack a PEFT directory under `name` (AdapterError names what is wrong)."""
        if not name:
            raise AdapterError("an adapter needs a non-empty name")
        directory = Path(path)
        manifest = inspect_adapter(directory, self.base)
        weights = load_lora_weights(directory, manifest, self.pool_rows.dtype)
        packed = pack_adapter(manifest, weights, self.base, self.head_dim, self.rows_per_page)
        if packed.pages_needed(self.rows_per_page) > self.pool.num_pages - 1:
            raise AdapterError(
                f"adapter {name!r} needs {packed.pages_needed(self.rows_per_page)} pages; "
                f"the pool has {self.pool.num_pages - 1}"
            )
        if name in self.resident:
            if self.resident[name].references:
                raise AdapterError(
                    f"adapter {name!r} is serving requests; register the new version under another name"
                )
            self._drop(name)
        self.registered[name] = Registered(name, directory, manifest, packed)
        return manifest

    def pages_needed(self, name: str) -> int:
        return 0 if name in self.resident else self.registered[name].packed.pages_needed(self.rows_per_page)

    def acquire(self, name: str) -> bool:
        """Hold `name` for a request, loading it into the pool if needed; False if no pages can be had."""
        if name not in self.registered:
            raise AdapterError(f"adapter {name!r} is not registered")
        if name not in self.resident and not self._load(name):
            return False
        resident = self.resident[name]
        resident.references += 1
        self._unused.pop(name, None)
        return True

    def release(self, name: str) -> None:
        resident = self.resident[name]
        resident.references -= 1
        assert resident.references >= 0, name
        if resident.references == 0:
            self._unused[name] = None

    def evict_unused(self, pages_wanted: int) -> int:
        """Free unreferenced adapters, least recently used first, until `pages_wanted` are free."""
        freed = 0
        while self._unused and self.pool.num_free < pages_wanted:
            name = next(iter(self._unused))
            freed += len(self.resident[name].pages)
            self._drop(name)
            self.stats.evictions += 1
        return freed

    def _load(self, name: str) -> bool:
        packed = self.registered[name].packed
        needed = packed.pages_needed(self.rows_per_page)
        if not self.pool.can_allocate(needed):
            self.evict_unused(needed)
            if not self.pool.can_allocate(needed):
                return False
        pages = self.pool.allocate(needed, ("adapter", name), PageKind.ADAPTER)
        rows = physical_rows(packed.data_rows, pages, self.rows_per_page).to(self.pool_rows.device)
        self.pool_rows.index_copy_(0, rows, packed.data.to(self.pool_rows.device, self.pool_rows.dtype))

        def place(index: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return {
                g: physical_rows(v, pages, self.rows_per_page).to(self.pool_rows.device)
                for g, v in index.items()
            }

        self.resident[name] = Resident(pages, place(packed.a_rows), place(packed.b_rows))
        self.version += 1
        self.stats.loads += 1
        log.debug("loaded adapter %s into %d pages", name, needed)
        return True

    def _drop(self, name: str) -> None:
        resident = self.resident.pop(name)
        assert resident.references == 0, f"adapter {name} is in use"
        self._unused.pop(name, None)
        self.pool.free(resident.pages, ("adapter", name))
        self.version += 1

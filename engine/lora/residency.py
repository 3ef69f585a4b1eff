"""Which adapters live in the pool, and loading them into pages on demand.

Three tiers, as in S-LoRA: registered adapters are validated sources (a manifest and a way to read
the weights); the host cache holds packed copies of the recently used ones within a byte budget and
prefetches those of queued requests; an adapter is resident while it owns pages of the pool (kind
`adapter`, the same allocator and budget as the KV cache). A running request holds a reference to its
adapter; adapters nobody holds stay resident until their pages are wanted, then the least recently used
goes first. The scheduler only calls pages_needed / acquire / release / evict_unused: bookkeeping it
can reason about without touching the device.

Faults stay with their adapter. Weights that cannot be read, fail verification, or hold values that are
not finite in the pool's dtype mark the adapter `failed` (the engine refuses it from then on, with the
reason) and nothing else is touched; so does a step failure the engine attributes to it (`mark_failed`).
A failed adapter stays failed until it is registered again with other weights (another digest) or
unregistered. A store that cannot be reached is not the adapter's fault: that is `unavailable`, and the
next request that wants the adapter tries again.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from loraplex.adapters import AdapterError, AdapterManifest, BaseShape

from ..pool import PageKind, PagePool
from .host_cache import HostCache
from .layout import PackedAdapter, count_rows, pack_adapter, physical_rows
from .sources import AdapterSource, DirectorySource, LoraWeights

log = logging.getLogger(__name__)

DEFAULT_HOST_CACHE_BYTES = 4 << 30


@dataclass
class Registered:
    name: str
    source: AdapterSource
    pages: int  # pool pages it occupies when resident

    @property
    def manifest(self) -> AdapterManifest:
        return self.source.manifest


@dataclass
class Resident:
    pages: list[int]
    a_rows: dict[str, torch.Tensor]  # group -> [layers, C, in / head_dim] pool rows
    b_rows: dict[str, torch.Tensor]
    references: int = 0


@dataclass
class ResidencyStats:
    loads: int = 0  # copies into the pool
    evictions: int = 0
    load_seconds: float = 0.0  # time spent making adapters resident (host reads included when not prefetched)


class AdapterResidency:
    def __init__(
        self,
        pool: PagePool,
        pool_rows: torch.Tensor,  # [num_pages * rows_per_page, head_dim] view of the pool memory
        base: BaseShape,
        rows_per_page: int,
        host_cache_bytes: int = DEFAULT_HOST_CACHE_BYTES,
        max_resident: int | None = None,
    ):
        if max_resident is not None and max_resident < 1:
            raise ValueError(f"max_resident must be at least 1, got {max_resident}")
        self.pool = pool
        self.pool_rows = pool_rows
        self.base = base
        self.head_dim = pool_rows.shape[1]
        self.rows_per_page = rows_per_page
        self.max_resident = max_resident
        self.host = HostCache(host_cache_bytes)
        self.registered: dict[str, Registered] = {}
        self.resident: dict[str, Resident] = {}
        self.failed: dict[str, str] = {}  # name -> why it is refused (the adapter is at fault)
        self.unavailable: dict[str, str] = {}  # name -> why its store could not be read (retried)
        self._unused: OrderedDict[str, None] = OrderedDict()  # resident, unreferenced, oldest first
        self.version = 0  # changes whenever an adapter's pages change: stacked gathers are stale then
        self.stats = ResidencyStats()

    # -- registration -------------------------------------------------------------------------------

    def register_path(self, name: str, uri: str | Path, sha256: str | None = None) -> AdapterManifest:
        """Register the PEFT directory at a path or file:// URI; with `sha256`, only if its weights match."""
        return self.register(name, DirectorySource.open(uri, self.base, sha256))

    def register(self, name: str, source: AdapterSource) -> AdapterManifest:
        """Make `source` servable under `name` (validated now, read when first needed). Registering a
        name again replaces it, unless requests are using it."""
        if not name:
            raise AdapterError("an adapter needs a non-empty name")
        manifest = source.manifest
        rows = count_rows(manifest, self.head_dim, self.rows_per_page)
        pages = -(-rows // self.rows_per_page)
        if pages > self.pool.num_pages - 1:
            raise AdapterError(
                f"adapter {name!r} needs {pages} pages; the pool has {self.pool.num_pages - 1}"
            )
        fault = None
        if name in self.registered:
            # The same weights again are the same fault: only other weights clear it.
            if self.registered[name].manifest.sha256 == manifest.sha256:
                fault = self.failed.get(name)
            self.unregister(name)
        self.registered[name] = Registered(name, source, pages)
        if fault is not None:
            self.failed[name] = fault
        return manifest

    def unregister(self, name: str) -> None:
        """Forget `name`: its pages and host copy are freed. Refused while a request holds it."""
        if name not in self.registered:
            raise AdapterError(f"adapter {name!r} is not registered")
        resident = self.resident.get(name)
        if resident is not None and resident.references:
            raise AdapterError(
                f"adapter {name!r} is serving requests; register the new version under another name"
            )
        if resident is not None:
            self._drop(name)
        del self.registered[name]
        self.failed.pop(name, None)
        self.unavailable.pop(name, None)
        self.host.discard(name)

    def mark_failed(self, name: str, reason: str) -> None:
        """Refuse `name` from now on (the engine found it at fault). Its pages are freed as soon as no
        request holds it, and its host copy at once, so nothing of it is served again."""
        self.failed[name] = reason
        self.host.discard(name)
        resident = self.resident.get(name)
        if resident is not None and not resident.references:
            self._drop(name)
        log.warning("adapter %s is refused from now on: %s", name, reason)

    # -- what the scheduler calls -----------------------------------------------------------------

    def pages_needed(self, name: str) -> int:
        return 0 if name in self.resident else self.registered[name].pages

    def pages_of(self, name: str) -> int:
        """Pages the adapter occupies when resident, whether it is now or not."""
        return self.registered[name].pages

    def prefetch(self, names: Iterable[str]) -> None:
        """Start reading the host copies of adapters about to be wanted (those of queued requests)."""
        for name in names:
            if name in self.registered and name not in self.resident and name not in self.failed:
                self.host.prefetch(name, self._packer(name))

    def acquire(self, name: str) -> bool:
        """Hold `name` for a request, loading it into the pool if needed. False if no pages can be had,
        or if its weights cannot be read (then `failed[name]` says why)."""
        if name not in self.registered:
            raise AdapterError(f"adapter {name!r} is not registered")
        if name in self.failed:
            return False
        self.unavailable.pop(name, None)  # the store may be back: this request tries again
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
            if name in self.failed:
                self._drop(name)
            else:
                self._unused[name] = None

    def evict_unused(self, pages_wanted: int) -> int:
        """Free unreferenced adapters, least recently used first, until `pages_wanted` are free."""
        freed = 0
        while self._unused and self.pool.num_free < pages_wanted:
            freed += self._evict_oldest()
        return freed

    def evictable_pages(self) -> int:
        """Pages that evict_unused could free: those of resident adapters no request holds."""
        return sum(len(self.resident[name].pages) for name in self._unused)

    def _evict_oldest(self) -> int:
        name = next(iter(self._unused))
        freed = len(self.resident[name].pages)
        self._drop(name)
        self.stats.evictions += 1
        return freed

    # -- moving weights -----------------------------------------------------------------------------

    def _packer(self, name: str) -> Callable[[], PackedAdapter]:
        source = self.registered[name].source
        dtype, pin = self.pool_rows.dtype, self.pool_rows.is_cuda

        def pack() -> PackedAdapter:
            weights = source.load(dtype)
            check_finite(weights)
            packed = pack_adapter(source.manifest, weights, self.base, self.head_dim, self.rows_per_page)
            if not bool(torch.isfinite(packed.data).all()):
                raise AdapterError(
                    "the adapter's B matrices overflow when scaled by lora_alpha / r in this engine's "
                    f"dtype ({dtype}): refusing it"
                )
            if pin:  # page-locked host memory: the copy into the pool runs at full bus speed
                packed.data = packed.data.pin_memory()
            return packed

        return pack

    def _load(self, name: str) -> bool:
        needed = self.registered[name].pages
        if self.max_resident is not None and len(self.resident) >= self.max_resident:
            if not self._unused:
                return False
            self._evict_oldest()
        if not self.pool.can_allocate(needed):
            self.evict_unused(needed)
            if not self.pool.can_allocate(needed):
                return False
        began = time.perf_counter()
        try:
            packed = self.host.get(name, self._packer(name))
        except ValueError as error:  # AdapterError among them: what is there is refused
            self.failed[name] = str(error)
            log.warning("adapter %s failed to load: %s", name, error)
            return False
        except Exception as error:  # the store did not answer: not the adapter's fault, tried again later
            self.unavailable[name] = f"the adapter store could not be read: {type(error).__name__}: {error}"
            log.warning("adapter %s could not be fetched: %s", name, error)
            return False
        pages = self.pool.allocate(needed, ("adapter", name), PageKind.ADAPTER)
        device = self.pool_rows.device
        rows = physical_rows(packed.data_rows, pages, self.rows_per_page).to(device)
        self.pool_rows.index_copy_(0, rows, packed.data.to(device, self.pool_rows.dtype, non_blocking=True))

        def place(index: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return {g: physical_rows(v, pages, self.rows_per_page).to(device) for g, v in index.items()}

        self.resident[name] = Resident(pages, place(packed.a_rows), place(packed.b_rows))
        self.version += 1
        self.stats.loads += 1
        self.stats.load_seconds += time.perf_counter() - began
        log.debug("loaded adapter %s into %d pages", name, needed)
        return True

    def _drop(self, name: str) -> None:
        resident = self.resident.pop(name)
        assert resident.references == 0, f"adapter {name} is in use"
        self._unused.pop(name, None)
        self.pool.free(resident.pages, ("adapter", name))
        self.version += 1


def check_finite(weights: LoraWeights) -> None:
    """Refuse weights holding NaN or infinity (also when the pool's dtype is too narrow for them):
    one such adapter would turn the logits of its requests into NaN, and a step that samples them
    raises."""
    for (layer, module), (a, b) in sorted(weights.items()):
        for which, matrix in (("lora_A", a), ("lora_B", b)):
            if not bool(torch.isfinite(matrix).all()):
                raise AdapterError(
                    f"{which} of layer {layer} {module} holds NaN or infinite values "
                    f"(in {matrix.dtype}): refusing the adapter"
                )

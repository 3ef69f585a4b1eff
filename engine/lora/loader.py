"""Moving adapter weights: read and pack them into host memory (ahead of time when it can), copy them
into the pages the registry handed out, and keep the pool rows the LoRA stackers read.

The engine runs `load(plan.adapter_loads)` between scheduling and running a step: each adapter is one
host-cache lookup (a prefetch usually made it a hit) and one `index_copy_` into its pages. A load that
fails is that adapter's alone: weights that cannot be read or verified, or that hold values not finite
in the pool's dtype, make it refused (`at_fault`); a store that does not answer is not its fault, and
the next request that wants it tries again. Either way the engine ends only its requests.

What the stackers (`lora/step.py`) read of this object: `version` (changes whenever an adapter's pages
do), `pool_rows`, `resident` (name -> pool rows per group), `tables` (the kernels' persistent index
tables: an adapter's metadata is written there when it is loaded and freed when it leaves), `base` and
`head_dim`.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch

from loraplex.adapters import AdapterError, AdapterManifest, BaseShape

from .dora import BaseWeights, dora_scales
from .host_cache import HostCache
from .layout import PackedAdapter, count_rows, pack_adapter, physical_rows
from .registry import AdapterLoad, AdapterRegistry
from .sources import AdapterSource, LoraWeights
from .tables import ResidentTables, adapter_meta

log = logging.getLogger(__name__)

DEFAULT_HOST_CACHE_BYTES = 4 << 30


@dataclass
class ResidentRows:
    """A resident adapter's pool rows, per projection group (what the LoRA ops gather with)."""

    pages: list[int]
    a_rows: dict[str, torch.Tensor]  # group -> [layers, C, in / head_dim] pool rows
    b_rows: dict[str, torch.Tensor]  # group -> [layers, C, out / head_dim]
    # DoRA adapters: group -> [layers, out / head_dim] pool rows of each layer's g - 1 (lora/dora.py)
    d_rows: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class LoadFailure:
    name: str
    reason: str
    at_fault: bool  # the adapter's weights are refused (False: its store did not answer)


class LoadFailed(Exception):
    """An adapter could not be loaded outside a step (a prewarm): the failure says why and whose fault."""

    def __init__(self, failure: LoadFailure):
        super().__init__(failure.reason)
        self.failure = failure


class AdapterLoader:
    def __init__(
        self,
        registry: AdapterRegistry,
        pool_rows: torch.Tensor,  # [num_pages * rows_per_page, head_dim] view of the pool memory
        base: BaseShape,
        rows_per_page: int,
        host_cache_bytes: int = DEFAULT_HOST_CACHE_BYTES,
        base_weights: BaseWeights | None = None,  # what DoRA scales are computed against (lora/dora.py)
    ):
        self.registry = registry
        self.base_weights = base_weights
        # DoRA scales are computed by the packer (the prefetch worker) when the base weights are in host
        # memory; with CUDA weights, on the first load instead (_fill_dora_scales says why).
        self.scales_in_background = not pool_rows.is_cuda
        self.pool_rows = pool_rows
        self.base = base
        self.head_dim = pool_rows.shape[1]
        self.rows_per_page = rows_per_page
        self.host = HostCache(host_cache_bytes)
        self.resident: dict[str, ResidentRows] = {}
        self.tables = ResidentTables(base.num_layers, pool_rows.device)
        self.loads = 0  # copies into the pool
        self.load_seconds = 0.0  # time spent loading (host reads included when not prefetched)
        # Each load's seconds until the metrics take them (take_load_times); bounded, should nobody take them.
        self.load_times: deque[float] = deque(maxlen=4096)
        registry.listeners.append(self)

    @property
    def version(self) -> int:
        return self.registry.version

    def pages_for(self, manifest: AdapterManifest) -> int:
        """Pool pages an adapter with this manifest occupies, known before reading its weights."""
        return -(-count_rows(manifest, self.head_dim, self.rows_per_page, self.base) // self.rows_per_page)

    def prefetch(self, names: Iterable[str]) -> None:
        """Start reading the host copies of adapters about to be wanted (those of queued requests)."""
        for name in names:
            entry = self.registry.entry(name)
            if entry is not None and not entry.resident and name not in self.registry.failed:
                self.host.prefetch(name, self._packer(entry.source))

    def load(self, loads: Sequence[AdapterLoad]) -> list[LoadFailure]:
        """Copy each adapter into the pages the registry gave it; the ones that could not be loaded.
        First zero the table columns of the adapters that left the pool since the last call: the
        registry tells the loader that they left from inside the scheduler's reclaim, which touches no
        device, so the writes wait for this call, which the engine makes before every step."""
        self.tables.clear_freed()
        failures = []
        for load in loads:
            failure = self._load(load)
            if failure is not None:
                self.registry.load_failed(load.name, failure.reason, failure.at_fault)
                failures.append(failure)
        return failures

    def take_load_times(self) -> tuple[float, ...]:
        """The seconds of each load since the last call, oldest first (and forget them)."""
        times = tuple(self.load_times)
        self.load_times.clear()
        return times

    def close(self) -> None:
        self.host.close()

    # -- told by the registry (also from inside the scheduler: bookkeeping only, no device write) -----

    def dropped(self, name: str) -> None:
        self.resident.pop(name, None)
        self.tables.remove(name)

    def forgotten(self, name: str) -> None:
        self.resident.pop(name, None)
        self.tables.remove(name)
        self.host.discard(name)

    # -- inside ---------------------------------------------------------------------------------------

    def _load(self, load: AdapterLoad) -> LoadFailure | None:
        began = time.perf_counter()
        try:
            packed = self.host.get(load.name, self._packer(load.source))
        except ValueError as error:  # AdapterError among them: what is there is refused
            log.warning("adapter %s failed to load: %s", load.name, error)
            return LoadFailure(load.name, str(error), at_fault=True)
        except Exception as error:  # the store did not answer: not the adapter's fault, tried again later
            log.warning("adapter %s could not be fetched: %s", load.name, error)
            reason = f"the adapter store could not be read: {type(error).__name__}: {error}"
            return LoadFailure(load.name, reason, at_fault=False)
        if packed.dora_pending is not None:
            try:
                self._fill_dora_scales(load.source, packed)
            except ValueError as error:  # AdapterError among them: a scale that is not finite
                log.warning("adapter %s failed to load: %s", load.name, error)
                self.host.discard(load.name)
                return LoadFailure(load.name, str(error), at_fault=True)
        device = self.pool_rows.device
        rows = physical_rows(packed.data_rows, load.pages, self.rows_per_page).to(device)
        self.pool_rows.index_copy_(0, rows, packed.data.to(device, self.pool_rows.dtype, non_blocking=True))

        def place(index: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return {g: physical_rows(v, load.pages, self.rows_per_page).to(device) for g, v in index.items()}

        resident = ResidentRows(load.pages, place(packed.a_rows), place(packed.b_rows), place(packed.d_rows))
        self.resident[load.name] = resident
        self.tables.add(load.name, adapter_meta(resident, self.base, self.head_dim))  # once per load
        self.registry.loaded(load.name)
        elapsed = time.perf_counter() - began
        self.loads += 1
        self.load_seconds += elapsed
        self.load_times.append(elapsed)
        log.debug("loaded adapter %s into %d pages", load.name, len(load.pages))
        return None

    def _packer(self, source: AdapterSource) -> Callable[[], PackedAdapter]:
        dtype, pin = self.pool_rows.dtype, self.pool_rows.is_cuda

        def pack() -> PackedAdapter:
            weights = source.load(dtype)
            check_finite(weights)
            scales = None
            if source.manifest.dora:
                if self.base_weights is None:
                    raise AdapterError("use_dora: this engine has no base weights to compute DoRA scales")
                if self.scales_in_background:
                    scales = dora_scales(source.manifest, weights, self.base, self.base_weights)
            packed = pack_adapter(
                source.manifest, weights, self.base, self.head_dim, self.rows_per_page, scales
            )
            if source.manifest.dora and scales is None:
                packed.dora_pending = weights
            if not bool(torch.isfinite(packed.data).all()):
                raise AdapterError(
                    "the adapter's B matrices overflow when scaled by lora_alpha / r in this engine's "
                    f"dtype ({dtype}): refusing it"
                )
            if pin:  # page-locked host memory: the copy into the pool runs at full bus speed
                packed.data = packed.data.pin_memory()
            return packed

        return pack

    def _fill_dora_scales(self, source: AdapterSource, packed: PackedAdapter) -> None:
        """Compute a DoRA adapter's scales against the base weights on the device, and write them into
        its host copy (once: later loads of that copy copy them as they are). Here, on the engine's
        thread between steps, never in the prefetch worker: device work from another thread could land
        inside a CUDA graph capture."""
        assert packed.dora_pending is not None and self.base_weights is not None
        weights = cast(LoraWeights, packed.dora_pending)  # the DoraWeights the packer was given
        scales = dora_scales(source.manifest, weights, self.base, self.base_weights)
        filled = pack_adapter(source.manifest, weights, self.base, self.head_dim, self.rows_per_page, scales)
        data = filled.data.to(packed.data.dtype)
        if not bool(torch.isfinite(data).all()):
            raise AdapterError(f"the adapter's DoRA scales overflow in this engine's dtype ({data.dtype})")
        packed.data = data.pin_memory() if packed.data.is_pinned() else data
        packed.dora_pending = None


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

"""What the engine holds and serves, adapter by adapter: the snapshot behind the model-server protocol's
metrics (engine/server/model_server.py; docs/server.md, "Model-server protocol").

Taken on the engine's thread between steps (the scheduler, the registry and the host cache are not
thread-safe), once per metrics publish (at most every 50 ms while busy), never inside a step. It is one pass
over the running batch, the waiting queue, the resident adapters and the host cache's packed ones, each
bounded by a setting (max_num_seqs, max_queue, the pool, the host cache's bytes). Plain bookkeeping: no torch.

Adapters are named as the engine names them: the gateway's as `id:<adapter id>` (loraplex.wire), never by
a tenant's name for them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ..stats import AdapterReport, LoadedAdapter

if TYPE_CHECKING:
    from ..request import Request
    from ..scheduler import Scheduler
    from .host_cache import HostCache
    from .loader import AdapterLoader
    from .registry import AdapterRegistry

GPU = "gpu"  # the device pool (also on a CPU engine: the tier a step reads from)
CPU = "cpu"  # packed in host memory: one copy away from the pool


def adapter_report(
    scheduler: Scheduler, registry: AdapterRegistry, host: HostCache, loader: AdapterLoader
) -> AdapterReport:
    """The snapshot now; takes the loader's load times (each is reported once)."""
    return AdapterReport(
        running=_by_adapter(scheduler.running),
        waiting=_by_adapter(scheduler.waiting),
        loaded=loaded_adapters(registry, host),
        reclaimable_pages=registry.pool.reclaimable_pages(),
        largest_adapter_pages=registry.largest_pages,
        pinned=len(registry.pinned),
        load_seconds=loader.take_load_times(),
    )


def loaded_adapters(registry: AdapterRegistry, host: HostCache) -> tuple[LoadedAdapter, ...]:
    """Adapters whose rows are in the pool (`gpu`; pages handed out with the copy still to do do not
    count), then those packed in host memory only (`cpu`). Each once, at its nearest level."""
    loaded: list[LoadedAdapter] = []
    on_device: set[str] = set()
    for name in registry.resident_names():
        entry = registry.entry(name)
        if entry is not None and entry.loaded:
            loaded.append(_loaded(registry, name, GPU))
            on_device.add(name)
    for name in host.packed_names():
        entry = registry.entry(name)
        if entry is not None and name not in on_device:  # a pack of a forgotten adapter is not served
            loaded.append(_loaded(registry, name, CPU))
    return tuple(loaded)


def _loaded(registry: AdapterRegistry, name: str, level: str) -> LoadedAdapter:
    entry = registry.entry(name)
    assert entry is not None
    rank = max(entry.manifest.ranks, default=0)
    return LoadedAdapter(name, level, rank, name in registry.pinned, entry.manifest.sha256)


def _by_adapter(requests: Iterable[Request]) -> dict[str, int]:
    """Requests per adapter, base-model requests left out; in the order the adapters first appear."""
    return dict(Counter(request.adapter for request in requests if request.adapter is not None))

"""What the engine tells its callers about itself: torch-free values, safe to hand to another thread."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .prefix_cache import PrefixStats
from .speculative import SpecStats


@dataclass(frozen=True)
class AdapterFacts:
    """What registering an adapter settled, as any thread may read it (see AdapterRegistry.view): facts
    that change only when it is registered, refused, unregistered or forgotten, never while it serves."""

    name: str
    sha256: str
    pages: int  # pool pages it occupies when resident
    failed: str | None  # why it is refused, if it is
    draining: bool  # unregistered: new requests may not name it; those already there finish
    pinned: bool = False  # kept resident (never evicted) until unpinned


@dataclass(frozen=True)
class AdapterInfo:
    """A registered adapter as the engine's callers see it, residency included (the engine thread's view:
    residency changes every step, so it is exact only there)."""

    name: str
    sha256: str
    pages: int  # pool pages it occupies when resident
    resident: bool
    failed: str | None  # why it is refused, if it is
    admissions: int = 0  # requests admitted with it since it was registered
    cold_admissions: int = 0  # of those, the ones that waited for its rows to be loaded
    loads: int = 0  # copies of its rows into the pool
    pinned: bool = False  # kept resident (never evicted) until unpinned


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's state and counters (what metrics and readiness read)."""

    num_pages: int
    pages: dict[str, int]  # pool pages by kind ("free", "kv", "adapter", "reserved")
    waiting: int
    running: int
    adapters_registered: int
    adapters_resident: int
    adapters_failed: int
    adapters_draining: int  # unregistered, still serving the requests that named them
    adapter_loads: int  # copies into the pool
    adapter_evictions: int
    adapter_load_seconds: float
    host_cache_bytes: int
    host_cache_hits: int  # packed and ready when a load wanted it
    host_cache_waits: int  # its prefetch was still running: the load waited for the rest
    host_cache_misses: int  # never prefetched: read on the spot
    prefix: PrefixStats | None = None  # the prefix cache's counters; None: prefix caching is off
    spec: SpecStats | None = None  # speculative decoding's counters; None: it is off


@dataclass(frozen=True)
class LoadedAdapter:
    """An adapter whose weights the engine holds, and where."""

    name: str
    level: str  # "gpu": its rows are in the device pool, ready for a step; "cpu": packed in host memory only
    rank: int  # its largest LoRA rank
    pinned: bool = False  # kept resident until unpinned (AdapterRegistry.pin)
    sha256: str = ""  # its digest: which version of a name it is


@dataclass(frozen=True)
class AdapterReport:
    """What the engine holds and serves, adapter by adapter (engine/lora/report.py): a snapshot taken
    between steps, read by the metrics of the model-server protocol (engine/server/model_server.py)."""

    running: Mapping[str, int]  # adapter -> its requests in the running batch
    waiting: Mapping[str, int]  # adapter -> its requests waiting to be scheduled
    loaded: tuple[LoadedAdapter, ...]  # one per adapter held, at its nearest level (gpu before cpu)
    reclaimable_pages: int  # pool pages of unused adapters and unread cached prefixes: freed when wanted
    largest_adapter_pages: int  # pool pages of the largest registered adapter (0: none registered)
    load_seconds: tuple[float, ...]  # each load into the pool since the previous report, in order
    pinned: int = 0  # adapters pinned resident (AdapterRegistry.pin)

"""The Gateway API Inference Extension's model-server protocol on /metrics: the `vllm:*` series that standard
routers (the extension's endpoint picker, llm-d, KServe) read, beside our own `loraplex_*` series.

The protocol (gateway-api-inference-extension, docs/proposals/003-model-server-protocol) fixes the types and
the meaning; the names are vLLM's, which those routers look for by default. The loaded-adapter series are
the ones proposed to vLLM (vllm-project/vllm#54830, read by llm-d-router's lora-load-state scorer):

| series | type | labels | value |
|---|---|---|---|
| vllm:num_requests_waiting | gauge | model_name | requests queued, not yet scheduled |
| vllm:num_requests_running | gauge | model_name | requests in the running batch |
| vllm:kv_cache_usage_perc | gauge | model_name | 0..1: used share of the pool's usable pages (below) |
| vllm:cache_config_info | gauge | block_size, num_gpu_blocks, enable_prefix_caching | 1 |
| vllm:lora_requests_info | gauge | max_lora, running_lora_adapters, waiting_lora_adapters | unix time |
| vllm:lora_adapter_loaded | gauge | adapter_name, level, pinned, rank | 1, one series per adapter held |
| vllm:num_gpu_loaded_lora_adapters | gauge | model_name | adapters whose rows are in the pool |
| vllm:max_gpu_lora_adapters | gauge | model_name | adapters the pool can hold at once |
| vllm:lora_adapter_load_seconds | histogram | model_name | each load of an adapter into the pool |

Beside them, from the same snapshot: `loraplex_adapter_loaded{adapter_name, sha256, level, pinned}` (1 per
adapter held, with its digest: which version of an adapter it is) and `loraplex_adapters_pinned` (adapters
pinned resident, whether or not their rows are in the pool yet).

One pool holds KV pages and adapters, so "KV usage" counts what a new request could not get: pages neither
free nor reclaimable (unused adapters and unread cached prefixes are evicted when pages are wanted, as
vLLM counts its evictable cached blocks free). The adapter lists are vLLM's: adapters with requests
running, and with requests waiting, comma-separated in first-seen order. Adapter names are the engine's:
`id:<adapter id>` for the gateway's adapters, never a tenant's name for one.

Written by the engine's thread (one immutable state, swapped whole by one assignment), rendered at scrape
time by a collector: a scrape sees one snapshot, never half of one.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from loraplex.engine.stats import AdapterReport, EngineStats

# Seconds: a load is a host-cache hit and a copy (milliseconds), or a read from the store (seconds).
_LOAD_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
GPU = "gpu"


@dataclass(frozen=True)
class Capacity:
    """What the engine was made with; fixed while it serves."""

    block_size: int  # tokens per pool page
    num_blocks: int  # usable pool pages (reserved ones left out), shared by the KV cache and adapters
    max_num_seqs: int
    max_resident_adapters: int | None  # None: as many as pages allow
    prefix_caching: bool

    def adapter_slots(self, largest_adapter_pages: int, on_device: int) -> int:
        """Adapters the pool can hold at once: max_resident_adapters, or fewer when the usable pages cannot
        hold that many of the largest registered adapter (the KV cache aside); never fewer than it holds."""
        bound = self.num_blocks // largest_adapter_pages if largest_adapter_pages else self.num_blocks
        if self.max_resident_adapters is not None:
            bound = min(bound, self.max_resident_adapters)
        return max(bound, on_device)


@dataclass(frozen=True)
class _State:
    """One publish: what the collector renders."""

    capacity: Capacity
    report: AdapterReport
    kv_usage: float
    at: float  # unix time


def kv_usage(stats: EngineStats, reclaimable_pages: int) -> float:
    """Share (0..1) of the usable pages that are neither free nor reclaimable."""
    usable = stats.num_pages - stats.pages.get("reserved", 0)
    if usable <= 0:
        return 0.0
    available = stats.pages.get("free", 0) + reclaimable_pages
    return min(1.0, max(0.0, 1.0 - available / usable))


def adapter_list(counts: Mapping[str, int]) -> str:
    """A label value listing adapter names, comma-separated as vLLM writes it. A comma (or a percent sign)
    in a name is percent-encoded, so every name is one item."""
    return ",".join(name.replace("%", "%25").replace(",", "%2C") for name in counts)


class ModelServerMetrics(Collector):
    def __init__(self, registry: CollectorRegistry, model_name: str):
        self.model_name = model_name
        self._queue = (0, 0)  # (waiting, running): a tuple, so a scrape reads both from one moment
        self._state: _State | None = None
        self._capacity: Capacity | None = None
        self.load_seconds = Histogram(
            "vllm:lora_adapter_load_seconds",
            "Time to make an adapter resident in the device pool (host-cache read included), per load.",
            ["model_name"],
            buckets=_LOAD_BUCKETS,
            registry=registry,
        )
        self._load_seconds = self.load_seconds.labels(model_name)
        registry.register(self)

    def configure(self, capacity: Capacity) -> None:
        """Once, when the engine is made."""
        self._capacity = capacity

    def observe_queue(self, waiting: int, running: int) -> None:
        self._queue = (waiting, running)

    def observe(self, report: AdapterReport, stats: EngineStats) -> None:
        """A new snapshot (the engine's thread, between steps)."""
        assert self._capacity is not None, "configure() before observe()"
        for seconds in report.load_seconds:
            self._load_seconds.observe(seconds)
        usage = kv_usage(stats, report.reclaimable_pages)
        self._state = _State(self._capacity, report, usage, time.time())

    # -- the collector (scrape time, the event loop's thread) --------------------------------------------

    def describe(self) -> Iterable[Metric]:
        return []  # rendered from the current state only: registering must not collect

    def collect(self) -> Iterator[Metric]:
        waiting, running = self._queue
        yield self._gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", waiting)
        yield self._gauge("vllm:num_requests_running", "Requests in the running batch.", running)
        state = self._state
        if state is None:  # the engine is still loading
            return
        capacity, report = state.capacity, state.report
        yield self._gauge(
            "vllm:kv_cache_usage_perc",
            "Share (0..1) of the pool's usable pages neither free nor reclaimable (1 means 100 percent).",
            state.kv_usage,
        )
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "The pool's shape: pages (blocks) of block_size tokens, shared by the KV cache and adapters.",
            labels=["block_size", "num_gpu_blocks", "enable_prefix_caching"],
        )
        info.add_metric(
            [str(capacity.block_size), str(capacity.num_blocks), str(capacity.prefix_caching)], 1.0
        )
        yield info
        on_device = sum(1 for adapter in report.loaded if adapter.level == GPU)
        slots = capacity.adapter_slots(report.largest_adapter_pages, on_device)
        requests = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Adapters with requests running and waiting; the value is the unix time of this state.",
            labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        max_lora = min(capacity.max_num_seqs, slots)  # a batch row carries one adapter
        requests.add_metric(
            [str(max_lora), adapter_list(report.running), adapter_list(report.waiting)], state.at
        )
        yield requests
        loaded = GaugeMetricFamily(
            "vllm:lora_adapter_loaded",
            "1 per adapter held: level gpu (its rows in the device pool) or cpu (packed in host memory).",
            labels=["adapter_name", "level", "pinned", "rank"],
        )
        for adapter in report.loaded:
            # Pinned (POST /internal/pins): kept resident, never evicted; the others go LRU first.
            pinned = "true" if adapter.pinned else "false"
            loaded.add_metric([adapter.name, adapter.level, pinned, str(adapter.rank)], 1.0)
        yield loaded
        # Our own per-adapter series: which weights (the digest: an adapter version) each held adapter is,
        # whether it is pinned. Bounded like the one above: one series per adapter held.
        versions = GaugeMetricFamily(
            "loraplex_adapter_loaded",
            "1 per adapter held, with its digest (sha256: the version of the adapter it is) and pin.",
            labels=["adapter_name", "sha256", "level", "pinned"],
        )
        for adapter in report.loaded:
            pinned = "true" if adapter.pinned else "false"
            versions.add_metric([adapter.name, adapter.sha256, adapter.level, pinned], 1.0)
        yield versions
        yield GaugeMetricFamily(
            "loraplex_adapters_pinned",
            "Adapters pinned resident (never evicted while pinned).",
            value=float(report.pinned),
        )
        yield self._gauge(
            "vllm:num_gpu_loaded_lora_adapters", "Adapters whose rows are in the device pool.", on_device
        )
        yield self._gauge("vllm:max_gpu_lora_adapters", "Adapters the device pool can hold at once.", slots)

    def _gauge(self, name: str, documentation: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, documentation, labels=["model_name"])
        family.add_metric([self.model_name], float(value))
        return family

"""The server's Prometheus series: our own, named loraplex_*, and the model-server protocol's vllm:* ones
(model_server.py), in a registry of their own. /metrics serves them to holders of the internal token only.

A registry per app (not prometheus-client's global one) lets several servers live in one process, as
the tests run them. The operator autoscales on three gauges whose names are a contract
(operator/metrics.py): loraplex_requests_waiting, loraplex_requests_running, loraplex_pool_utilization.
The control plane's placement reads loraplex_adapter_capacity_bytes (web/services/engine_load.py), also a
contract: each pod's adapter budget in pool bytes (docs/placement.md, Bounded).

Tenants: tokens per tenant are counted only when the operator turns it on (`tenant_metrics`), and then
under an opaque id (`opaque_tenant_id`), never the tenant's id or name: whoever reads /metrics learns how
much some tenant used, not who it is.

Engine-side figures are read by the engine thread (the only one allowed to touch the engine) and
pushed here; prometheus-client's metrics are thread-safe, so /metrics reads them from the event loop.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from loraplex.engine.stats import AdapterReport, EngineStats

from .model_server import Capacity, ModelServerMetrics

if TYPE_CHECKING:
    from loraplex.engine.config import EngineConfig

# Seconds: CPU decode steps take tens of milliseconds, GPU steps a few; long tails reach minutes.
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
OTHER_TENANTS = "other"
NO_TENANT = "none"


def adapter_capacity_bytes(usable_pages: int, page_bytes: int, config: EngineConfig) -> int:
    """Pool bytes adapters may hold while a full batch keeps its KV room: the usable pages less
    `max_num_seqs` requests of `kv_headroom_tokens` each (whole pages per request), times the bytes of a
    page; 0 when that headroom takes the whole pool."""
    per_request = -(-config.kv_headroom_tokens // config.page_size)
    return max(0, usable_pages - config.max_num_seqs * per_request) * page_bytes


def opaque_tenant_id(key: bytes, tenant: str) -> str:
    """A tenant's label: `t-` and 16 hex digits of HMAC-SHA256 under `key` (the server derives it from the
    internal token, so one tenant has the same label on every engine of a cluster and sums across pods
    work, while nobody without the token can tell which tenant a label is, even by hashing guesses)."""
    digest = hmac.new(key, b"loraplex tenant label\x00" + tenant.encode(), hashlib.sha256).hexdigest()
    return "t-" + digest[:16]


def tenant_label_key(internal_token: str | None) -> bytes:
    """The key of the tenant labels: from the internal token; without one, nobody is a tenant (tenant
    headers are refused), and a key of its own per process serves."""
    if internal_token is None:
        return os.urandom(32)
    return hashlib.sha256(b"loraplex tenant labels\x00" + internal_token.encode()).digest()


class TenantLabels:
    """Opaque labels of bounded cardinality: the first `limit` tenants seen get a label of their own, the
    rest share `other`, so a flood of tenants cannot grow the series count without bound."""

    def __init__(self, limit: int, key: bytes):
        self.limit = limit
        self.key = key
        self._known: set[str] = set()
        self._lock = threading.Lock()

    def label(self, tenant: str | None) -> str:
        if not tenant:
            return NO_TENANT
        opaque = opaque_tenant_id(self.key, tenant)
        with self._lock:
            if opaque in self._known:
                return opaque
            if len(self._known) < self.limit:
                self._known.add(opaque)
                return opaque
        return OTHER_TENANTS


class TenantCounters:
    """Tokens per tenant, under opaque labels: what the operator turns on with `tenant_metrics`."""

    def __init__(self, registry: CollectorRegistry, labels: TenantLabels):
        self.labels = labels
        self.prompt_tokens = Counter(
            "loraplex_tenant_prompt_tokens",
            "Prompt tokens admitted, by opaque tenant id.",
            ["tenant"],
            registry=registry,
        )
        self.generation_tokens = Counter(
            "loraplex_tenant_generation_tokens",
            "Tokens generated, by opaque tenant id.",
            ["tenant"],
            registry=registry,
        )

    def count_prompt(self, tenant: str | None, tokens: int) -> None:
        self.prompt_tokens.labels(self.labels.label(tenant)).inc(tokens)

    def count_generated(self, tenant: str | None, tokens: int) -> None:
        self.generation_tokens.labels(self.labels.label(tenant)).inc(tokens)


class NoTenantCounters:
    """Per-tenant counting off (the default): no series names or counts any tenant."""

    def count_prompt(self, tenant: str | None, tokens: int) -> None:
        pass

    def count_generated(self, tenant: str | None, tokens: int) -> None:
        pass


class ServerMetrics:
    def __init__(
        self,
        tenant_labels: TenantLabels | None = None,
        registry: CollectorRegistry | None = None,
        model_name: str = "",
    ):
        """`tenant_labels`: count tokens per tenant under these labels (None: no per-tenant series)."""
        self.registry = r = registry or CollectorRegistry()
        self.tenants = NoTenantCounters() if tenant_labels is None else TenantCounters(r, tenant_labels)
        self.model_server = ModelServerMetrics(r, model_name)
        # Registered by observe_capacity: while the model loads there is no budget to report, and a 0
        # would read as "no room" to the control plane's placement.
        self.adapter_capacity_bytes: Gauge | None = None

        self.requests_waiting = Gauge(
            "loraplex_requests_waiting", "Requests admitted but not yet scheduled.", registry=r
        )
        self.requests_running = Gauge(
            "loraplex_requests_running", "Requests in the running batch.", registry=r
        )
        self.pool_utilization = Gauge(
            "loraplex_pool_utilization",
            "Pages of the device pool not free, as a fraction (0..1).",
            registry=r,
        )
        self.pool_pages = Gauge("loraplex_pool_pages", "Pool pages by what holds them.", ["kind"], registry=r)
        self.pool_pages_total = Gauge("loraplex_pool_pages_total", "Pages in the device pool.", registry=r)
        self.adapters_resident = Gauge(
            "loraplex_adapters_resident", "Adapters in the device pool.", registry=r
        )
        self.adapters_registered = Gauge(
            "loraplex_adapters_registered", "Adapters this server can serve.", registry=r
        )
        self.adapter_loads = Counter("loraplex_adapter_loads", "Adapter copies into the pool.", registry=r)
        self.adapter_evictions = Counter(
            "loraplex_adapter_evictions", "Adapters evicted from the pool.", registry=r
        )
        self.adapter_load_seconds = Counter(
            "loraplex_adapter_load_seconds", "Time spent making adapters resident.", registry=r
        )
        self.adapters_draining = Gauge(
            "loraplex_adapters_draining",
            "Adapters unregistered but still serving the requests that named them.",
            registry=r,
        )
        self.adapter_host_cache_bytes = Gauge(
            "loraplex_adapter_host_cache_bytes", "Packed adapters held in host memory.", registry=r
        )
        self.model_weight_bytes = Gauge(
            "loraplex_model_weight_bytes",
            "Bytes the base model's weights hold (quantized codes and scales, and any dense copies kept).",
            ["quantization"],
            registry=r,
        )
        self.adapter_host_cache_lookups = Counter(
            "loraplex_adapter_host_cache_lookups",
            "Adapter loads by what the host cache had: hit (packed), wait (its read was running), miss.",
            ["result"],
            registry=r,
        )
        self.adapter_registrations = Counter(
            "loraplex_adapter_registrations", "Adapter registrations by outcome.", ["outcome"], registry=r
        )
        self.prompt_tokens = Counter("loraplex_prompt_tokens", "Prompt tokens admitted.", registry=r)
        self.generation_tokens = Counter("loraplex_generation_tokens", "Tokens generated.", registry=r)
        self.time_to_first_token = Histogram(
            "loraplex_time_to_first_token_seconds",
            "From a request's arrival to its first generated token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "loraplex_inter_token_latency_seconds",
            "Between consecutive generated tokens of a request.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e_latency = Histogram(
            "loraplex_e2e_request_latency_seconds",
            "From a request's arrival to its end.",
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        self.requests_finished = Counter(
            "loraplex_requests_finished", "Requests ended, by finish reason.", ["finish_reason"], registry=r
        )
        self.requests_rejected = Counter(
            "loraplex_requests_rejected",
            "Requests refused before reaching the engine.",
            ["reason"],
            registry=r,
        )
        self.step_errors = Counter("loraplex_engine_step_errors", "Engine steps that raised.", registry=r)
        # Hit rate = rate(prefix_cache_hit_tokens) / rate(prefix_cache_queried_tokens).
        self.prefix_queried_tokens = Counter(
            "loraplex_prefix_cache_queried_tokens",
            "Prompt tokens of admitted requests looked up in the prefix cache.",
            registry=r,
        )
        self.prefix_hit_tokens = Counter(
            "loraplex_prefix_cache_hit_tokens",
            "Prompt tokens found in the prefix cache (not computed).",
            registry=r,
        )
        self.prefix_evictions = Counter(
            "loraplex_prefix_cache_evictions", "Cached prefix pages evicted from the pool.", registry=r
        )
        self.prefix_cached_pages = Gauge(
            "loraplex_prefix_cache_pages", "Pool pages held by the prefix cache, read or not.", registry=r
        )
        # Speculative decoding (engine option speculative): acceptance rate = rate(accepted) / rate(draft
        # tokens), tokens per step = (rate(accepted) + rate(drafts)) / rate(drafts); the gauges hold both
        # since the engine started.
        self.spec_drafts = Counter(
            "loraplex_spec_decode_drafts", "Decodes that carried a draft and were verified.", registry=r
        )
        self.spec_draft_tokens = Counter(
            "loraplex_spec_decode_draft_tokens", "Draft tokens proposed and verified.", registry=r
        )
        self.spec_accepted_tokens = Counter(
            "loraplex_spec_decode_accepted_tokens", "Draft tokens that held (emitted as output).", registry=r
        )
        self.spec_acceptance_rate = Gauge(
            "loraplex_spec_decode_acceptance_rate",
            "Accepted draft tokens over draft tokens, since the engine started.",
            registry=r,
        )
        self.spec_tokens_per_step = Gauge(
            "loraplex_spec_decode_tokens_per_step",
            "Tokens a decode with a draft emits per step (accepted + 1), since the engine started.",
            registry=r,
        )
        # Known label values exist from the start at 0, so a rate() over them has a beginning.
        for outcome in ("ok", "fetch_failed", "invalid"):
            self.adapter_registrations.labels(outcome)
        for reason in ("stop", "length", "abort", "error"):
            self.requests_finished.labels(reason)
        self.requests_rejected.labels("queue_full")
        self._engine_stats: dict[str, float] = {}

    def observe_model(self, weight_bytes: int, quantization: str) -> None:
        """Set once when the engine is made: the weights do not change while it serves."""
        self.model_weight_bytes.labels(quantization).set(weight_bytes)

    def observe_capacity(self, config: EngineConfig, stats: EngineStats, page_bytes: int) -> None:
        """Set once when the engine is made: the pool's shape (pages of `page_bytes`), the batch's bounds,
        and the adapter budget they leave."""
        usable = stats.num_pages - stats.pages.get("reserved", 0)
        self.model_server.configure(
            Capacity(
                block_size=config.page_size,
                num_blocks=usable,
                max_num_seqs=config.max_num_seqs,
                max_resident_adapters=config.max_resident_adapters,
                prefix_caching=stats.prefix is not None,
            )
        )
        if self.adapter_capacity_bytes is None:
            self.adapter_capacity_bytes = Gauge(
                "loraplex_adapter_capacity_bytes",
                "Pool bytes adapters may hold while a full batch keeps kv_headroom_tokens of KV per request.",
                registry=self.registry,
            )
        self.adapter_capacity_bytes.set(adapter_capacity_bytes(usable, page_bytes, config))

    def observe_pool(self, pages_by_kind: Mapping[str, int], num_pages: int) -> None:
        for kind in ("kv", "prefix", "adapter", "free", "reserved"):
            self.pool_pages.labels(kind).set(pages_by_kind.get(kind, 0))
        self.pool_pages_total.set(num_pages)
        self.pool_utilization.set(
            (num_pages - pages_by_kind.get("free", 0)) / num_pages if num_pages else 0.0
        )

    def observe_queue(self, waiting: int, running: int) -> None:
        self.requests_waiting.set(waiting)
        self.requests_running.set(running)
        self.model_server.observe_queue(waiting, running)

    def observe_adapters(self, report: AdapterReport, stats: EngineStats) -> None:
        """What the engine holds and serves, for the model-server protocol (taken with `stats`)."""
        self.model_server.observe(report, stats)

    def observe_engine(self, stats: EngineStats) -> None:
        """Pool, queue and adapter figures from one engine.stats() snapshot."""
        self.observe_pool(stats.pages, stats.num_pages)
        self.observe_queue(stats.waiting, stats.running)
        self.adapters_registered.set(stats.adapters_registered)
        self.adapters_resident.set(stats.adapters_resident)
        self.adapters_draining.set(stats.adapters_draining)
        self.adapter_host_cache_bytes.set(stats.host_cache_bytes)
        # The engine keeps running totals; the counters take what was added since the last look.
        for counter, key, value in (
            (self.adapter_loads, "loads", float(stats.adapter_loads)),
            (self.adapter_evictions, "evictions", float(stats.adapter_evictions)),
            (self.adapter_load_seconds, "load_seconds", stats.adapter_load_seconds),
            (self.adapter_host_cache_lookups.labels("hit"), "hits", float(stats.host_cache_hits)),
            (self.adapter_host_cache_lookups.labels("wait"), "waits", float(stats.host_cache_waits)),
            (self.adapter_host_cache_lookups.labels("miss"), "misses", float(stats.host_cache_misses)),
            *self._prefix_totals(stats),
            *self._spec_totals(stats),
        ):
            previous = self._engine_stats.get(key, 0.0)
            if value > previous:
                counter.inc(value - previous)
            self._engine_stats[key] = value

    def _spec_totals(self, stats: EngineStats) -> list[tuple[Counter, str, float]]:
        if stats.spec is None:  # speculative decoding is off
            return []
        self.spec_acceptance_rate.set(stats.spec.acceptance_rate)
        self.spec_tokens_per_step.set(stats.spec.tokens_per_step)
        return [
            (self.spec_drafts, "spec_drafts", float(stats.spec.drafts)),
            (self.spec_draft_tokens, "spec_draft_tokens", float(stats.spec.draft_tokens)),
            (self.spec_accepted_tokens, "spec_accepted_tokens", float(stats.spec.accepted_tokens)),
        ]

    def _prefix_totals(self, stats: EngineStats) -> list[tuple[Counter, str, float]]:
        if stats.prefix is None:  # prefix caching is off
            return []
        self.prefix_cached_pages.set(stats.prefix.cached_pages)
        return [
            (self.prefix_queried_tokens, "prefix_queried", float(stats.prefix.queried_tokens)),
            (self.prefix_hit_tokens, "prefix_hits", float(stats.prefix.hit_tokens)),
            (self.prefix_evictions, "prefix_evictions", float(stats.prefix.evictions)),
        ]

    def count_prompt(self, tenant: str | None, tokens: int) -> None:
        self.prompt_tokens.inc(tokens)
        self.tenants.count_prompt(tenant, tokens)

    def count_generated(self, tenant: str | None, tokens: int) -> None:
        self.generation_tokens.inc(tokens)
        self.tenants.count_generated(tenant, tokens)

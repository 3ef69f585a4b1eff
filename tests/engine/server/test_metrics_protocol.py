"""Our /metrics read as the Gateway API Inference Extension reads a model server (issue 26, item 2).

The rules are the protocol document's (kubernetes-sigs/gateway-api-inference-extension,
docs/proposals/003-model-server-protocol/README.md) with vLLM's names and label sets (the extension's
reference picker and llm-d look for those), and the loaded-adapter series proposed to vLLM
(vllm-project/vllm#54830):
- TotalQueuedRequests `vllm:num_requests_waiting`, TotalRunningRequests `vllm:num_requests_running`: gauges
  of request counts; KVCacheUtilization `vllm:kv_cache_usage_perc`: a gauge in [0, 1];
- `vllm:cache_config_info`: a gauge of 1 labelled `block_size` and `num_gpu_blocks`;
- `vllm:lora_requests_info`: a gauge whose value is the last update time (unix seconds), labelled
  `max_lora` (the most adapters a batch can be served with), `running_lora_adapters` and
  `waiting_lora_adapters` (comma-separated: the adapters of running requests, loaded in the pool, and of
  waiting ones);
- `vllm:lora_adapter_loaded{adapter_name,level,pinned,rank}`: 1 per adapter held, level gpu or cpu;
  `vllm:num_gpu_loaded_lora_adapters` (their gpu count), `vllm:max_gpu_lora_adapters`; and the histogram
  `vllm:lora_adapter_load_seconds`.
The text is parsed by prometheus-client's own parser, as a scraper would.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

import httpx
import pytest
from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from loraplex.engine import EngineConfig, LLMEngine
from loraplex.engine.lora.synthetic import SyntheticAdapter
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.server.metrics import ServerMetrics

from .conftest import DEMO_ADAPTER, INTERNAL, Server, ServerFactory

GAUGES = (
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:cache_config_info",
    "vllm:lora_requests_info",
    "vllm:lora_adapter_loaded",
    "vllm:num_gpu_loaded_lora_adapters",
    "vllm:max_gpu_lora_adapters",
)
LORA_INFO_LABELS = {"max_lora", "running_lora_adapters", "waiting_lora_adapters"}
LOADED_LABELS = {"adapter_name", "level", "pinned", "rank"}


@dataclass
class Protocol:
    """What a router reads from one scrape, after checking every rule that does not need the engine."""

    waiting: int
    running: int
    kv_usage: float
    block_size: int
    num_gpu_blocks: int
    max_lora: int
    running_adapters: list[str]
    waiting_adapters: list[str]
    updated_at: float
    loaded: dict[str, tuple[str, int]]  # adapter -> (level, rank)
    num_gpu_loaded: int
    max_gpu: int
    loads: int  # observations of the load-time histogram

    @property
    def on_gpu(self) -> set[str]:
        return {name for name, (level, _) in self.loaded.items() if level == "gpu"}


def only(family: Metric) -> Any:
    """The family's one sample (a router reads one per pod)."""
    assert len(family.samples) == 1, (family.name, family.samples)
    return family.samples[0]


def split(value: str) -> list[str]:
    return [name.strip() for name in value.split(",") if name.strip()]


def read_protocol(text: str) -> Protocol:
    families = {family.name: family for family in text_string_to_metric_families(text)}
    for name in GAUGES:
        assert name in families, f"{name} is missing"
        assert families[name].type == "gauge", (name, families[name].type)
    count = {
        name: only(families[name]).value
        for name in ("vllm:num_requests_waiting", "vllm:num_requests_running")
    }
    for name, value in count.items():
        assert value >= 0 and value == int(value), (name, value)
    kv = only(families["vllm:kv_cache_usage_perc"]).value
    assert 0.0 <= kv <= 1.0, kv
    cache = only(families["vllm:cache_config_info"])
    assert cache.value == 1.0
    block_size, num_blocks = int(cache.labels["block_size"]), int(cache.labels["num_gpu_blocks"])
    assert block_size > 0 and num_blocks > 0
    info = only(families["vllm:lora_requests_info"])
    assert set(info.labels) == LORA_INFO_LABELS, info.labels
    max_lora = int(info.labels["max_lora"])
    assert max_lora >= 1
    loaded: dict[str, tuple[str, int]] = {}
    for sample in families["vllm:lora_adapter_loaded"].samples:
        assert set(sample.labels) == LOADED_LABELS and sample.value == 1.0, sample
        name, level = sample.labels["adapter_name"], sample.labels["level"]
        assert level in ("gpu", "cpu") and sample.labels["pinned"] in ("true", "false"), sample
        assert name not in loaded, f"{name} is reported twice"
        loaded[name] = (level, int(sample.labels["rank"]))
        assert loaded[name][1] >= 1
    num_gpu = only(families["vllm:num_gpu_loaded_lora_adapters"]).value
    max_gpu = only(families["vllm:max_gpu_lora_adapters"]).value
    assert num_gpu == sum(1 for level, _ in loaded.values() if level == "gpu")
    assert num_gpu <= max_gpu and max_lora <= max_gpu
    histogram = families["vllm:lora_adapter_load_seconds"]
    assert histogram.type == "histogram"
    buckets = [s.value for s in histogram.samples if s.name.endswith("_bucket")]
    assert buckets == sorted(buckets), "histogram buckets must be cumulative"
    loads = next(s.value for s in histogram.samples if s.name.endswith("_count"))
    assert buckets[-1] == loads
    protocol = Protocol(
        waiting=int(count["vllm:num_requests_waiting"]),
        running=int(count["vllm:num_requests_running"]),
        kv_usage=kv,
        block_size=block_size,
        num_gpu_blocks=num_blocks,
        max_lora=max_lora,
        running_adapters=split(info.labels["running_lora_adapters"]),
        waiting_adapters=split(info.labels["waiting_lora_adapters"]),
        updated_at=info.value,
        loaded=loaded,
        num_gpu_loaded=int(num_gpu),
        max_gpu=int(max_gpu),
        loads=int(loads),
    )
    # Running requests' adapters are in the pool: that is what "running" promises a router.
    assert set(protocol.running_adapters) <= protocol.on_gpu, protocol
    return protocol


# -- the engine's snapshot against the engine's state, step by step ------------------------------------------


def tiny_engine(**config: Any) -> LLMEngine:
    engine = LLMEngine(EngineConfig(model="random:tiny", device="cpu", num_pages=128, **config))
    base = engine.loaded.config.lora_shape()
    for i in range(4):
        engine.register_adapter(f"a{i}", SyntheticAdapter(base, seed=i, rank=4 + i))
    return engine


def page_bytes(engine: LLMEngine) -> int:
    return engine.cache.memory[0].nbytes


def scrape(engine: LLMEngine, metrics: ServerMetrics) -> Protocol:
    """One publish as the server's loop makes it, then the text a scrape gets."""
    stats = engine.stats()
    metrics.observe_queue(stats.waiting, stats.running)
    metrics.observe_adapters(engine.adapter_report(), stats)
    return read_protocol(generate_latest(metrics.registry).decode())


def by_adapter(requests: Any) -> list[str]:
    return list(Counter(r.adapter for r in requests if r.adapter is not None))


def test_running_and_waiting_adapters_are_the_engine_s_at_every_step() -> None:
    engine = tiny_engine(max_num_seqs=2, max_resident_adapters=3, adapter_prefetch_depth=0)
    metrics = ServerMetrics(model_name="tiny")
    metrics.observe_capacity(engine.config, engine.stats(), page_bytes(engine))
    began = time.time()
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for adapter in ("a0", "a1", None, "a2", "a3", "a0"):
        engine.add_request([1, 2, 3, 4, 5], greedy, adapter=adapter)
    seen_both = False
    while True:
        protocol = scrape(engine, metrics)
        scheduler = engine.scheduler
        assert protocol.running_adapters == by_adapter(scheduler.running)
        assert protocol.waiting_adapters == by_adapter(scheduler.waiting)
        assert (protocol.running, protocol.waiting) == (len(scheduler.running), len(scheduler.waiting))
        assert protocol.max_lora == 2  # min(max_num_seqs, max_resident_adapters)
        assert protocol.max_gpu == 3  # max_resident_adapters
        assert began <= protocol.updated_at <= time.time()
        assert protocol.block_size == engine.config.page_size and protocol.num_gpu_blocks == 127
        resident = {name for name in engine.registry.resident_names() if engine.registry.entry(name).loaded}
        assert protocol.on_gpu == resident
        assert all(
            protocol.loaded[name][1] == 4 + int(name[1]) for name in protocol.loaded
        )  # a<i>: rank 4 + i
        seen_both |= bool(protocol.running_adapters and protocol.waiting_adapters)
        if not engine.has_unfinished():
            break
        engine.step()
    assert seen_both, "the test never saw adapters running and waiting at once"
    assert protocol.running_adapters == protocol.waiting_adapters == [] and protocol.running == 0
    assert protocol.loads == engine.stats().adapter_loads > 0  # every load observed once
    assert protocol.kv_usage == 0.0  # idle: every page is free or held by an unused adapter


def test_an_adapter_packed_in_host_memory_is_reported_at_the_cpu_level() -> None:
    engine = tiny_engine(max_num_seqs=4, max_resident_adapters=1)  # one in the pool, the rest prefetched
    metrics = ServerMetrics(model_name="tiny")
    metrics.observe_capacity(engine.config, engine.stats(), page_bytes(engine))
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for adapter in ("a0", "a1"):
        engine.add_request([1, 2, 3], greedy, adapter=adapter)
    while engine.has_unfinished():
        engine.step()
    protocol = scrape(engine, metrics)
    assert protocol.on_gpu == {"a1"}  # the pool holds one: a0 was evicted for a1
    assert protocol.loaded["a0"] == ("cpu", 4)  # still packed in host memory: one copy away
    assert protocol.max_lora == protocol.max_gpu == 1


def test_without_a_resident_cap_the_pool_bounds_the_adapters() -> None:
    engine = tiny_engine(max_num_seqs=64)
    metrics = ServerMetrics(model_name="tiny")
    metrics.observe_capacity(engine.config, engine.stats(), page_bytes(engine))
    protocol = scrape(engine, metrics)
    largest = max(facts.pages for facts in engine.adapter_view.values())
    assert protocol.max_gpu == 127 // largest  # how many of the largest registered adapter fit
    assert protocol.max_lora == min(64, protocol.max_gpu)


def adapter_capacity(text: str) -> float | None:
    families = {family.name: family for family in text_string_to_metric_families(text)}
    family = families.get("loraplex_adapter_capacity_bytes")
    if family is None:
        return None
    assert family.type == "gauge"
    return float(only(family).value)


def test_the_adapter_budget_is_the_pool_less_a_full_batch_of_kv_headroom() -> None:
    # 127 usable pages of 16 tokens; 4 requests of 40 tokens take 3 pages each: 12 pages of headroom.
    engine = tiny_engine(max_num_seqs=4, kv_headroom_tokens=40)
    per_page = page_bytes(engine)
    assert per_page == engine.cache.memory.numel() // 128 * engine.cache.memory.element_size()
    metrics = ServerMetrics(model_name="tiny")
    assert adapter_capacity(generate_latest(metrics.registry).decode()) is None  # no budget while loading
    metrics.observe_capacity(engine.config, engine.stats(), per_page)
    assert adapter_capacity(generate_latest(metrics.registry).decode()) == (127 - 4 * 3) * per_page
    # Headroom past the pool leaves no budget: 0, never negative.
    full = ServerMetrics(model_name="tiny")
    config = replace(engine.config, kv_headroom_tokens=16 * 32)  # 4 x 32 pages > 127
    full.observe_capacity(config, engine.stats(), per_page)
    assert adapter_capacity(generate_latest(full.registry).decode()) == 0
    # No headroom: the whole usable pool.
    none = ServerMetrics(model_name="tiny")
    none.observe_capacity(replace(engine.config, kv_headroom_tokens=0), engine.stats(), per_page)
    assert adapter_capacity(generate_latest(none.registry).decode()) == 127 * per_page


def test_a_negative_headroom_is_refused_with_the_option_s_name() -> None:
    with pytest.raises(ValueError, match="kv_headroom_tokens must be an integer of 0 or more, got -1"):
        EngineConfig(model="random:tiny", kv_headroom_tokens=-1)


def test_adapter_names_in_the_lists_stay_one_item_each() -> None:
    from loraplex.engine.server.model_server import adapter_list

    assert split(adapter_list({"id:1": 1, "a,b": 2, "50%": 1})) == ["id:1", "a%2Cb", "50%25"]


# -- a live server, through the gateway's door ---------------------------------------------------------------


def protocol_of(server: Server) -> Protocol:
    return read_protocol(server.metrics())


def gateway(adapter_id: str) -> dict[str, str]:
    """The gateway's headers for the demo adapter under `adapter_id` (one tenant: no newcomer yields)."""
    return {
        **INTERNAL,
        "X-Loraplex-Tenant": "tenant-7",
        "X-Loraplex-Adapter-Id": adapter_id,
        "X-Loraplex-Adapter-Uri": DEMO_ADAPTER.as_uri(),
    }


def until(condition: Any, what: str, timeout_s: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting until {what}")


def test_a_live_server_reports_what_it_runs_and_holds_by_internal_names(make_server: ServerFactory) -> None:
    server = make_server(engine={"num_pages": 96, "max_num_seqs": 1, "max_resident_adapters": 2})
    first, second = str(uuid.uuid4()), str(uuid.uuid4())
    rank = json.loads((DEMO_ADAPTER / "adapter_config.json").read_text())["r"]
    began = time.time()
    body = {"prompt": "Count to a thousand:", "temperature": 0, "ignore_eos": True}
    answers: list[httpx.Response] = []

    def second_request() -> None:
        answers.append(
            httpx.post(
                f"{server.url}/v1/completions",
                json={**body, "model": "tenant-name-two", "max_tokens": 2},
                headers=gateway(second),
                timeout=120,
            )
        )

    long = {**body, "model": "tenant-name-one", "max_tokens": 400, "stream": True}
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=long, headers=gateway(first), timeout=120
    ) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))  # the first adapter runs
        waiter = threading.Thread(target=second_request)
        waiter.start()
        both = until(
            lambda: (p := protocol_of(server)).waiting_adapters == [f"id:{second}"] and p,
            "the second adapter's request waits behind the first",
        )
        assert both.running_adapters == [f"id:{first}"] and (both.running, both.waiting) == (1, 1)
        assert both.max_lora == 1  # max_num_seqs: one row, one adapter
    waiter.join(timeout=120)
    assert answers and answers[0].status_code == 200, answers
    server.wait_idle()
    idle = until(
        lambda: (p := protocol_of(server)).running == 0 and not p.running_adapters and p, "the server is idle"
    )
    text = server.metrics()
    assert "tenant-name" not in text and "tenant-7" not in text  # engine names only, never a tenant's
    assert idle.loaded == {f"id:{first}": ("gpu", rank), f"id:{second}": ("gpu", rank)}
    assert idle.num_gpu_loaded == 2 and idle.max_gpu == 2 and idle.loads == 2
    assert began <= idle.updated_at <= time.time()
    assert idle.num_gpu_blocks == 96 - 1 and idle.block_size == server.engine.config.page_size
    assert idle.kv_usage == pytest.approx(0.0)  # the adapters are unused: evictable, counted as room
    # The budget the gateway places against: 95 usable pages less one request of 256 tokens (16 pages).
    assert adapter_capacity(text) == (95 - 16) * page_bytes(server.engine)

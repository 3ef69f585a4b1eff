"""Autoscaling on adapter demand: the signals read from engine /metrics text, the decision over several
signals, what the Event and the status say, and the scrape with the internal token."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import aiohttp
import aiohttp.web
import pytest

from loraplex import wire
from loraplex.operator.autoscaler import Reading, ScalingPolicy, ScalingState, combine, decide
from loraplex.operator.events import SCALED_UP
from loraplex.operator.main import decision_status, scale_event
from loraplex.operator.metrics import PodTarget, Sample, parse_samples, scrape_headers, scrape_pods
from loraplex.operator.signals import (
    SIGNALS,
    AdapterDemand,
    adapter_demand,
    pool_pressure,
    rate,
    read_signals,
    unplaced_adapters,
)
from loraplex.operator.spec import parse
from tests.operator.helpers import body


def engine_text(
    waiting: float = 0,
    loads: float = 0,
    evictions: float = 0,
    running_adapters: str = "",
    waiting_adapters: str = "",
    max_lora: int = 4,
    free: int = 50,
    prefix: int = 10,
    total: int = 100,
) -> str:
    """An engine's /metrics as the server writes it: loraplex_* series and the model-server protocol's."""
    return (
        "# HELP loraplex_requests_waiting Requests admitted but not yet scheduled.\n"
        "# TYPE loraplex_requests_waiting gauge\n"
        f"loraplex_requests_waiting {waiting}\n"
        f'loraplex_pool_pages{{kind="free"}} {free}\nloraplex_pool_pages{{kind="prefix"}} {prefix}\n'
        f'loraplex_pool_pages{{kind="kv"}} {total - free - prefix}\nloraplex_pool_pages_total {total}\n'
        f"loraplex_adapter_loads_total {loads}\nloraplex_adapter_loads_created 1.7e9\n"
        f"loraplex_adapter_evictions_total {evictions}\n"
        "# TYPE vllm:lora_requests_info gauge\n"
        # An older label set the server keeps: the newest (largest value, its update time) counts.
        f'vllm:lora_requests_info{{max_lora="{max_lora}",running_lora_adapters="id:old",'
        'waiting_lora_adapters=""} 1700000000.0\n'
        f'vllm:lora_requests_info{{max_lora="{max_lora}",running_lora_adapters="{running_adapters}",'
        f'waiting_lora_adapters="{waiting_adapters}"}} 1700000100.0\n'
    )


def test_samples_keep_labels_with_commas_escapes_and_skip_garbage() -> None:
    text = (
        'm{a="x,y",b="say \\"hi\\"\\n"} 2 1700000000\n'
        "# a comment\n"
        "not a sample line at all {\n"
        'broken{a="never closed} 3\n'
        "bare 4.5\n"
        'spaced{ a="1" , b="2" ,} 6\n'
    )
    assert parse_samples(text) == [
        Sample("m", {"a": "x,y", "b": 'say "hi"\n'}, 2.0),
        Sample("bare", {}, 4.5),
        Sample("spaced", {"a": "1", "b": "2"}, 6.0),
    ]


def test_adapter_demand_reads_the_newest_lora_info() -> None:
    samples = parse_samples(engine_text(running_adapters="id:a,id:b", waiting_adapters="id:b, id:c"))
    assert adapter_demand(samples) == AdapterDemand(demanded=3, slots=4)  # {a, b, c}, not "id:old"
    # max_lora missing: vllm:max_gpu_lora_adapters gives the slots; neither: no demand per slot.
    fallback = parse_samples(
        'vllm:lora_requests_info{running_lora_adapters="x"} 1\nvllm:max_gpu_lora_adapters 2\n'
    )
    assert adapter_demand(fallback) == AdapterDemand(demanded=1, slots=2)
    assert adapter_demand(parse_samples('vllm:lora_requests_info{running_lora_adapters="x"} 1\n')) is None
    assert adapter_demand(parse_samples("loraplex_requests_waiting 1\n")) is None


def test_pool_pressure_leaves_out_free_and_prefix_cache_pages() -> None:
    assert pool_pressure(parse_samples(engine_text(free=20, prefix=30, total=100))) == pytest.approx(0.5)
    assert pool_pressure(parse_samples("loraplex_pool_utilization 0.5\n")) is None


def test_rates_span_two_scrapes_and_survive_a_restart() -> None:
    assert rate(None, 10.0, 5.0) is None
    assert rate((0.0, 10.0), 15.0, 40.0) == 2.0
    assert rate((0.0, 10.0), 15.0, 3.0) == pytest.approx(0.2)  # the counter restarted from 0
    assert rate((15.0, 10.0), 15.0, 40.0) is None


def test_read_signals_per_pod_with_rates_from_the_last_period() -> None:
    signals = ["waiting_requests", "adapter_loads_per_second", "adapter_demand", "pool_pressure"]
    first = {
        "pod-a": parse_samples(engine_text(waiting=2, loads=10, running_adapters="id:a,id:b,id:c,id:d,id:e")),
        "pod-b": parse_samples(engine_text(waiting=4, loads=0, running_adapters="id:f")),
    }
    values, memory = read_signals(signals, first, {}, now=100.0)
    assert values["waiting_requests"] == [2.0, 4.0]
    assert values["adapter_loads_per_second"] == []  # a rate needs a second reading
    assert values["adapter_demand"] == [5 / 4, 1 / 4]
    assert values["pool_pressure"] == [0.4, 0.4]
    second = {
        "pod-a": parse_samples(engine_text(loads=40)),
        "pod-c": parse_samples(engine_text(loads=7)),  # new: no rate yet
    }
    values, memory = read_signals(signals, second, memory, now=115.0)
    assert values["adapter_loads_per_second"] == [2.0]
    assert set(memory) == {"pod-a", "pod-c"}  # pod-b is gone, and forgotten


def test_unplaced_adapters_is_demand_beyond_every_pods_slots() -> None:
    crowded = {
        "a": parse_samples(engine_text(running_adapters="1,2,3,4,5,6", max_lora=4)),
        "b": parse_samples(engine_text(running_adapters="7,8,9", max_lora=4)),
    }
    assert unplaced_adapters(crowded) == 1  # 9 adapters in flight, 8 slots
    assert unplaced_adapters({"a": crowded["b"]}) == 0
    assert unplaced_adapters({"a": parse_samples("loraplex_requests_waiting 1\n")}) is None


ADAPTER_POLICY = ScalingPolicy(
    min_replicas=1,
    max_replicas=10,
    targets=(("waiting_requests", 4.0), ("adapter_demand", 1.0), ("pool_pressure", 0.9)),
    scale_down_window_s=0.0,
)


def test_adapter_demand_scales_up_while_the_queue_looks_fine() -> None:
    """Two pods with eight slots between them and 12 adapters in flight: the queue is on target, the pool
    has room, but a third of the demand has no slot. The old single-metric autoscaler held at 2."""
    samples = {
        "waiting_requests": [4.0, 4.0],
        "adapter_demand": [6 / 4, 6 / 4],
        "pool_pressure": [0.5, 0.5],
    }
    decision = decide(2, samples, ADAPTER_POLICY, ScalingState(), 0.0)
    assert (decision.desired, decision.reason, decision.signal) == (3, "ScaleUp", "adapter_demand")
    assert [(r.signal, r.raw, r.reason) for r in decision.readings] == [
        ("waiting_requests", 2, "WithinTolerance"),
        ("adapter_demand", 3, "ScaleUp"),
        ("pool_pressure", 2, "ScaleDown"),
    ]
    only_waiting = ScalingPolicy(min_replicas=1, max_replicas=10, targets=(("waiting_requests", 4.0),))
    assert decide(2, samples, only_waiting, ScalingState(), 0.0).desired == 2


def test_scale_down_needs_every_signal() -> None:
    quiet = {"waiting_requests": [0.0] * 4, "adapter_demand": [0.1] * 4, "pool_pressure": [0.1] * 4}
    assert decide(4, quiet, ADAPTER_POLICY, ScalingState(), 0.0).desired < 4
    # The adapter signal is missing (an engine without vllm:lora_requests_info): no shedding blind.
    blind = {"waiting_requests": [0.0] * 4, "pool_pressure": [0.1] * 4}
    decision = decide(4, blind, ADAPTER_POLICY, ScalingState(), 0.0)
    assert (decision.desired, decision.reason) == (4, "SignalMissing")
    # Scaling up never waits for a missing signal.
    assert decide(4, {"waiting_requests": [16.0] * 4}, ADAPTER_POLICY, ScalingState(), 0.0).desired == 8


def test_the_primary_signal_leads_ties_and_no_samples_is_no_decision() -> None:
    tie = [Reading("waiting_requests", 4, 8.0, 4, "ScaleUp"), Reading("adapter_demand", 1, 2.0, 4, "ScaleUp")]
    assert combine(2, tie)[1] == tie[0]
    assert combine(2, [Reading("adapter_demand", 1, None, 2, "NoMetrics")]) == (2, None, "NoMetrics")


def test_the_event_and_status_name_the_driving_signal_and_the_others() -> None:
    idep = parse(body(autoscaling={"signals": [{"metric": "adapter_demand"}, {"metric": "pool_pressure"}]}))
    samples = {"waiting_requests": [4.0, 4.0], "adapter_demand": [1.5, 1.5], "pool_pressure": []}
    decision = decide(2, samples, ADAPTER_POLICY, ScalingState(), 0.0)
    reason, message = scale_event(idep, decision)
    assert reason == SCALED_UP
    assert message == (
        "scaled Deployment llama3-8b-engine from 2 to 3 replicas (ScaleUp; adapter_demand 1.5 per ready pod, "
        "target 1); also waiting_requests 4 (target 4), pool_pressure no samples (target 0.9)"
    )
    status = decision_status(idep, dataclasses.replace(decision, unplaced_adapters=4))
    assert {k: status[k] for k in ("metric", "target", "reason", "value", "unplacedAdapters")} == {
        "metric": "adapter_demand",
        "target": 1.0,
        "reason": "ScaleUp",
        "value": 1.5,
        "unplacedAdapters": 4,
    }
    assert status["signals"][2] == {
        "metric": "pool_pressure",
        "target": 0.9,
        "recommendation": 2,
        "reason": "NoMetrics",
    }


def test_every_signal_has_a_meaning_and_the_fraction_ones_default_below_1() -> None:
    for signal in SIGNALS.values():
        assert signal.meaning and signal.default_target > 0
        assert not signal.fraction or signal.default_target <= 1
    assert [s for s, signal in SIGNALS.items() if signal.hpa_metric is None] == ["adapter_demand"]


def test_scrape_headers_are_the_internal_token_both_ways() -> None:
    assert scrape_headers("") == {}
    assert scrape_headers("t0k") == {"Authorization": "Bearer t0k", wire.INTERNAL_TOKEN_HEADER: "t0k"}


def test_scrape_sends_the_token_and_names_pods_that_refuse_it() -> None:
    """Two engines behind the token (one with another token) and one that is down."""
    seen: list[dict[str, Any]] = []

    def engine(token: str) -> aiohttp.web.Application:
        async def metrics(request: aiohttp.web.Request) -> aiohttp.web.Response:
            seen.append(dict(request.headers))
            if request.headers.get("Authorization") != f"Bearer {token}":
                return aiohttp.web.Response(status=401)
            return aiohttp.web.Response(text=engine_text(waiting=3))

        app = aiohttp.web.Application()
        app.router.add_get("/metrics", metrics)
        return app

    async def run() -> Any:
        runners = []
        urls = []
        for token in ("secret", "other"):
            runner = aiohttp.web.AppRunner(engine(token))
            await runner.setup()
            site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            runners.append(runner)
            urls.append(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")  # type: ignore[union-attr]
        targets = [PodTarget("a", urls[0]), PodTarget("b", urls[1]), PodTarget("c", "http://127.0.0.1:1")]
        try:
            async with aiohttp.ClientSession() as session:
                return await scrape_pods(session, targets, 2.0, "secret")
        finally:
            for runner in runners:
                await runner.cleanup()

    scraped = asyncio.run(run())
    assert list(scraped.samples) == ["a"]
    assert [s.value for s in scraped.samples["a"] if s.name == "loraplex_requests_waiting"] == [3.0]
    assert len(scraped.refused) == 1 and scraped.refused[0].startswith("http://127.0.0.1:")
    assert all(h[wire.INTERNAL_TOKEN_HEADER] == "secret" for h in seen)

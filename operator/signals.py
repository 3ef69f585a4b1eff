"""What the autoscaler can scale on, and how each signal is read from an engine pod's /metrics samples.

Beside the queue (`waiting_requests`, `running_requests`) and the pool (`pool_utilization`), the signals
here measure what adapter placement needs (docs/operator.md, Autoscaling):

- `pool_pressure`: the fraction of the device pool held by KV pages and adapters, that is neither free
  nor the prefix cache (which is dropped at no cost when something needs the pages);
- `adapter_loads_per_second`, `adapter_evictions_per_second`: copies into and out of the pool per second,
  the rate of the engine's counters between two scrapes (thrash: more adapters in demand than pools hold);
- `adapter_demand`: adapters with requests in flight (running or waiting, from the model-server
  protocol's `vllm:lora_requests_info`) per adapter slot (`max_lora`). Above 1 some adapter wants a
  slot its pod does not have; summed over pods, the demand beyond every pod's slots is the number of
  adapters no pod has room for (`unplaced_adapters`).

Pure functions of parsed samples, a clock reading and the previous period's counters: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from loraplex.operator.metrics import Sample, sum_of


@dataclass(frozen=True)
class Signal:
    name: str
    default_target: float  # per pod, when a signal is listed without one
    fraction: bool  # its value and target are fractions 0..1
    # The per-pod metric an HPA reads through a Prometheus adapter (docs/operator.md gives the rules);
    # None: only the builtin autoscaler computes it (PromQL cannot count names in a label list).
    hpa_metric: str | None
    meaning: str


SIGNALS: dict[str, Signal] = {
    signal.name: signal
    for signal in (
        Signal("waiting_requests", 4.0, False, "loraplex_requests_waiting", "requests not yet scheduled"),
        Signal("running_requests", 8.0, False, "loraplex_requests_running", "requests in the running batch"),
        Signal("pool_utilization", 0.9, True, "loraplex_pool_utilization", "pool pages not free"),
        Signal("pool_pressure", 0.9, True, "loraplex_pool_pressure", "pool pages held by KV and adapters"),
        Signal(
            "adapter_demand", 1.0, False, None, "adapters with requests in flight per adapter slot (max_lora)"
        ),
        Signal(
            "adapter_loads_per_second",
            1.0,
            False,
            "loraplex_adapter_loads_per_second",
            "adapter copies into the pool per second",
        ),
        Signal(
            "adapter_evictions_per_second",
            1.0,
            False,
            "loraplex_adapter_evictions_per_second",
            "adapters evicted from the pool per second",
        ),
    )
}
# The counters behind the rate signals (prometheus-client appends _total to a Counter's name).
RATE_COUNTERS = {
    "adapter_loads_per_second": "loraplex_adapter_loads_total",
    "adapter_evictions_per_second": "loraplex_adapter_evictions_total",
}
LORA_INFO = "vllm:lora_requests_info"
MAX_GPU_LORA = "vllm:max_gpu_lora_adapters"

# Per pod: (time of the scrape, counter name -> running total), kept from one period to the next.
CounterMemory = Mapping[str, tuple[float, Mapping[str, float]]]


@dataclass(frozen=True)
class AdapterDemand:
    """One pod's adapters with requests in flight, and the slots it has for adapters at once."""

    demanded: int
    slots: int


def adapter_demand(samples: Sequence[Sample]) -> AdapterDemand | None:
    """From the newest `vllm:lora_requests_info` series (its value is its update time, and a server may
    keep older label sets): running ∪ waiting adapters, and `max_lora` (or `vllm:max_gpu_lora_adapters`)."""
    infos = [s for s in samples if s.name == LORA_INFO and math.isfinite(s.value)]
    if not infos:
        return None
    newest = max(infos, key=lambda s: s.value)
    names = set()
    for key in ("running_lora_adapters", "waiting_lora_adapters"):
        names |= {name.strip() for name in newest.labels.get(key, "").split(",") if name.strip()}
    try:
        slots = int(newest.labels.get("max_lora", ""))
    except ValueError:
        fallback = sum_of(samples, MAX_GPU_LORA)
        slots = int(fallback) if fallback is not None else 0
    if slots <= 0:
        return None  # no slots reported: demand per slot means nothing
    return AdapterDemand(demanded=len(names), slots=slots)


def pool_pressure(samples: Sequence[Sample]) -> float | None:
    """Pages neither free nor the prefix cache's, over all pages (`loraplex_pool_pages{kind}`)."""
    total = sum_of(samples, "loraplex_pool_pages_total")
    free = sum_of(samples, "loraplex_pool_pages", kind="free")
    if not total or free is None:
        return None
    prefix = sum_of(samples, "loraplex_pool_pages", kind="prefix") or 0.0
    return max(0.0, min(1.0, (total - free - prefix) / total))


def instant_value(signal: str, samples: Sequence[Sample]) -> float | None:
    """A pod's value of a signal read from one scrape (every signal but the rates)."""
    if signal == "waiting_requests":
        return sum_of(samples, "loraplex_requests_waiting")
    if signal == "running_requests":
        return sum_of(samples, "loraplex_requests_running")
    if signal == "pool_utilization":
        return sum_of(samples, "loraplex_pool_utilization")
    if signal == "pool_pressure":
        return pool_pressure(samples)
    if signal == "adapter_demand":
        demand = adapter_demand(samples)
        return None if demand is None else demand.demanded / demand.slots
    raise ValueError(f"{signal!r} is not a signal read from one scrape; use one of {sorted(SIGNALS)}")


def rate(previous: tuple[float, float] | None, now: float, value: float) -> float | None:
    """Increase per second since `previous` (time, total); a counter that went down restarted from 0
    (Prometheus' rule). None for a first reading or no time passed."""
    if previous is None:
        return None
    then, before = previous
    if now <= then:
        return None
    increase = value - before if value >= before else value
    return increase / (now - then)


def counters(samples: Sequence[Sample]) -> dict[str, float]:
    """The running totals the rate signals need, as this scrape read them."""
    found = {}
    for name in RATE_COUNTERS.values():
        value = sum_of(samples, name)
        if value is not None:
            found[name] = value
    return found


def read_signals(
    signals: Sequence[str],
    scraped: Mapping[str, Sequence[Sample]],
    memory: CounterMemory,
    now: float,
) -> tuple[dict[str, list[float]], dict[str, tuple[float, Mapping[str, float]]]]:
    """Per signal, one value per pod that gave one (the autoscaler treats the others as silent); and the
    counters to remember for the next period (pods gone since are forgotten)."""
    values: dict[str, list[float]] = {signal: [] for signal in signals}
    remembered: dict[str, tuple[float, Mapping[str, float]]] = {}
    for pod, samples in scraped.items():
        totals = counters(samples)
        remembered[pod] = (now, totals)
        then, before = memory.get(pod, (now, {}))
        for signal in signals:
            counter = RATE_COUNTERS.get(signal)
            if counter is None:
                value = instant_value(signal, samples)
            elif counter in totals and counter in before:
                value = rate((then, before[counter]), now, totals[counter])
            else:
                value = None
            if value is not None and math.isfinite(value):
                values[signal].append(value)
    return values, remembered


def unplaced_adapters(scraped: Mapping[str, Sequence[Sample]]) -> int | None:
    """Adapters in demand beyond every reporting pod's slots together (placement spreads demand over the
    pods, so only what exceeds them all needs another pod); None when no pod reports adapter demand."""
    demands = [d for d in map(adapter_demand, scraped.values()) if d is not None]
    if not demands:
        return None
    return max(0, sum(d.demanded for d in demands) - sum(d.slots for d in demands))

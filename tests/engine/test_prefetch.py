"""An adapter's host copy starts loading when its request is added, so the read overlaps the steps that
run before the request joins, and the load that admits it is a host-cache hit."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from loraplex.adapters import AdapterManifest
from loraplex.engine import EngineConfig, LLMEngine, SamplingParams
from loraplex.engine.lora.sources import LoraWeights
from loraplex.engine.lora.synthetic import SyntheticAdapter

PARAMS = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
WAIT_S = 30.0


@dataclass
class GatedSource:
    """A source whose read starts (`reading` is set) and then blocks until the test opens `gate`."""

    inner: SyntheticAdapter
    reading: threading.Event = field(default_factory=threading.Event)
    gate: threading.Event = field(default_factory=threading.Event)
    threads: list[str] = field(default_factory=list)

    @property
    def manifest(self) -> AdapterManifest:
        return self.inner.manifest

    def load(self, dtype: torch.dtype) -> LoraWeights:
        self.threads.append(threading.current_thread().name)
        self.reading.set()
        if not self.gate.wait(WAIT_S):
            raise TimeoutError("the test never opened the gate")
        return self.inner.load(dtype)


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting until {what}")
        time.sleep(0.001)


def engine_with(source_of: Callable[[Any], GatedSource], **config: Any) -> tuple[LLMEngine, GatedSource]:
    engine = LLMEngine(EngineConfig(model="random:tiny", device="cpu", num_pages=64, **config))
    source = source_of(engine.loaded.config.lora_shape())
    engine.register_adapter("slow", source)
    return engine, source


def gated(base: Any) -> GatedSource:
    return GatedSource(SyntheticAdapter(base, seed=4, rank=4))


def finish(engine: LLMEngine) -> dict[str, Any]:
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return done


def test_the_read_overlaps_another_request_s_step_and_admission_is_a_host_cache_hit() -> None:
    engine, source = engine_with(gated, max_num_seqs=1)  # the adapter's request waits behind the first
    first = engine.add_request([1, 2, 3], PARAMS)
    engine.step()  # `first` runs: the engine is busy when the next request arrives
    second = engine.add_request([4, 5, 6], PARAMS, adapter="slow")
    assert source.reading.wait(WAIT_S), "the read did not start when the request was added"
    assert "slow" not in engine.loader.host

    real_execute, overlapped = engine.runner.execute, list[bool]()

    def execute(batch: Any) -> Any:
        if not overlapped:  # the first step after the arrival: `first` alone, while the read finishes
            assert [r.request_id for r in engine.scheduler.running] == [first]
            source.gate.set()
            wait_until(lambda: "slow" in engine.loader.host, "the prefetch finished")
            overlapped.append(True)
        return real_execute(batch)

    engine.runner.execute = execute
    done = finish(engine)
    assert overlapped and done[first].finish_reason == done[second].finish_reason == "length"
    stats = engine.stats()
    assert (stats.host_cache_hits, stats.host_cache_waits, stats.host_cache_misses) == (1, 0, 0)
    assert stats.adapter_loads == 1 and source.threads == ["adapter-prefetch_0"]


def test_a_request_arriving_at_an_idle_engine_starts_its_read_before_any_step() -> None:
    engine, source = engine_with(gated)
    request_id = engine.add_request([4, 5, 6], PARAMS, adapter="slow")
    assert source.reading.wait(WAIT_S), "the read did not start when the request was added"
    source.gate.set()
    wait_until(lambda: "slow" in engine.loader.host, "the prefetch finished")
    assert finish(engine)[request_id].finish_reason == "length"
    stats = engine.stats()
    assert (stats.host_cache_hits, stats.host_cache_misses) == (1, 0)

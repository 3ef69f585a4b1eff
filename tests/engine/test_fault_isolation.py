"""Fault isolation in LLMEngine.step on a tiny random model: one adapter's fault ends its own requests.

A forward that raises (or yields non-finite logits) is run again once; if it fails again the step's
adapters are bisected, the guilty ones are refused with the reason and only their requests end. A
failure no adapter explains is raised as StepError after the one retry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from loraplex.adapters import AdapterError, AdapterManifest
from loraplex.engine import EngineConfig, LLMEngine, SamplingParams
from loraplex.engine.engine import ADAPTER_FAILED, FailedOutput, RequestTooLarge, StepError
from loraplex.engine.lora.loader import check_finite
from loraplex.engine.lora.sources import LoraWeights
from loraplex.engine.lora.synthetic import SyntheticAdapter
from loraplex.engine.request import RequestOutput

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12], [13, 14]]


@dataclass(frozen=True)
class Filled:
    """A synthetic adapter's shapes with every weight set to `value`: 1e20 passes a finiteness check
    but overflows float32 inside the model; NaN does not pass it."""

    inner: SyntheticAdapter
    value: float

    @property
    def manifest(self) -> AdapterManifest:
        return self.inner.manifest

    def load(self, dtype: torch.dtype) -> LoraWeights:
        return {k: (a.fill_(self.value), b.fill_(self.value)) for k, (a, b) in self.inner.load(dtype).items()}


# The fault cases run with the plain loop and pipelined (async scheduling: a launch that raises lands the
# step in flight first; a non-finite step is seen only after its successor was launched, which is then
# rolled back).
BOTH_LOOPS = pytest.mark.parametrize("async_scheduling", ["off", "on"])


def tiny_engine(num_adapters: int = 6, **config: Any) -> LLMEngine:
    engine = LLMEngine(EngineConfig(model="random:tiny", device="cpu", num_pages=128, **config))
    base = engine.loaded.config.lora_shape()
    for i in range(num_adapters):
        engine.register_adapter(f"good{i}", SyntheticAdapter(base, seed=i, rank=4, strength=0.5))
    return engine


def run(engine: LLMEngine, requests: list[tuple[list[int], str | None]]) -> dict[str, RequestOutput]:
    """Queue all, step to the end; the finished outputs by request id (in queue order)."""
    ids = [engine.add_request(p, GREEDY, adapter=a) for p, a in requests]
    finished: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    return {i: finished[i] for i in ids}


def mixed(names: list[str | None]) -> list[tuple[list[int], str | None]]:
    return [(PROMPTS[i % len(PROMPTS)], name) for i, name in enumerate(names)]


def count_forwards(engine: LLMEngine) -> list[int]:
    real, calls = engine.runner.execute, [0]

    def execute(batch: Any) -> Any:
        calls[0] += 1
        return real(batch)

    engine.runner.execute = execute
    return calls


@BOTH_LOOPS
def test_an_overflowing_adapter_ends_only_its_own_requests(async_scheduling: str) -> None:
    engine = tiny_engine(async_scheduling=async_scheduling)
    innocent: list[str | None] = [None, "good0", "good1", "good2", "good3", "good4", "good5", None]
    reference = [o.token_ids for o in run(engine, mixed(innocent)).values()]

    base = engine.loaded.config.lora_shape()
    engine.register_adapter("huge", Filled(SyntheticAdapter(base, seed=99, rank=4), 1e20))
    calls = count_forwards(engine)
    outputs = list(run(engine, mixed([*innocent, "huge", "huge"])).values())

    assert [o.token_ids for o in outputs[:-2]] == reference
    assert all(o.finish_reason == "length" for o in outputs[:-2])
    for guilty in outputs[-2:]:
        assert isinstance(guilty, FailedOutput) and guilty.error_code == ADAPTER_FAILED
        assert guilty.finish_reason == "error" and "not finite" in (guilty.error or "")
    assert "not finite" in engine.registry.failed["huge"]
    assert "huge" not in engine.registry.resident_names()  # its pages went back at once
    # The retry and a bisection over 7 adapters, not one run per adapter: a handful of forwards more.
    steps_without_fault = GREEDY.max_tokens
    # Pipelined, the fault is seen after the next step was launched (wasted), and the faulty step runs
    # once more before its retry: two forwards more.
    pipelined = 2 if async_scheduling == "on" else 0
    assert calls[0] <= steps_without_fault + 2 + 2 * 3 + 1 + pipelined
    # Nothing it computed is left to poison a page another request gets next.
    assert bool(torch.isfinite(engine.cache.memory).all())
    assert engine.pool.pages_by_kind()["kv"] == 0
    with pytest.raises(ValueError, match="cannot be served"):
        engine.add_request([1, 2], GREEDY, adapter="huge")


def test_the_same_weights_stay_refused_and_other_weights_are_served() -> None:
    engine = tiny_engine(num_adapters=1)
    base = engine.loaded.config.lora_shape()
    bad = Filled(SyntheticAdapter(base, seed=5, rank=4), 1e20)
    engine.register_adapter("tenant", bad)
    run(engine, mixed(["tenant"]))
    reason = engine.registry.failed["tenant"]
    engine.register_adapter("tenant", bad)  # the same digest again: the same fault
    assert engine.registry.failed["tenant"] == reason
    engine.register_adapter("tenant", SyntheticAdapter(base, seed=6, rank=4))  # other weights
    assert "tenant" not in engine.registry.failed
    assert all(o.finish_reason == "length" for o in run(engine, mixed(["tenant", None])).values())


def test_nan_weights_are_refused_when_loaded_and_no_step_fails() -> None:
    engine = tiny_engine(num_adapters=2)
    base = engine.loaded.config.lora_shape()
    engine.register_adapter("nan", Filled(SyntheticAdapter(base, seed=7, rank=4), float("nan")))
    isolations: list[Exception] = []
    real_isolate = engine.guard.isolate

    def isolate(chunks: Any, error: Exception, outputs: Any) -> Any:
        isolations.append(error)
        return real_isolate(chunks, error, outputs)

    engine.guard.isolate = isolate  # type: ignore[method-assign]
    outputs = list(run(engine, mixed(["good0", "nan", None, "good1"])).values())
    broken = outputs[1]
    assert isinstance(broken, FailedOutput) and broken.error_code == ADAPTER_FAILED
    assert "NaN or infinite" in (broken.error or "")
    assert [o.finish_reason for o in outputs] == ["length", "error", "length", "length"]
    assert not isolations  # no retry, no bisection: nothing ever failed in a step
    resident_pages = sum(len(r.pages) for r in engine.loader.resident.values())
    assert engine.pool.pages_by_kind()["adapter"] == resident_pages


@BOTH_LOOPS
def test_a_transient_failure_is_retried_once_and_nothing_fails(async_scheduling: str) -> None:
    engine = tiny_engine(num_adapters=2, async_scheduling=async_scheduling)
    names: list[str | None] = [None, "good0", "good1"]
    reference = [o.token_ids for o in run(engine, mixed(names)).values()]
    real, failures = engine.runner.execute, [0]

    def flaky(batch: Any) -> Any:
        if failures[0] == 0:
            failures[0] += 1
            raise RuntimeError("a transient device error")
        return real(batch)

    engine.runner.execute = flaky
    assert [o.token_ids for o in run(engine, mixed(names)).values()] == reference
    assert failures[0] == 1 and not engine.registry.failed


@BOTH_LOOPS
def test_a_failure_no_adapter_explains_is_raised_after_one_retry(async_scheduling: str) -> None:
    engine = tiny_engine(num_adapters=2, async_scheduling=async_scheduling)
    attempts = [0]

    def broken(batch: Any) -> Any:
        attempts[0] += 1
        raise RuntimeError("the device is gone")

    engine.runner.execute = broken
    for prompt, adapter in mixed([None, None]):
        engine.add_request(prompt, GREEDY, adapter=adapter)
    with pytest.raises(StepError, match="the device is gone") as raised:
        engine.step()
    assert attempts[0] == 2  # the step and its one retry; with no adapter in it, no bisection
    assert raised.value.outputs == []
    assert not engine.registry.failed


def test_a_failure_every_adapter_shares_blames_none() -> None:
    """A failure of the whole batch whose parts each run fine alone is nobody's adapter's fault."""
    engine = tiny_engine(num_adapters=3)
    real = engine.runner.execute

    def fails_when_big(batch: Any) -> Any:
        if len(set(batch.token_adapters)) > 2:  # only the whole batch fails: no adapter is to blame
            raise RuntimeError("out of scratch memory")
        return real(batch)

    engine.runner.execute = fails_when_big
    for prompt, adapter in mixed([None, "good0", "good1", "good2"]):
        engine.add_request(prompt, GREEDY, adapter=adapter)
    with pytest.raises(StepError, match="out of scratch memory"):
        engine.step()
    assert not engine.registry.failed


def test_check_finite_sees_overflow_in_the_pool_dtype() -> None:
    fits = {(0, "q"): (torch.ones(2, 4), torch.full((4, 2), 1e5))}
    check_finite(fits)  # fine in float32
    half = {k: (a.half(), b.half()) for k, (a, b) in fits.items()}  # 1e5 > float16's 65504: inf
    with pytest.raises(AdapterError, match="lora_B of layer 0 q holds NaN or infinite values"):
        check_finite(half)


def test_a_request_that_fits_only_without_its_adapter_is_refused_up_front() -> None:
    engine = tiny_engine(num_adapters=1, page_size=16)
    adapter_pages = engine.registry.pages_of("good0")
    usable = engine.pool.num_pages - 1
    kv_tokens = (usable - adapter_pages + 1) * 16  # fits the pool alone, not beside the adapter
    params = SamplingParams(max_tokens=kv_tokens - 4, temperature=0.0)
    engine.add_request([1, 2, 3, 4], params)  # the base model: fine
    with pytest.raises(RequestTooLarge) as refused:
        engine.add_request([1, 2, 3, 4], params, adapter="good0")
    assert refused.value.param == "max_tokens" and f"adapter {adapter_pages} more" in str(refused.value)


@BOTH_LOOPS
def test_non_finite_logits_no_adapter_explains_end_only_their_own_requests(async_scheduling: str) -> None:
    """Rows of a batch do not mix, so a base-model request whose logits turn NaN ends alone."""
    engine = tiny_engine(num_adapters=1, async_scheduling=async_scheduling)
    healthy: list[tuple[list[int], str | None]] = [([6, 7, 8], None), ([9, 10, 11], "good0")]
    reference = [o.token_ids for o in run(engine, healthy).values()]
    poison_token = 500
    real = engine.runner.execute

    def poisoned(batch: Any) -> Any:
        logits = real(batch).clone()  # made in inference mode: a copy to write into
        last_tokens = batch.input_ids[batch.logits_indices]  # [S] the token each sampled row ends with
        logits[last_tokens == poison_token] = float("nan")
        return logits

    engine.runner.execute = poisoned
    outputs = list(run(engine, [([1, 2, poison_token], None), *healthy]).values())
    broken = outputs[0]
    assert isinstance(broken, FailedOutput) and broken.error_code == "engine_error"
    assert "non-finite logits" in (broken.error or "")
    assert [o.token_ids for o in outputs[1:]] == reference
    assert not engine.registry.failed
    assert bool(torch.isfinite(engine.cache.memory).all()) and engine.pool.pages_by_kind()["kv"] == 0


@dataclass
class Flaky:
    """A source whose store does not answer the first `outages` reads."""

    inner: SyntheticAdapter
    outages: int

    @property
    def manifest(self) -> AdapterManifest:
        return self.inner.manifest

    def load(self, dtype: torch.dtype) -> LoraWeights:
        if self.outages > 0:
            self.outages -= 1
            raise ConnectionError("the store did not answer")
        return self.inner.load(dtype)


def test_a_store_outage_is_not_the_adapter_s_fault_and_the_next_request_retries() -> None:
    engine = tiny_engine(num_adapters=0)
    base = engine.loaded.config.lora_shape()
    engine.register_adapter("remote", Flaky(SyntheticAdapter(base, seed=3, rank=4), outages=1))
    first = list(run(engine, mixed(["remote", None])).values())
    assert isinstance(first[0], FailedOutput) and first[0].error_code == "adapter_unavailable"
    assert "did not answer" in (first[0].error or "") and first[1].finish_reason == "length"
    info = engine.adapter("remote")
    assert info is not None and info.failed is None and not info.resident
    again = list(run(engine, mixed(["remote"])).values())
    assert again[0].finish_reason == "length"

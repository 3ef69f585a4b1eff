"""async_scheduling: the host work that needs none of a step's tokens (adapter prefetch for the queue)
runs after the step is launched and before its tokens are read; nothing else changes, so outputs,
finish reasons, aborts and stop strings are those of the plain loop."""

from __future__ import annotations

from typing import Any

import pytest

from loraplex.engine import EngineConfig, LLMEngine, SamplingParams
from loraplex.engine import sampler as sampler_module
from loraplex.engine.lora.synthetic import SyntheticAdapter


def make(smollm2: Any, async_scheduling: str) -> LLMEngine:
    # A small pool: adapters and KV compete.
    engine = LLMEngine(
        EngineConfig(
            device="cpu", dtype="float32", num_pages=18, page_size=16, max_num_seqs=4,
            max_batch_tokens=48, async_scheduling=async_scheduling,
        ),
        loaded=smollm2,
    )  # fmt: skip
    for i in range(3):
        engine.register_adapter(f"a{i}", SyntheticAdapter(engine.base_shape, seed=i, rank=8))
    return engine


def drive(engine: LLMEngine) -> tuple[list[tuple[str, list[int], str, str | None]], int]:
    preemptions = []
    preempt = engine.scheduler.preempt

    def counted(request: Any) -> Any:
        preemptions.append(request.request_id)
        return preempt(request)

    setattr(engine.scheduler, "preempt", counted)  # noqa: B010 (shadows the method)
    params = [
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=0.0, stop=("is Par",)),
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),  # aborted
    ]
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    ids = []
    for i in range(8):
        # The stop-string requests keep the plain chat prompt and the base model, so "is Par" comes.
        suffix = [] if i % 4 == 2 else list(range(200, 200 + 5 * i))
        adapter = [None, "a0", None, "a2"][i % 4]
        ids.append(engine.add_request([*prompt, *suffix], params[i % 4], adapter=adapter))
    finals: dict[str, Any] = {}
    steps = 0
    while engine.has_unfinished():
        steps += 1
        if steps == 4:
            engine.abort(ids[3])
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    del engine.scheduler.preempt
    rows = [(i, finals[i].token_ids, finals[i].text, finals[i].finish_reason) for i in ids if i in finals]
    return rows, len(preemptions)


def test_async_scheduling_changes_no_output(smollm2) -> None:
    plain, plain_preempted = drive(make(smollm2, "off"))
    overlapped, overlapped_preempted = drive(make(smollm2, "on"))
    assert overlapped == plain
    assert overlapped_preempted == plain_preempted
    reasons = {reason for *_, reason in plain}
    assert {"length", "stop"} <= reasons


@pytest.mark.parametrize("mode", ["off", "on"])
def test_prefetch_runs_while_the_step_is_on_the_device(smollm2, monkeypatch, mode: str) -> None:
    engine = make(smollm2, mode)
    events: list[str] = []
    execute, prefetch = engine.runner.execute, engine.loader.prefetch
    resolve = sampler_module.StepSample.resolve
    monkeypatch.setattr(engine.runner, "execute", lambda batch: (events.append("launch"), execute(batch))[1])
    monkeypatch.setattr(
        engine.loader, "prefetch", lambda names: (events.append("prefetch"), prefetch(names))[1]
    )
    monkeypatch.setattr(
        sampler_module.StepSample, "resolve", lambda self: (events.append("resolve"), resolve(self))[1]
    )
    engine.add_request([1, 2, 3, 4], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    engine.step()
    if mode == "on":
        assert events == ["launch", "prefetch", "resolve"]
    else:
        assert events == ["prefetch", "launch", "resolve"]

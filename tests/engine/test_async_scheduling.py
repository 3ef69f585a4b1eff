"""async_scheduling: step n+1 is planned and launched (its decodes read step n's sampled ids on the
device) before step n's tokens are read, and the host work that needs no token (adapter prefetch) runs
while both are queued; outputs, finish reasons, aborts, stop strings, preemptions and seeded draws are
those of the plain loop (the equality test fails if a pending id is not fed: the row would read 0).
"""

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
def test_step_n_plus_1_is_planned_and_launched_before_step_n_is_read(smollm2, monkeypatch, mode: str) -> None:
    """Pipelined, each call plans and launches the next step (its decode reads the previous step's
    sampled id on the device), prefetches, and only then reads the previous step's tokens (the sample
    made by the call before): outputs come one call later. Plain: plan, prefetch, launch, read."""
    from loraplex.engine import engine as engine_module
    from loraplex.engine import runner as runner_module  # where the engine samples

    engine = make(smollm2, mode)
    events: list[str] = []
    samples: list[Any] = []
    schedule, execute, prefetch = engine.scheduler.schedule, engine.runner.execute, engine.loader.prefetch
    resolve, sample_step = sampler_module.StepSample.resolve, runner_module.sample_step

    def sampled(*args: Any, **kwargs: Any) -> Any:
        samples.append(sample_step(*args, **kwargs))
        return samples[-1]

    def resolved(self: Any) -> Any:
        events.append(f"resolve {samples.index(self)}")
        return resolve(self)

    monkeypatch.setattr(engine.scheduler, "schedule", lambda: (events.append("schedule"), schedule())[1])
    monkeypatch.setattr(engine.runner, "execute", lambda batch: (events.append("launch"), execute(batch))[1])
    monkeypatch.setattr(
        engine.loader, "prefetch", lambda names: (events.append("prefetch"), prefetch(names))[1]
    )
    monkeypatch.setattr(runner_module, "sample_step", sampled)
    monkeypatch.setattr(sampler_module.StepSample, "resolve", resolved)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    request_id = engine.add_request([1, 2, 3, 4], params)
    calls = []
    while engine.has_unfinished():
        events.clear()
        outputs = engine.step()
        calls.append((list(events), [len(o.token_ids) for o in outputs]))
    if mode == "off":
        plain = ["schedule", "prefetch", "launch"]
        assert calls == [([*plain, f"resolve {i}"], [i + 1]) for i in range(3)]
        return
    assert calls == [
        (["schedule", "launch", "prefetch"], []),  # nothing read yet
        (["schedule", "launch", "prefetch", "resolve 0"], [1]),  # step 2 launched, then step 1 read
        (["schedule", "launch", "prefetch", "resolve 1"], [2]),
        (["schedule", "prefetch", "resolve 2"], [3]),  # ends by length: nothing more to launch
    ]
    assert request_id not in engine.request_ids(engine_module.RequestStatus.RUNNING)

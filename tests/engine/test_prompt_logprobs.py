"""Prompt logprobs (echo): each prompt token's logprob and alternatives equal transformers' on the same
SmolLM2 weights, however the prompt is computed (one chunk or many, beside other requests, pipelined, after a
prefix-cache hit it must not take, under preemption); and choices that share a prompt share its prefill."""

from __future__ import annotations

import pytest
import torch

from loraplex.engine import EngineConfig, LLMEngine, SamplingParams
from loraplex.engine.request import RequestOutput

PROMPT = "The quick brown fox jumps over the lazy dog because it wanted to see the other side of the hill."
TOP = 3


@pytest.fixture(scope="module")
def prompt_ids(smollm2) -> list[int]:
    ids = smollm2.tokenizer.encode(PROMPT)
    assert 20 <= len(ids) <= 40, len(ids)  # more than one page of 16, several chunks of 8
    return ids


@pytest.fixture(scope="module")
def reference(hf_smollm2, prompt_ids) -> torch.Tensor:
    """transformers' log-softmax at every prompt position [P, V] (row q scores token q + 1)."""
    with torch.inference_mode():
        logits = hf_smollm2(torch.tensor([prompt_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def engine_for(smollm2, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(device="cpu", dtype="float32", **overrides), loaded=smollm2)


def run(engine: LLMEngine, requests: dict[str, dict]) -> dict[str, RequestOutput]:
    """Add every request (name -> add_request kwargs) before the first step; their last outputs."""
    ids = {engine.add_request(**kwargs): name for name, kwargs in requests.items()}
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                done[ids[output.request_id]] = output
    return done


def assert_matches_reference(output: RequestOutput, prompt_ids: list[int], reference: torch.Tensor) -> None:
    scores = output.prompt_logprobs
    assert scores is not None and len(scores) == len(prompt_ids)
    assert scores[0] is None  # nothing comes before the first token
    for q in range(1, len(prompt_ids)):
        entry, expected = scores[q], reference[q - 1]
        assert entry is not None and entry.token_id == prompt_ids[q]
        assert entry.logprob == pytest.approx(float(expected[prompt_ids[q]]), abs=2e-4), q
        top = expected.topk(TOP)
        assert [t for t, _ in entry.top] == top.indices.tolist(), q
        assert [v for _, v in entry.top] == pytest.approx(top.values.tolist(), abs=2e-4)


def echo(ids: list[int], max_tokens: int = 1) -> dict:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return {"prompt": ids, "params": params, "prompt_logprobs": TOP}


@pytest.mark.parametrize(
    "config",
    [
        {},  # the whole prompt in one chunk
        {"max_batch_tokens": 8, "max_num_seqs": 4},  # chunked prefill: 8 tokens a step
        {"async_scheduling": "on", "max_batch_tokens": 8, "max_num_seqs": 4},  # pipelined, chunked
    ],
    ids=["one-chunk", "chunked", "pipelined"],
)
def test_prompt_logprobs_equal_transformers(smollm2, prompt_ids, reference, config) -> None:
    engine = engine_for(smollm2, **config)
    # Beside a request that does not ask: it gets none, and its tokens are what it draws alone.
    plain = {"prompt": prompt_ids[:9], "params": SamplingParams(max_tokens=6, temperature=0.0)}
    outputs = run(engine, {"echo": echo(prompt_ids), "plain": plain})
    assert_matches_reference(outputs["echo"], prompt_ids, reference)
    assert outputs["plain"].prompt_logprobs is None
    (alone,) = engine_for(smollm2).generate([prompt_ids[:9]], plain["params"])
    assert outputs["plain"].token_ids == alone.token_ids


def test_a_cached_prefix_is_not_taken_by_an_echo_request(smollm2, prompt_ids, reference) -> None:
    engine = engine_for(smollm2, page_size=16)
    first = run(engine, {"warm": {"prompt": prompt_ids, "params": SamplingParams(max_tokens=1)}})
    assert first["warm"].num_cached_tokens == 0
    again = run(engine, {"warm": {"prompt": prompt_ids, "params": SamplingParams(max_tokens=1)}})
    assert again["warm"].num_cached_tokens == 16  # the cache holds the prompt's first page
    scored = run(engine, {"echo": echo(prompt_ids)})["echo"]
    assert scored.num_cached_tokens == 0  # computed again, so every position is scored
    assert_matches_reference(scored, prompt_ids, reference)


def test_prompt_logprobs_survive_preemption(smollm2, prompt_ids, reference) -> None:
    # 6 pages of 8 tokens: the two requests (4 and 6 pages at their longest) cannot both grow, so the
    # later one, the echo, is preempted and its prompt computed again (scored once).
    engine = engine_for(smollm2, num_pages=7, page_size=8, max_batch_tokens=64, max_num_seqs=2)
    hog = {
        "prompt": prompt_ids[:5],
        "params": SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
    }
    preempted = []
    preempt = engine.scheduler.preempt
    engine.scheduler.preempt = lambda request: (preempted.append(request.request_id), preempt(request))[1]
    outputs = run(engine, {"hog": hog, "echo": echo(prompt_ids, max_tokens=20)})
    assert preempted and set(preempted) == {outputs["echo"].request_id}
    assert_matches_reference(outputs["echo"], prompt_ids, reference)
    assert engine.stats().pages["kv"] == 0


def test_choices_that_share_a_prompt_share_its_prefill(smollm2, prompt_ids) -> None:
    engine = engine_for(smollm2, page_size=16)
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=7)
    leader = engine.add_request(prompt_ids, params)
    followers = [engine.add_request(prompt_ids, params, shares_prompt_with=leader) for _ in range(2)]
    assert engine.stats().waiting == 3
    outputs: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        outputs.update((o.request_id, o) for o in engine.step() if o.finished)
    assert outputs[leader].num_cached_tokens == 0
    assert [outputs[f].num_cached_tokens for f in followers] == [16, 16]
    # The same seed draws the same tokens, computed from the cache or not.
    assert all(outputs[f].token_ids == outputs[leader].token_ids for f in followers)


def test_a_follower_of_an_aborted_request_still_runs(smollm2, prompt_ids) -> None:
    engine = engine_for(smollm2, page_size=16)
    leader = engine.add_request(prompt_ids, SamplingParams(max_tokens=2))
    follower = engine.add_request(prompt_ids, SamplingParams(max_tokens=2), shares_prompt_with=leader)
    engine.abort(leader)
    finished = [o for _ in range(10) for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == [follower] and not engine.has_unfinished()

"""Greedy outputs of our engine equal transformers' on the same SmolLM2 weights, token for token."""

from __future__ import annotations

import pytest
import torch

from loraplex.engine import EngineConfig, LLMEngine, SamplingParams
from tests.hf_reference import load_hf_smollm2, remembered

from .parity_prompts import parity_prompt_ids

NEW_TOKENS = 24
# One at a time (no batching, no preemption): short and long chat, French, the shortest plain, the longest
# (369 tokens) and Japanese.
ALONE = (0, 7, 9, 10, 16, 17)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prompts(smollm2) -> list[list[int]]:
    ids = parity_prompt_ids(smollm2.tokenizer)
    lengths = sorted(map(len, ids))
    assert len(ids) == 20 and 5 <= lengths[0] <= 8 and 350 <= lengths[-1] <= 400, lengths
    return ids


@pytest.fixture(scope="module")
def reference(prompts) -> list[dict]:
    """transformers, each prompt alone: greedy continuation and last-position logits (computed once per
    machine: tests/hf_reference.py `remembered`)."""

    def compute() -> list[dict]:
        hf_smollm2 = load_hf_smollm2()
        results = []
        with torch.inference_mode():
            for ids in prompts:
                input_ids = torch.tensor([ids])
                logits = hf_smollm2(input_ids).logits[0, -1].float()
                out = hf_smollm2.generate(
                    input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    max_new_tokens=NEW_TOKENS,
                    do_sample=False,
                    pad_token_id=2,
                )
                results.append({"tokens": out[0, len(ids) :].tolist(), "logits": logits})
        return results

    return remembered("parity-greedy", (prompts, NEW_TOKENS), compute)


def engine_for(smollm2, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(device="cpu", dtype="float32", **overrides), loaded=smollm2)


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours - theirs).abs().max() / theirs.abs().max())


def test_last_position_logits_match(smollm2, prompts, reference) -> None:
    engine = engine_for(smollm2)
    logits = engine.next_token_logits(prompts)
    for ours, ref in zip(logits, reference, strict=True):
        assert relative_error(ours, ref["logits"]) < 1e-4


def test_greedy_tokens_match_one_at_a_time(smollm2, prompts, reference) -> None:
    engine = engine_for(smollm2)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    for i in ALONE:
        (output,) = engine.generate([prompts[i]], params)
        assert output.token_ids == reference[i]["tokens"], i
    assert engine.pool.pages_by_kind()["kv"] == 0


def test_greedy_tokens_match_with_speculative_decoding(smollm2, prompts, reference) -> None:
    """Prompt-lookup drafts verified on the prefill path change no greedy token (issue 30)."""
    engine = engine_for(smollm2, speculative="ngram", num_speculative_tokens=4)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    outputs = engine.generate([prompts[i] for i in ALONE], params)
    for i, output in zip(ALONE, outputs, strict=True):
        assert output.token_ids == reference[i]["tokens"], i
    assert engine.stats().spec.drafts > 0  # type: ignore[union-attr]
    assert engine.pool.pages_by_kind()["kv"] == 0


def test_greedy_tokens_match_with_the_compiled_decode_step(smollm2, prompts, reference) -> None:
    """The compiled CPU decode step (issue 30, on by default for `serve` and `up`) changes no greedy token:
    all 20 prompts at once (the batch graph, shrinking buckets as requests end) and one alone (the graph
    of a batch of one)."""
    engine = engine_for(smollm2, compile_decode=True, max_num_seqs=20)
    step = engine.runner.compiled
    assert step is not None
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    outputs = engine.generate(prompts, params)
    for i, (output, ref) in enumerate(zip(outputs, reference, strict=True)):
        assert output.token_ids == ref["tokens"], i
    (alone,) = engine.generate([prompts[ALONE[0]]], params)
    assert alone.token_ids == reference[ALONE[0]]["tokens"]
    assert step.steps >= NEW_TOKENS and step.fallbacks == 0  # the decode steps really were the compiled ones


def test_greedy_tokens_match_concurrently_under_preemption(smollm2, prompts, reference) -> None:
    # The longest prompt plus its output needs 25 pages of 16; 40 pages cannot hold all 20 requests,
    # and a 96-token step budget forces chunked prefill of every longer prompt.
    engine = engine_for(smollm2, num_pages=40, page_size=16, max_batch_tokens=96, max_num_seqs=20)
    preemptions = 0
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    ids = [engine.add_request(p, params) for p in prompts]
    requests = {i: engine._requests[i] for i in ids}
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    preemptions = sum(r.num_preemptions for r in requests.values())
    assert preemptions > 0, "the pool was meant to be small enough to force preemption"
    for request_id, ref in zip(ids, reference, strict=True):
        assert finished[request_id].token_ids == ref["tokens"], request_id
    assert engine.pool.pages_by_kind()["kv"] == 0


def test_concurrent_logits_match(smollm2, prompts, reference) -> None:
    engine = engine_for(smollm2, num_pages=64, max_batch_tokens=128)
    logits = engine.next_token_logits(prompts)
    for ours, ref in zip(logits, reference, strict=True):
        assert relative_error(ours, ref["logits"]) < 1e-4

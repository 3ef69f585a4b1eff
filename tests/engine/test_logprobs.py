"""Log-probabilities of generated tokens: the model's own distribution, whatever the sampling."""

from __future__ import annotations

import pytest
import torch

from loraplex.engine import EngineConfig, LLMEngine, SamplingParams


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(model="random:tiny", device="cpu", num_pages=32))


def test_logprobs_are_the_models_log_softmax(engine: LLMEngine) -> None:
    prompt = [5, 9, 2, 7]
    logits = engine.next_token_logits([prompt])[0]
    expected = torch.log_softmax(logits.float(), -1)
    for params in (
        SamplingParams(max_tokens=3, temperature=0.0, logprobs=4),
        SamplingParams(max_tokens=3, temperature=1.7, top_k=3, seed=11, logprobs=4),
    ):
        out = engine.generate([prompt], params)[0]
        assert out.logprobs is not None and len(out.logprobs) == 3
        first = out.logprobs[0]
        assert first.token_id == out.token_ids[0]
        assert first.logprob == pytest.approx(float(expected[first.token_id]), abs=1e-4)
        top_ids = [t for t, _ in first.top]
        assert top_ids == expected.topk(4).indices.tolist()
        assert [lp for _, lp in first.top] == pytest.approx(expected.topk(4).values.tolist(), abs=1e-4)


def test_logprobs_zero_gives_the_chosen_token_only_and_none_gives_nothing(engine: LLMEngine) -> None:
    out = engine.generate([[3, 3, 3]], SamplingParams(max_tokens=2, temperature=0.0, logprobs=0))[0]
    assert out.logprobs is not None and [lp.top for lp in out.logprobs] == [[], []]
    plain = engine.generate([[3, 3, 3]], SamplingParams(max_tokens=2, temperature=0.0))[0]
    assert plain.logprobs is None


def test_logprobs_are_bounded() -> None:
    with pytest.raises(ValueError, match="logprobs must be between 0 and 20"):
        SamplingParams(logprobs=21)

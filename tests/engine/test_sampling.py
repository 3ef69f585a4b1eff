"""Sampling: greedy, temperature, top-k, top-p, seeds; and stop conditions through the engine."""

from __future__ import annotations

import pytest
import torch

from loraplex.engine import EngineConfig, LLMEngine, SamplingParams
from loraplex.engine.request import Request, SamplingState
from loraplex.engine.sampler import _filtered_probs, sample


def request(params: SamplingParams, seed: int = 0) -> Request:
    return Request("r", [1], params, 0, sampling=SamplingState(torch.Generator().manual_seed(seed)))


def test_greedy_takes_the_argmax() -> None:
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 1.0, 4.9]])
    params = SamplingParams(temperature=0.0)
    assert sample(logits, [request(params), request(params)]) == [1, 0]


def test_top_k_keeps_only_the_k_best() -> None:
    probs = _filtered_probs(torch.tensor([1.0, 4.0, 3.0, 2.0]), temperature=1.0, top_k=2, top_p=1.0)
    assert probs[0] == 0 and probs[3] == 0
    assert probs[1] > probs[2] > 0
    assert float(probs.sum()) == pytest.approx(1.0)


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = _filtered_probs(logits, temperature=1.0, top_k=0, top_p=0.75)
    assert probs.tolist() == pytest.approx([0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0])
    # The best token always survives, however small p is.
    assert _filtered_probs(logits, 1.0, 0, 0.01).tolist() == pytest.approx([1.0, 0, 0, 0])


def test_temperature_sharpens_and_flattens() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0])
    cold = _filtered_probs(logits, 0.25, 0, 1.0)
    hot = _filtered_probs(logits, 4.0, 0, 1.0)
    assert cold[0] > 0.95 and hot[0] < 0.45


def test_sampling_follows_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    params = SamplingParams(temperature=1.0)
    r = request(params, seed=3)
    counts = torch.bincount(torch.tensor([sample(logits, [r])[0] for _ in range(4000)]), minlength=3)
    assert (counts / 4000 - torch.tensor([0.7, 0.2, 0.1])).abs().max() < 0.03


def test_invalid_params_are_refused() -> None:
    for bad in ({"max_tokens": 0}, {"temperature": -1}, {"top_p": 0}, {"top_k": -2}, {"stop": ("",)}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def engine(smollm2) -> LLMEngine:
    return LLMEngine(EngineConfig(device="cpu", dtype="float32"), loaded=smollm2)


def test_same_seed_same_text_different_seed_different_text(engine: LLMEngine) -> None:
    params = [SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=s) for s in (11, 11, 12)]
    # Run concurrently and alone: a request's seed alone decides its sample, whatever runs beside it.
    together = engine.generate(["The weather today is"] * 3, params)
    alone = engine.generate(["The weather today is"], params[0])[0]
    assert together[0].token_ids == together[1].token_ids == alone.token_ids
    assert together[0].token_ids != together[2].token_ids


def test_max_tokens_stops_with_length(engine: LLMEngine) -> None:
    out = engine.generate(["Count: one, two,"], SamplingParams(max_tokens=5, temperature=0.0))[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_eos_stops_and_ignore_eos_goes_on(engine: LLMEngine) -> None:
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    stopped = engine.generate([ids], SamplingParams(max_tokens=40, temperature=0.0))[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids[-1] == 2
    assert stopped.text == "The capital of France is Paris."
    forced = engine.generate(
        [ids], SamplingParams(max_tokens=len(stopped.token_ids) + 3, temperature=0.0, ignore_eos=True)
    )[0]
    assert forced.finish_reason == "length" and len(forced.token_ids) == len(stopped.token_ids) + 3


def test_stop_string_cuts_the_text(engine: LLMEngine) -> None:
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    out = engine.generate([ids], SamplingParams(max_tokens=40, temperature=0.0, stop=("France",)))[0]
    assert out.text == "The capital of " and out.finish_reason == "stop" and out.stop_reason == "France"
    kept = engine.generate(
        [ids],
        SamplingParams(max_tokens=40, temperature=0.0, stop=("France",), include_stop_str_in_output=True),
    )[0]
    assert kept.text == "The capital of France"


def test_stop_token_ids_stop(engine: LLMEngine) -> None:
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    paris = engine.tokenizer.encode(" Paris", add_special_tokens=False)[0]
    out = engine.generate([ids], SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=(paris,)))[0]
    assert out.token_ids[-1] == paris and out.finish_reason == "stop" and out.stop_reason == paris

"""Sampling: greedy, temperature, top-k, top-p, seeds; and stop conditions through the engine."""

from __future__ import annotations

import pytest
import torch

from loraplex.engine import EngineConfig, LLMEngine, SamplingParams
from loraplex.engine.request import Request, SamplingState
from loraplex.engine.sampler import filtered_probs, sample, sample_step, uniform


def request(params: SamplingParams, seed: int = 0, position: int = 0) -> Request:
    r = Request(f"r{seed}", [1], params, 0, sampling=SamplingState(torch.Generator().manual_seed(seed)))
    r.output_token_ids = [0] * position  # the output position the next token is drawn for
    return r


def test_greedy_takes_the_argmax_in_the_same_pass_as_sampled_rows() -> None:
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(1))
    greedy, hot = SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)
    rows = [request(greedy), request(hot, 1), request(SamplingParams(top_k=1)), request(hot, 2)]
    rows += [request(greedy), request(hot, 3)]
    tokens = sample(logits, rows)
    argmax = logits.argmax(-1).tolist()
    assert [tokens[i] for i in (0, 2, 4)] == [argmax[i] for i in (0, 2, 4)]
    assert sample(logits, [request(greedy)] * 6) == argmax


def test_top_k_keeps_only_the_k_best() -> None:
    probs = filtered_probs(torch.tensor([1.0, 4.0, 3.0, 2.0]), temperature=1.0, top_k=2, top_p=1.0)
    assert probs[0] == 0 and probs[3] == 0
    assert probs[1] > probs[2] > 0
    assert float(probs.sum()) == pytest.approx(1.0)


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = filtered_probs(logits, temperature=1.0, top_k=0, top_p=0.75)
    assert probs.tolist() == pytest.approx([0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0])
    # The best token always survives, however small p is.
    assert filtered_probs(logits, 1.0, 0, 0.01).tolist() == pytest.approx([1.0, 0, 0, 0])


def test_min_p_drops_tokens_below_a_share_of_the_best() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = filtered_probs(logits, 1.0, 0, 1.0, min_p=0.3)  # keeps p >= 0.15
    assert probs.tolist() == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0])


def test_temperature_sharpens_and_flattens() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0])
    cold = filtered_probs(logits, 0.25, 0, 1.0)
    hot = filtered_probs(logits, 4.0, 0, 1.0)
    assert cold[0] > 0.95 and hot[0] < 0.45


def reference_probs(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row, the plain way (the old per-row sampler's steps, with min-p after them)."""
    logits = row / params.temperature
    if 0 < params.top_k < logits.numel():
        kth = torch.sort(logits, descending=True).values[params.top_k - 1]
        logits = logits.masked_fill(logits < kth, -torch.inf)
    if params.top_p < 1.0:
        ordered = torch.sort(logits, descending=True).values
        before = 0.0
        for n, p in enumerate(ordered.softmax(-1).tolist()):
            if before >= params.top_p:
                logits = logits.masked_fill(logits < ordered[n - 1], -torch.inf)
                break
            before += p
    probs = logits.softmax(-1)
    return probs.masked_fill(probs < params.min_p * probs.max(), 0.0)


def test_batched_masks_equal_a_per_row_reference() -> None:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(48, 97, generator=gen) * 2
    choices = torch.rand(48, 4, generator=gen).tolist()
    params = [
        SamplingParams(
            temperature=0.3 + 1.7 * t,  # within limits.MAX_TEMPERATURE
            top_k=[0, 2, 7, 40, 500][int(k * 5)],
            top_p=[1.0, 0.9, 0.5, 0.05][int(p * 4)],
            min_p=[0.0, 0.05, 0.3][int(m * 3)],
        )
        for t, k, p, m in choices
    ]
    rows = [request(p, i) for i, p in enumerate(params)]
    step = sample_step(logits, rows)
    tokens = step.resolve()
    for i, p in enumerate(params):
        expected = reference_probs(logits[i], p)
        got = filtered_probs(logits[i], p.temperature, p.top_k, p.top_p, p.min_p)
        assert torch.equal(got == 0, expected == 0), i  # the same tokens dropped, exactly
        assert torch.allclose(got, expected / expected.sum(), atol=1e-6)
        assert expected[tokens[i]] > 0  # the drawn token is one the filters keep


def test_sampling_follows_the_distribution() -> None:
    """Chi-square over 6000 draws (one per seed) against the filtered distribution."""
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    logits = probs.log()[None].expand(6000, 6)
    for params, expected in (
        (SamplingParams(temperature=1.0), probs),
        (
            SamplingParams(temperature=1.0, top_k=4, top_p=0.75),
            torch.tensor([0.4, 0.25, 0.15, 0, 0, 0]) / 0.8,
        ),
    ):
        tokens = sample(logits, [request(params, seed) for seed in range(6000)])
        counts = torch.bincount(torch.tensor(tokens), minlength=6).double()
        kept = expected > 0
        assert counts[~kept].sum() == 0
        want = expected[kept].double() * 6000
        chi2 = float(((counts[kept] - want) ** 2 / want).sum())
        assert chi2 < 20.5  # the 99.9% point for 5 degrees of freedom (fewer here: stricter)


def test_uniforms_are_uniform_and_distinct_per_position() -> None:
    values = torch.tensor([uniform(seed, pos) for seed in range(100) for pos in range(100)])
    assert float(values.min()) >= 0.0 and float(values.max()) < 1.0
    assert values.unique().numel() > 9990  # 24 bits: a handful of collisions at most
    hist = torch.histc(values, bins=10, min=0.0, max=1.0)
    assert ((hist - 1000).abs() < 150).all()


def test_a_seed_draws_the_same_tokens_whatever_the_batch() -> None:
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(8, 300, generator=gen)
    mine = SamplingParams(temperature=0.9, top_p=0.95, seed=7)
    others = [SamplingParams(temperature=1.0 + i / 6, top_k=5 * i, min_p=0.01 * i) for i in range(7)]
    alone = [sample(logits[:1], [request(mine, 7, pos)])[0] for pos in range(20)]
    for pos in range(20):
        batch = [request(p, 100 + i, pos) for i, p in enumerate(others)]
        at = pos % 8  # my row moves through the batch; the others' rows take the other logits
        rows = [*batch[:at], request(mine, 7, pos), *batch[at:]]
        order = torch.cat([logits[1 : at + 1], logits[:1], logits[at + 1 :]])
        assert sample(order, rows)[at] == alone[pos]
    assert len(set(alone)) > 5  # and the positions draw different tokens


def test_logprobs_are_packed_with_the_tokens() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(2))
    rows = [
        request(SamplingParams(temperature=0.0, logprobs=3)),
        request(SamplingParams(temperature=1.5, top_k=4)),
        request(SamplingParams(temperature=1.5, top_k=4, logprobs=1), seed=4),
    ]
    step = sample_step(logits, rows)
    assert step.packed.shape == (3 + 2 * (1 + 3 + 3),)  # tokens, then 2 chosen + 2x3 values + 2x3 ids
    tokens = step.resolve()
    expected = torch.log_softmax(logits, -1)  # before temperature and top-k
    for i, k in ((0, 3), (2, 1)):
        (entry,) = rows[i].output.logprobs
        assert entry.token_id == tokens[i]
        assert entry.logprob == pytest.approx(float(expected[i, tokens[i]]), abs=1e-6)
        assert [t for t, _ in entry.top] == expected[i].topk(k).indices.tolist()
        assert [v for _, v in entry.top] == pytest.approx(expected[i].topk(k).values.tolist(), abs=1e-6)
    assert rows[1].output.logprobs == []
    assert step.tokens.dtype == torch.int64 and step.tokens.tolist() == tokens


def test_invalid_params_are_refused() -> None:
    bad_values = ({"max_tokens": 0}, {"temperature": -1}, {"top_p": 0}, {"top_k": -2}, {"stop": ("",)})
    for bad in (*bad_values, {"min_p": -0.1}, {"min_p": 1.5}, {"min_p": float("nan")}):
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


def test_sampling_reads_the_device_once_per_step() -> None:
    """sample_step only queues device work; resolve() is one host read, logprobs and all."""
    from loraplex.bench.dispatch import DispatchCounter

    logits = torch.randn(5, 64, generator=torch.Generator().manual_seed(6))
    rows = [
        request(SamplingParams(temperature=0.0, logprobs=2)),
        request(SamplingParams(temperature=0.7, top_k=8, top_p=0.9, min_p=0.02, logprobs=5), 1),
        request(SamplingParams(temperature=1.0), 2),
        request(SamplingParams(temperature=0.0), 3),
        request(SamplingParams(temperature=1.3, top_p=0.5), 4),
    ]
    with DispatchCounter() as queued:
        step = sample_step(logits, rows)
    assert queued.host_reads == [] and queued.launches > 0
    with DispatchCounter() as resolved:
        tokens = step.resolve()
    assert len(resolved.host_reads) == 1 and len(tokens) == 5
    assert all(len(r.output.logprobs) == 1 for r in rows if r.params.logprobs is not None)


def test_two_level_draw_is_the_inverse_cdf() -> None:
    """Across many blocks and a padded last one: the token a one-level inverse CDF picks (but for
    float rounding at a boundary), and never a masked token."""
    from loraplex.engine.sampler import draw

    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(2000, 1000, generator=gen) * 3
    logits[:, ::3] = -torch.inf  # masked tokens, in every block
    logits[:, 900:] = -torch.inf  # and whole blocks
    uniforms = torch.rand(2000, generator=gen)
    tokens = draw(logits, uniforms)
    cdf = logits.softmax(-1).double().cumsum(-1)
    want = torch.searchsorted(cdf, (uniforms.double() * cdf[:, -1])[:, None], right=True).view(-1)
    assert torch.isfinite(logits.gather(1, tokens[:, None])).all()
    assert (tokens == want).float().mean() > 0.995


def test_min_p_is_an_openai_extension_field() -> None:
    """Clients send min_p as an extra body field (as to vLLM); out of range it is a validation error."""
    from pydantic import ValidationError

    from loraplex.engine.server.protocol import ChatCompletionRequest, CompletionRequest

    assert CompletionRequest.model_validate({"model": "m", "prompt": "hi", "min_p": 0.1}).min_p == 0.1
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert ChatCompletionRequest.model_validate(chat).min_p is None
    for bad in (-0.1, 1.5):
        with pytest.raises(ValidationError, match="min_p"):
            CompletionRequest.model_validate({"model": "m", "prompt": "hi", "min_p": bad})


def test_rows_that_are_not_finite_do_not_break_the_step() -> None:
    """The engine learns of a non-finite row from the step's one copy, after sampling: sampling such a
    row must index nothing out of range, and the other rows draw what they draw without it."""
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(10))
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.01)
    alone = sample(logits[1:2], [request(params, 1)])
    logits[0] = torch.nan
    logits[2, 7] = torch.inf
    logits[3] = -torch.inf
    tokens = sample(logits, [request(params, seed) for seed in range(4)])
    assert all(0 <= t < 300 for t in tokens) and tokens[1] == alone[0]

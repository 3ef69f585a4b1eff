"""Prompt-lookup speculative decoding (engine/speculative.py): the proposer, the rejection sampler on a tiny
vocabulary, the scheduler's rollback and page accounting, and whole engines on a random tiny model (greedy
identity with and without speculation, under preemption, pipelined, with stops inside a draft)."""

from __future__ import annotations

import pytest
import torch

from loraplex.engine import EngineConfig, LLMEngine, SamplingParams
from loraplex.engine.pool import PageKind, PagePool
from loraplex.engine.request import Request
from loraplex.engine.sampler import greedy_accept, speculative_tokens
from loraplex.engine.scheduler import Scheduler
from loraplex.engine.speculative import NgramIndex, NgramProposer
from loraplex.wire.limits import LimitExceeded

# -- the proposer --------------------------------------------------------------------------------------


def _request(tokens: list[int], max_tokens: int = 64, **params: object) -> Request:
    return Request("r", tokens, SamplingParams(max_tokens=max_tokens, **params), 0)  # type: ignore[arg-type]


def test_the_longest_suffix_match_proposes_what_followed_its_latest_occurrence() -> None:
    proposer = NgramProposer(k=4, min_n=1, max_n=3)
    index = proposer.index()
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 2, 6, 7]
    # Suffix (6, 7) ... longest 3-gram (2, 6, 7) never occurred; (6, 7) last ended at 8 -> follows [2, 6, 7].
    assert proposer.propose(index, _request(tokens), 2) == [2, 6]
    # Past the end, the draft repeats with the match's period (3 here).
    assert proposer.propose(index, _request(tokens), 4) == [2, 6, 7, 2]


def test_no_match_no_draft_and_the_index_grows_with_the_tokens() -> None:
    proposer = NgramProposer(k=3, min_n=2, max_n=2)
    index = proposer.index()
    request = _request([1, 2, 3, 4])
    assert proposer.propose(index, request, 3) == []  # (3, 4) never occurred before
    request.output_token_ids += [1, 2]
    assert proposer.propose(index, request, 3) == [3, 4, 1]
    assert index.propose(6) == [3, 4, 1, 2, 3, 4]  # the proposer caps at its k (3), the index does not
    assert index.tokens == [1, 2, 3, 4, 1, 2]


def test_a_run_of_one_token_drafts_more_of_it() -> None:
    index = NgramIndex(1, 3)
    index.tokens = [9, 4, 4, 4]
    # (4, 4, 4) has no earlier end; (4, 4) ended at 3: one 4 after it, then the run goes on.
    assert index.propose(5) == [4] * 5


def test_proposer_arguments_are_checked() -> None:
    with pytest.raises(ValueError):
        NgramProposer(k=0)
    with pytest.raises(ValueError):
        NgramProposer(k=2, min_n=3, max_n=2)
    with pytest.raises(LimitExceeded):
        SamplingParams(num_speculative_tokens=33)
    with pytest.raises(ValueError):
        EngineConfig(model="random:tiny", speculative="ngram", prompt_lookup_min=4, prompt_lookup_max=3)


# -- the verification ------------------------------------------------------------------------------------


def test_greedy_accepts_the_longest_agreeing_prefix_then_the_argmax() -> None:
    best = torch.tensor([[3, 4, 5, 6], [3, 9, 5, 6], [1, 2, 3, 4], [7, 7, 7, 7]])
    draft = torch.tensor([[3, 4, 5], [3, 4, 5], [2, 2, 3], [7, -1, -1]])
    tokens, accepted = greedy_accept(best, draft)
    assert accepted.tolist() == [3, 1, 0, 1]
    assert tokens.tolist() == [6, 9, 1, 7]


def _tv(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - probs).abs().sum())


@pytest.mark.parametrize("draft_token", [0, 2, 4])
def test_rejection_sampling_emits_the_target_distribution(draft_token: int) -> None:
    """Two draft positions over a 5-token vocabulary, 40000 rows: the first emitted token follows p0
    whatever the draft, and after an accepted first token the next follows p1. Total variation within
    0.015 (sampling error ~0.005); accepting x always, or drawing the correction from p with x kept, is
    off by 0.1 or more."""
    generator = torch.Generator().manual_seed(7)
    rows, vocab = 40_000, 5
    p0 = torch.tensor([0.1, 0.35, 0.2, 0.05, 0.3])
    p1 = torch.tensor([0.5, 0.1, 0.1, 0.2, 0.1])
    bonus = torch.tensor([0.2, 0.2, 0.2, 0.2, 0.2])
    target = torch.stack([p0, p1, bonus]).log()[None].expand(rows, 3, vocab).contiguous()
    draft = torch.tensor([[draft_token, 0]]).expand(rows, 2).contiguous()
    accept_u = torch.rand(rows, 2, generator=generator)
    draw_u = torch.rand(rows, 3, generator=generator)
    tokens, accepted = speculative_tokens(target, draft, accept_u, draw_u, greedy=False)
    first = torch.where(accepted > 0, draft[:, 0], tokens)
    assert _tv(torch.bincount(first, minlength=vocab).float(), p0) < 0.015
    # Accepted first token: the emitted second one is draft[1] when held, else the correction/bonus.
    later = accepted >= 1
    second = torch.where(accepted[later] > 1, draft[later, 1], tokens[later])
    assert _tv(torch.bincount(second, minlength=vocab).float(), p1) < 0.015
    assert abs(float(later.float().mean()) - float(p0[draft_token])) < 0.01  # accepted with p0(x)


def test_a_wrong_sampler_fails_the_same_bound() -> None:
    """The bound above catches a correction drawn from p itself (x not removed)."""
    generator = torch.Generator().manual_seed(3)
    rows, vocab = 40_000, 5
    p0 = torch.tensor([0.1, 0.35, 0.2, 0.05, 0.3])
    accept_u = torch.rand(rows, generator=generator)
    drawn = torch.multinomial(p0, rows, replacement=True, generator=generator)
    wrong = torch.where(accept_u < p0[1], torch.tensor(1), drawn)
    assert _tv(torch.bincount(wrong, minlength=vocab).float(), p0) > 0.1


def test_a_filtered_out_draft_token_is_never_accepted() -> None:
    target = torch.tensor([[[0.0, float("-inf"), 1.0], [0.0, 0.0, 0.0]]]).expand(1000, 2, 3).contiguous()
    draft = torch.ones(1000, 1, dtype=torch.int64)
    tokens, accepted = speculative_tokens(
        target, draft, torch.rand(1000, 1), torch.rand(1000, 2), greedy=False
    )
    assert accepted.sum() == 0 and (tokens != 1).all()


# -- the scheduler -------------------------------------------------------------------------------------


def test_a_rejected_draft_gives_its_pages_back_and_commits_nothing_unverified() -> None:
    pool = PagePool(32)
    pool.allocate(1, "zero-page", PageKind.RESERVED)
    scheduler = Scheduler(pool, 4, 4, 64, proposer=NgramProposer(k=8))
    request = Request("r", [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(max_tokens=20), 0)
    scheduler.add(request)
    scheduler.postprocess(scheduler.schedule(), [3])  # prefill: 9 tokens, 8 computed
    plan = scheduler.schedule()
    (chunk,) = plan.chunks
    assert chunk.draft == (1, 2, 3, 1, 2, 3, 1, 2)  # after (1, 2, 3) ending at 6, repeating
    assert chunk.start == 8 and chunk.num_tokens == 9 and len(request.pages) == 5  # 17 tokens
    free_before = pool.pages_by_kind()["free"]
    scheduler.postprocess(plan, [9], accepted=[2])  # 1, 2 held, then 9
    assert request.output_token_ids == [3, 1, 2, 9]
    assert request.num_computed_tokens == 11 and request.num_tokens == 12
    assert len(request.pages) == 3 and pool.pages_by_kind()["free"] == free_before + 2
    assert scheduler.spec.drafts == 1 and scheduler.spec.accepted_tokens == 2
    # The next plan computes from the last verified token on.
    (chunk,) = scheduler.schedule().chunks
    assert chunk.start == 11


def test_drafts_respect_max_tokens_and_the_per_request_setting() -> None:
    pool = PagePool(64)
    pool.allocate(1, "zero-page", PageKind.RESERVED)
    scheduler = Scheduler(pool, 4, 4, 64, proposer=NgramProposer(k=8))
    short = Request("a", [1, 2] * 6, SamplingParams(max_tokens=4), 0)
    off = Request("b", [1, 2] * 6, SamplingParams(max_tokens=20, num_speculative_tokens=0), 1)
    two = Request("c", [1, 2] * 6, SamplingParams(max_tokens=20, num_speculative_tokens=2), 2)
    logprobs = Request("d", [1, 2] * 6, SamplingParams(max_tokens=20, logprobs=1), 3)
    for r in (short, off, two, logprobs):
        scheduler.add(r)
    scheduler.postprocess(scheduler.schedule(), [1, 1, 1, 1])
    drafts = {c.request.request_id: len(c.draft) for c in scheduler.schedule().chunks}
    assert drafts == {"a": 2, "b": 0, "c": 2, "d": 0}  # a: 1 generated, 1 verified + 2 = max_tokens


# -- whole engines (random tiny weights: greedy replies repeat themselves, which drafts feed on) ----------


def _engine(**overrides: object) -> LLMEngine:
    config = {"model": "random:tiny", "device": "cpu", "dtype": "float32", "num_pages": 64, **overrides}
    return LLMEngine(EngineConfig(**config))  # type: ignore[arg-type]


PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [11, 12, 13] * 4, list(range(20, 45)), [3] * 9]


@pytest.fixture(scope="module")
def plain() -> tuple[LLMEngine, list[list[int]]]:
    engine = _engine()
    outputs = engine.generate(PROMPTS, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    return engine, [o.token_ids for o in outputs]


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"num_speculative_tokens": 3, "prompt_lookup_min": 2},
        {"async_scheduling": "on"},
        {"num_pages": 12, "max_num_seqs": 4, "prefix_caching": False},  # preemptions with drafts
    ],
    ids=["k8", "k3-n2", "pipelined", "preempting"],
)
def test_greedy_replies_are_those_without_speculation(plain, overrides) -> None:
    _, expected = plain
    engine = _engine(speculative="ngram", **overrides)
    preempted: list[str] = []
    preempt = engine.scheduler.preempt

    def counted(request: Request) -> None:
        preempted.append(request.request_id)
        preempt(request)

    engine.scheduler.preempt = counted  # type: ignore[method-assign]
    outputs = engine.generate(PROMPTS, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outputs] == expected
    stats = engine.stats()
    assert stats.spec is not None and stats.spec.accepted_tokens > 0
    assert stats.pages.get("kv", 0) == 0  # every page of the finished requests went back (or to the cache)
    assert bool(preempted) == (overrides.get("num_pages") == 12)


def test_stops_inside_an_accepted_draft_cut_as_without_speculation(plain) -> None:
    base, expected = plain
    spec = _engine(speculative="ngram")
    # A stop token from the middle of each reply, and max_tokens that end mid-draft.
    for i, prompt in enumerate(PROMPTS[:2]):
        stop = expected[i][17]
        for params in (
            SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop_token_ids=(stop,)),
            SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True),
        ):
            want = base.generate([prompt], params)[0]
            got = spec.generate([prompt], params)[0]
            assert (got.token_ids, got.finish_reason, got.stop_reason) == (
                want.token_ids,
                want.finish_reason,
                want.stop_reason,
            )
    assert spec.stats().spec.accepted_tokens > 0  # type: ignore[union-attr]


def test_seeded_sampling_repeats_and_greedy_rows_beside_it_are_unchanged(plain) -> None:
    _, expected = plain
    spec = _engine(speculative="ngram")
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=24, temperature=0.7, top_k=8, seed=11, ignore_eos=True)
    first = spec.generate(PROMPTS + PROMPTS[:2], [greedy] * len(PROMPTS) + [sampled] * 2)
    again = spec.generate(PROMPTS[:2], [sampled] * 2)
    assert [o.token_ids for o in first[: len(PROMPTS)]] == expected
    assert [o.token_ids for o in first[len(PROMPTS) :]] == [o.token_ids for o in again]
    assert [len(o.token_ids) for o in again] == [24, 24]


def test_pages_a_draft_filled_are_cached_under_their_own_tokens() -> None:
    """Pages holding accepted draft tokens join the prefix cache keyed by those tokens: a prompt that
    repeats the first reply finds every full page of it."""
    engine = _engine(speculative="ngram", page_size=4)
    prompt = PROMPTS[1]
    first = engine.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))[0]
    assert engine.stats().spec.accepted_tokens > 8  # type: ignore[union-attr]
    follow = prompt + first.token_ids[:20]
    again = engine.generate([follow], SamplingParams(max_tokens=1, temperature=0.0))[0]
    assert again.num_cached_tokens == (len(follow) - 1) // 4 * 4


# -- what the server shows ------------------------------------------------------------------------------


def test_metrics_show_drafts_acceptance_and_tokens_per_step() -> None:
    from dataclasses import replace

    from loraplex.engine.server.metrics import ServerMetrics
    from loraplex.engine.speculative import SpecStats
    from loraplex.engine.stats import EngineStats

    metrics = ServerMetrics()
    pages = {"free": 6, "kv": 1, "adapter": 0, "reserved": 1}
    stats = EngineStats(8, pages, 0, 1, 3, 1, 0, 0, 2, 0, 0.5, 100, 1, 0, 1, spec=SpecStats(2, 8, 4))
    metrics.observe_engine(stats)
    metrics.observe_engine(replace(stats, spec=SpecStats(4, 16, 12)))
    value = metrics.registry.get_sample_value
    assert value("loraplex_spec_decode_drafts_total") == 4
    assert value("loraplex_spec_decode_draft_tokens_total") == 16
    assert value("loraplex_spec_decode_accepted_tokens_total") == 12
    assert value("loraplex_spec_decode_acceptance_rate") == 0.75
    assert value("loraplex_spec_decode_tokens_per_step") == 4.0  # (12 accepted + 4 sampled) / 4 rows


def test_the_request_body_field_is_bounded_and_reaches_the_sampling_params() -> None:
    from loraplex.engine.server.protocol import CompletionRequest

    body = CompletionRequest(model="m", prompt="x", num_speculative_tokens=0)
    assert body.sampling_params(4, None).num_speculative_tokens == 0
    assert CompletionRequest(model="m", prompt="x").sampling_params(4, None).num_speculative_tokens is None
    # The app answers a 400 naming the field (the LimitExceeded inside pydantic's error).
    with pytest.raises(ValueError, match="num_speculative_tokens must be between 0 and 32"):
        CompletionRequest(model="m", prompt="x", num_speculative_tokens=33)
    with pytest.raises(ValueError, match="num_speculative_tokens must be an integer"):
        CompletionRequest(model="m", prompt="x", num_speculative_tokens=True)

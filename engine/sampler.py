"""Next-token choice for a whole step at once, on the logits' own device.

One pass over the step's rows: the rows with penalties or a logit bias have their logits changed first
(engine/penalties.py; a step without such rows skips it), the rows with a grammar have the tokens it
forbids masked (engine/grammar.py; likewise), then greedy rows take the argmax; the others go
through temperature, top-k, top-p and min-p as masks over the batch, then inverse-CDF sampling with one
uniform number per row.
That number comes from a counter-based hash of (the request's seed, its output position), computed on
the host, so a request's tokens depend on its seed and nothing else: not on the rows beside it, their
order, the device, or how often it was preempted. Nothing here reads a device value until
`StepSample.resolve()`, which copies the step's token ids (with the asked-for logprob values packed in
the same tensor) to the host in one copy.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .grammar import mask_rows
from .penalties import PenaltyStore
from .request import Request, TokenLogprob

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """A 64-bit finaliser (Steele et al.'s SplitMix64): consecutive inputs give unrelated outputs."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform(seed: int, position: int) -> float:
    """The uniform number in [0, 1) that draws output token `position` of a request seeded `seed`:
    24 bits, so it is exact in float32 on every device."""
    return (_splitmix64(_splitmix64(seed & _MASK64) ^ position) >> 40) / float(1 << 24)


def request_seed(request: Request) -> int:
    """The seed a request draws with: its generator's (the engine seeds one per sampled request)."""
    generator = request.sampling.generator
    if generator is None:
        raise ValueError(f"request {request.request_id!r} samples but has no generator to seed it")
    return int(generator.initial_seed())


def filter_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    *,
    max_top_k: int,
    any_top_p: bool,
    any_min_p: bool,
) -> torch.Tensor:
    """Float32 logits [S, V] scaled by temperature [S], with the tokens that top-k [S] (0: none), top-p
    [S] and min-p [S] drop set to -inf, in that order (vLLM's). The host-known flags skip the passes no
    row needs (top-p sorts the vocabulary)."""
    logits = logits / temperature[:, None]
    vocab = logits.shape[-1]
    if max_top_k > 0:
        # Clamped while still float: converting a float past int64's range (top_k 2**63-1 reads 2**63 in
        # float32) is undefined and differs between a batch and a row alone; NaN reads as 0 (no limit).
        k = top_k.nan_to_num(0.0).clamp(min=0, max=vocab).long()  # [S]
        kth = logits.topk(min(max_top_k, vocab), dim=-1).values.gather(1, (k - 1).clamp(min=0)[:, None])
        kth = kth.masked_fill((k == 0)[:, None], float("-inf"))  # [S, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if any_top_p:
        ordered = logits.sort(dim=-1, descending=True).values
        probs = ordered.softmax(dim=-1)
        # Drop a token when the tokens before it already reach top_p; the first always stays.
        kept = ((probs.cumsum(dim=-1) - probs) < top_p[:, None]).sum(dim=-1, keepdim=True)  # [S, 1]
        # At least 1 (0 only in a row that is not finite, which the engine fails after this step's copy:
        # every index here stays in range, as a device-side assert would end the process).
        kept = kept.clamp(min=1)
        logits = logits.masked_fill(logits < ordered.gather(1, kept - 1), float("-inf"))
    if any_min_p:
        # p >= min_p * p_max is logit >= max_logit + log(min_p): no softmax needed.
        floor = logits.amax(dim=-1, keepdim=True) + min_p.clamp(min=1e-30).log()[:, None]
        floor = floor.masked_fill((min_p == 0)[:, None], float("-inf"))
        logits = logits.masked_fill(logits < floor, float("-inf"))
    return logits


BLOCK = 128  # vocabulary entries per block of the two-level inverse CDF


def draw(logits: torch.Tensor, uniforms: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Token ids [S] int64 from logits [S, V] (-inf: never) times scale [S] (1/temperature, when not
    applied yet) and uniforms [S] in [0, 1): the first token whose cumulative probability exceeds u
    (inverse CDF), one uniform per row. Two levels, so no pass writes a [S, V] cumulative sum: per-block
    sums find the block, then a cumulative sum over that block's BLOCK weights finds the token."""
    rows, vocab = logits.shape
    # softmax works row by row (a row stays in cache); masked tokens weigh exactly 0.
    weights = (logits if scale is None else logits * scale[:, None]).softmax(dim=-1)  # [S, V]
    blocks = -(-vocab // BLOCK)
    if blocks * BLOCK != vocab:
        weights = torch.nn.functional.pad(weights, (0, blocks * BLOCK - vocab))  # zero weight: never drawn
    tiles = weights.view(rows, blocks, BLOCK)
    block_cdf = tiles.sum(dim=-1).cumsum(dim=-1)  # [S, blocks]
    target = _below(uniforms[:, None] * block_cdf[:, -1:], block_cdf[:, -1:])  # [S, 1]
    block = torch.searchsorted(block_cdf, target, right=True).clamp(max=blocks - 1)  # [S, 1]
    before = block_cdf.gather(1, (block - 1).clamp(min=0)).masked_fill(block == 0, 0.0)
    inner = tiles.gather(1, block[:, :, None].expand(rows, 1, BLOCK)).view(rows, BLOCK).cumsum(dim=-1)
    offset = torch.searchsorted(inner, _below(target - before, inner[:, -1:]), right=True)
    return (block * BLOCK + offset.clamp(max=BLOCK - 1)).view(-1).clamp(max=vocab - 1)


def _below(value: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """value, kept strictly below total: the token found then has a weight above zero."""
    return torch.minimum(value, torch.nextafter(total, torch.zeros_like(total)))


@dataclass
class StepSample:
    """A step's sampled tokens, still on the device. `tokens` [S] int64 can feed the next step without a
    host sync; `resolve()` is the step's one device-to-host copy."""

    tokens: torch.Tensor  # [S] int64
    requests: Sequence[Request]
    logits: torch.Tensor  # [S, V], for the rows that keep theirs
    # Token ids, then per asking row its chosen logprob, then its top values and ids, as float64 [S + ...].
    packed: torch.Tensor
    logprob_rows: list[int] = field(default_factory=list)
    widest: int = 0
    logprob_counts: list[int] = field(default_factory=list)  # alternatives per asking row
    has_finite: bool = False  # the caller's per-row finite flags follow the token ids in `packed`
    has_accepted: bool = False  # then each row's accepted draft tokens (speculative decoding)
    _resolved: list[int] | None = None
    _values: list[float] | None = None

    def _copy(self) -> list[float]:
        if self._values is None:
            self._values = self.packed.tolist()  # the one device-to-host copy
        return self._values

    def wait(self) -> None:
        """Make the step's one copy now (resolve() reuses it): an error the device reports is raised
        here. Appends nothing to the requests."""
        self._copy()

    def finite(self) -> list[bool]:
        """Whether each row's logits were finite, from the same copy as the tokens (all True when
        sample_step was given no flags). Appends nothing to the requests: check it before resolve()."""
        size = len(self.requests)
        return [v != 0 for v in self._copy()[size : 2 * size]] if self.has_finite else [True] * size

    def accepted(self) -> list[int] | None:
        """How many of each row's draft tokens held (0 for a row without a draft); None: no row had one.
        From the same copy as the tokens."""
        if not self.has_accepted:
            return None
        size = len(self.requests)
        start = 2 * size if self.has_finite else size
        return [int(v) for v in self._copy()[start : start + size]]

    def resolve(self) -> list[int]:
        """The token ids as a list (one copy), with logprobs and kept logits appended to their requests."""
        if self._resolved is not None:
            return self._resolved
        values = self._copy()
        size = len(self.requests)
        tokens = [int(t) for t in values[:size]]
        rows, widest = self.logprob_rows, self.widest
        base = size * (1 + self.has_finite + self.has_accepted)
        chosen = values[base : base + len(rows)]
        top_values = values[base + len(rows) : base + len(rows) * (1 + widest)]
        top_ids = values[base + len(rows) * (1 + widest) :]
        for j, i in enumerate(rows):
            k = self.logprob_counts[j]
            start = j * widest
            top = [(int(top_ids[start + n]), top_values[start + n]) for n in range(k)]
            self.requests[i].output.logprobs.append(TokenLogprob(tokens[i], chosen[j], top))
        keep = [i for i, r in enumerate(self.requests) if r.sampling.keep_logits]
        if keep:  # next_token_logits only: not a serving path
            kept = self.logits[keep].cpu()
            for j, i in enumerate(keep):
                self.requests[i].sampling.last_logits = kept[j]
        self._resolved = tokens
        return tokens


def sample_step(
    logits: torch.Tensor,
    requests: Sequence[Request],
    finite: torch.Tensor | None = None,
    penalties: PenaltyStore | None = None,
    drafts: DraftLogits | None = None,
) -> StepSample:
    """Sample one token per row of logits [S, V]; row i belongs to requests[i]. Queues device work only.
    `finite` [S] bool (the engine's check of the logits) rides in the same copy: StepSample.finite().
    `penalties`: where the penalised requests' output tokens are kept between steps (the runner's; None:
    a store for this call alone, filled from the tokens the host knows). `drafts`: the step's speculative
    rows (`verify`): their token is the one after the draft tokens that held, whose count rides in the
    same copy too (StepSample.accepted())."""
    if logits.shape[0] != len(requests):
        raise ValueError(f"{logits.shape[0]} rows of logits for {len(requests)} requests")
    chooser = logits
    penalised = [i for i, r in enumerate(requests) if r.params.penalized]
    if penalised:
        store = penalties or PenaltyStore(logits.shape[-1], logits.device)
        chooser, recorded = store.apply(logits, requests, penalised)
    constrained = [i for i, r in enumerate(requests) if r.sampling.grammar is not None]
    if constrained:  # after penalties and bias: the grammar has the last word on what may come next
        chooser = mask_rows(chooser, requests, constrained)
    sampled = [i for i, r in enumerate(requests) if not r.params.greedy]
    # Greedy rows take the argmax; a step with none skips that pass.
    greedy = chooser.argmax(dim=-1) if not sampled or len(sampled) < len(requests) else None  # [S]
    tokens = _sample_rows(chooser, requests, sampled, greedy) if sampled else greedy
    assert tokens is not None
    accepted = None
    if drafts is not None and drafts.requests:
        tokens, accepted = _verify_rows(logits, requests, tokens, drafts)
    if penalised:
        recorded.record(tokens)
    rows = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
    # Read once, here: a count that is not an integer raises now, inside the engine's per-request fault
    # isolation, not in resolve(), which reads no parameter.
    counts = [operator.index(requests[i].params.logprobs or 0) for i in rows]
    widest = max(counts, default=0)
    parts = [tokens.double()]
    if finite is not None:
        parts.append(finite.double())
    if accepted is not None:
        parts.append(accepted.double())
    if rows:
        # The model's own distribution, before penalties, bias, temperature and filtering (vLLM's
        # raw_logprobs): the figure means the same whatever the sampling parameters were.
        index = torch.tensor(rows, device=logits.device)
        logp = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)  # [R, V]
        parts.append(logp.gather(1, tokens.index_select(0, index)[:, None]).view(-1).double())
        if widest:
            top = logp.topk(widest, dim=-1)
            parts += [top.values.reshape(-1).double(), top.indices.reshape(-1).double()]
    packed = torch.cat(parts) if len(parts) > 1 else parts[0]
    return StepSample(
        tokens, requests, logits, packed, rows, widest, counts, finite is not None, accepted is not None
    )


def _sample_rows(
    logits: torch.Tensor, requests: Sequence[Request], sampled: list[int], greedy: torch.Tensor | None
) -> torch.Tensor:
    """The step's tokens [S]: drawn for the `sampled` rows, greedy's [S] (None: no greedy row) for the
    others."""
    chosen = [requests[i] for i in sampled]
    params = [r.params for r in chosen]
    # One host-to-device copy for every per-row setting: [5, R] float32.
    settings = torch.tensor(
        [
            [p.temperature for p in params],
            [p.top_k for p in params],
            [p.top_p for p in params],
            [p.min_p for p in params],
            [uniform(request_seed(r), r.num_generated) for r in chosen],
        ],
        dtype=torch.float32,
    ).to(logits.device, non_blocking=True)
    rows = logits if greedy is None else logits.index_select(0, torch.tensor(sampled, device=logits.device))
    rows = rows.float()
    max_top_k = max(p.top_k for p in params)
    any_top_p = any(p.top_p < 1.0 for p in params)
    any_min_p = any(p.min_p > 0.0 for p in params)
    if max_top_k or any_top_p or any_min_p:
        filtered = filter_logits(
            rows,
            settings[0],
            settings[1],
            settings[2],
            settings[3],
            max_top_k=max_top_k,
            any_top_p=any_top_p,
            any_min_p=any_min_p,
        )
        drawn = draw(filtered, settings[4])
    else:  # temperature only (the default): folded into the draw's exp, no filtered copy
        unscaled = all(p.temperature == 1.0 for p in params)
        drawn = draw(rows, settings[4], scale=None if unscaled else settings[0].reciprocal())
    if greedy is None:
        return drawn
    return greedy.index_copy(0, torch.tensor(sampled, device=logits.device), drawn)


# The acceptance test of a draft token draws from its own stream: a request's draws stay a function of its
# seed and output positions (preemption and batch neighbours change nothing), and a row without a draft
# draws exactly as without speculation.
_ACCEPT_SALT = 0x5DEECE66D


@dataclass
class DraftLogits:
    """A step's speculative rows: each draft chunk's request (chunk order), its draft tokens, and the
    logits of its first len(draft) positions, concatenated [K, V] in that order (the chunk's last
    position is its ordinary sampled row). Position j's logits judge draft token j."""

    requests: list[Request]
    drafts: list[tuple[int, ...]]
    logits: torch.Tensor  # [K, V]

    @classmethod
    def none(cls, logits: torch.Tensor) -> DraftLogits:
        return cls([], [], logits[:0])


def speculative_tokens(
    target: torch.Tensor,
    draft: torch.Tensor,
    accept_u: torch.Tensor,
    draw_u: torch.Tensor,
    greedy: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify drafts: target [R, K + 1, V] the target's filtered float32 logits (temperature applied,
    -inf for what top-k/top-p/min-p drop) at each draft position and the one after, draft [R, K] int64
    (-1 past a row's draft), uniforms accept_u [R, K] and draw_u [R, K + 1] in [0, 1). Returns the
    tokens [R] that follow the accepted ones and the accepted counts [R].

    Greedy: accepted is the longest prefix the argmax repeats; the token is the argmax after it.
    Sampled (a deterministic draft, q one-hot): draft token x at position j is accepted when
    u < p_j(x); at the first rejection the token is drawn from p_j with x removed (normalize(max(p - q,
    0))), and when all are accepted from p_K: every emitted token follows the target distribution."""
    rows, width, _ = target.shape
    index = torch.arange(rows, device=target.device)
    if greedy:
        return greedy_accept(target.argmax(dim=-1), draft)
    probs = target[:, : width - 1].softmax(dim=-1)  # [R, K, V]
    p_x = probs.gather(-1, draft.clamp(min=0)[..., None]).squeeze(-1)  # [R, K]
    held = (accept_u < p_x) & (draft >= 0)
    accepted = held.long().cumprod(dim=-1).sum(dim=-1)  # [R]
    final = target[index, accepted]  # [R, V]
    padded = torch.cat([draft, draft.new_full((rows, 1), -1)], dim=1)
    rejected = padded[index, accepted]  # [R]: the draft token refused at that position, -1 for none
    removed = final.scatter(1, rejected.clamp(min=0)[:, None], float("-inf"))
    # p with x removed has no mass only where p(x) was 1, which is never refused: kept as is, not NaN.
    usable = (rejected >= 0) & torch.isfinite(removed).any(dim=-1)
    final = torch.where(usable[:, None], removed, final)
    return draw(final, draw_u[index, accepted]), accepted


def greedy_accept(best: torch.Tensor, draft: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification from the argmax best [R, K + 1] at each position and draft [R, K] (-1 past a
    row's draft): the token after the longest prefix the argmax repeats, and that prefix's length."""
    held = best[:, :-1] == draft
    accepted = held.long().cumprod(dim=-1).sum(dim=-1)
    return best[torch.arange(best.shape[0], device=best.device), accepted], accepted


def _verify_rows(
    logits: torch.Tensor, requests: Sequence[Request], tokens: torch.Tensor, drafts: DraftLogits
) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's tokens [S] with each speculative row's replaced by the token after its accepted draft
    tokens, and the accepted counts [S] (0 for rows without a draft)."""
    device = logits.device
    row_of = {id(r): i for i, r in enumerate(requests)}
    widest = max(len(d) for d in drafts.drafts)
    size = logits.shape[0]
    starts = [0]
    for d in drafts.drafts:
        starts.append(starts[-1] + len(d))
    accepted = torch.zeros(size, dtype=torch.int64, device=device)
    everything = torch.cat([logits, drafts.logits])  # [S + K, V]
    best: torch.Tensor | None = None
    for greedy in (True, False):
        members = [
            (j, row_of[id(r)])
            for j, r in enumerate(drafts.requests)
            if id(r) in row_of and r.params.greedy == greedy
        ]
        if not members:
            continue
        index, draft, accept_u, draw_u = [], [], [], []
        for j, row in members:
            own = drafts.drafts[j]
            picks = [size + starts[j] + n for n in range(len(own))]
            index.append(picks + [row] * (widest + 1 - len(own)))
            draft.append(list(own) + [-1] * (widest - len(own)))
            if not greedy:
                request = requests[row]
                seed, first = request_seed(request), request.num_generated
                accept_u.append([uniform(seed ^ _ACCEPT_SALT, first + n) for n in range(widest)])
                draw_u.append([uniform(seed, first + n) for n in range(widest + 1)])
        flat = torch.tensor(index, dtype=torch.int64).to(device, non_blocking=True)
        draft_t = torch.tensor(draft, dtype=torch.int64).to(device, non_blocking=True)
        rows = torch.tensor([row for _, row in members], dtype=torch.int64).to(device, non_blocking=True)
        if greedy:
            best = everything.argmax(dim=-1) if best is None else best  # [S + K]
            chosen, held = greedy_accept(best.index_select(0, flat.view(-1)).view(len(members), -1), draft_t)
        else:
            target = everything.index_select(0, flat.view(-1)).view(len(members), widest + 1, -1).float()
            params = [requests[row].params for _, row in members]
            repeat = widest + 1
            settings = torch.tensor(
                [
                    [p.temperature for p in params for _ in range(repeat)],
                    [p.top_k for p in params for _ in range(repeat)],
                    [p.top_p for p in params for _ in range(repeat)],
                    [p.min_p for p in params for _ in range(repeat)],
                ],
                dtype=torch.float32,
            ).to(device, non_blocking=True)
            filtered = filter_logits(
                target.view(len(members) * repeat, -1),
                settings[0],
                settings[1],
                settings[2],
                settings[3],
                max_top_k=max(p.top_k for p in params),
                any_top_p=any(p.top_p < 1.0 for p in params),
                any_min_p=any(p.min_p > 0.0 for p in params),
            ).view(len(members), repeat, -1)
            accept = torch.tensor(accept_u, dtype=torch.float32).to(device, non_blocking=True)
            uniforms = torch.tensor(draw_u, dtype=torch.float32).to(device, non_blocking=True)
            chosen, held = speculative_tokens(filtered, draft_t, accept, uniforms, greedy=False)
        tokens = tokens.index_copy(0, rows, chosen)
        accepted = accepted.index_copy(0, rows, held)
    return tokens, accepted


def sample(logits: torch.Tensor, requests: Sequence[Request]) -> list[int]:
    """The step's tokens as a list: `sample_step(...).resolve()`, for callers that need them at once."""
    return sample_step(logits, requests).resolve()


def filtered_probs(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float = 0.0
) -> torch.Tensor:
    """One row's sampling distribution [V] (for tests and tools; the engine never builds it)."""
    one = torch.ones(1)
    filtered = filter_logits(
        logits.float()[None],
        one * temperature,
        one * top_k,
        one * top_p,
        one * min_p,
        max_top_k=top_k,
        any_top_p=top_p < 1.0,
        any_min_p=min_p > 0.0,
    )
    return filtered.softmax(dim=-1)[0]


__all__ = [
    "DraftLogits",
    "StepSample",
    "draw",
    "filter_logits",
    "filtered_probs",
    "sample",
    "sample_step",
    "speculative_tokens",
    "uniform",
]

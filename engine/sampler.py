"""Next-token choice from logits: greedy, temperature, top-k, top-p, each request with its own RNG."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .request import Request, TokenLogprob


def sample(logits: torch.Tensor, requests: Sequence[Request]) -> list[int]:
    """One token per row of float32 logits [S, vocab]; row i belongs to requests[i]."""
    greedy = logits.argmax(dim=-1).tolist()
    tokens: list[int] = []
    for row, request in enumerate(requests):
        params = request.params
        if params.greedy:
            tokens.append(int(greedy[row]))
            continue
        probs = _filtered_probs(logits[row].float().cpu(), params.temperature, params.top_k, params.top_p)
        tokens.append(int(torch.multinomial(probs, 1, generator=request.sampling.generator).item()))
    return tokens


def _filtered_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the tokens before it already reach top_p; the first always stays.
        drop = (cumulative - sorted_logits.softmax(-1)) >= top_p
        logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits.softmax(-1)


def token_logprobs(logits: torch.Tensor, requests: Sequence[Request], tokens: Sequence[int]) -> None:
    """Append each sampled token's log-probability (and the top alternatives) to the requests that asked.

    Computed from the model's own distribution, before temperature and filtering, as vLLM does: the
    figure means the same whatever the sampling parameters were."""
    rows = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
    if not rows:
        return
    logp = torch.log_softmax(logits[rows].float(), dim=-1)
    widest = max(requests[i].params.logprobs or 0 for i in rows)
    top_values, top_ids = logp.topk(widest, dim=-1) if widest else (logp[:, :0], logp[:, :0].long())
    chosen = logp.gather(1, torch.tensor([[tokens[i]] for i in rows], device=logp.device))
    chosen_list, top_v, top_i = chosen[:, 0].tolist(), top_values.tolist(), top_ids.tolist()
    for j, i in enumerate(rows):
        k = requests[i].params.logprobs or 0
        top = list(zip(top_i[j][:k], top_v[j][:k], strict=True))
        requests[i].output.logprobs.append(TokenLogprob(int(tokens[i]), float(chosen_list[j]), top))

"""Prompt logprobs (OpenAI's `echo` with `logprobs`): how likely the model found each prompt token.

Position q's logits score token q + 1, so a prefill chunk [start, end) of a request that asks scores the
prompt tokens start + 1 .. min(end, P - 1) (P: the prompt's length) from the logits of its positions start
.. min(end, P - 1) - 1; the logits of position P - 1 are the sampled row, which scores no prompt token.
The batch returns those extra rows after the sampled ones (engine/batch.py's `scored`), and `PromptScores`
turns them into each token's logprob and top alternatives on the device, read back in one copy when the
step lands. The first prompt token has no logprob (nothing comes before it), as in OpenAI's answers.

Every position is written by index, so a step that runs again (a rollback, a preemption that recomputes
the prompt) writes the same values again; a request whose prompt is scored in full scores nothing more.
Positions a prefix-cache hit skips would never be computed, so such a request reads nothing from the
prefix cache (engine/prefix_cache.py): echo with logprobs costs its whole prefill.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .request import Request, TokenLogprob
from .scheduler import ScheduledChunk


def scored_rows(chunk: ScheduledChunk) -> int:
    """How many of the chunk's positions (its first ones) score a prompt token: 0 unless its request asks
    and is not scored in full yet."""
    request = chunk.request
    if request.prompt_logprobs is None or request.output.prompt_logprobs_done():
        return 0
    return max(0, min(chunk.end, len(request.prompt_token_ids) - 1) - chunk.start)


@dataclass
class PromptScores:
    """A step's prompt logprobs, still on the device: per scored row (in chunk order) the scored token's
    logprob, then per row its `widest` top values and ids, packed as float64 for one copy."""

    spans: list[tuple[Request, int, int, int]]  # (request, first scored position, rows, alternatives)
    widest: int
    packed: torch.Tensor | None

    @classmethod
    def none(cls) -> PromptScores:
        """A step that scores nothing (most steps): nothing to read or land."""
        return cls([], 0, None)

    @classmethod
    def queue(
        cls, logits: torch.Tensor, chunks: Sequence[ScheduledChunk], rows: Sequence[int]
    ) -> PromptScores:
        """Queue the scoring of logits [R, V], the scored rows of `chunks` (rows[i] of chunk i, its first
        ones, in chunk order; R = sum(rows)). Reads nothing on the host."""
        spans = [
            (c.request, c.start, n, c.request.prompt_logprobs or 0)
            for c, n in zip(chunks, rows, strict=True)
            if n
        ]
        if not spans:
            return cls.none()
        # The token each row scores: the prompt token after the row's position (on the host already).
        targets = [t for r, start, n, _ in spans for t in r.prompt_token_ids[start + 1 : start + 1 + n]]
        index = torch.tensor(targets, dtype=torch.int64).to(logits.device, non_blocking=True)
        logp = torch.log_softmax(logits.float(), dim=-1)  # [R, V]
        parts = [logp.gather(1, index[:, None]).view(-1).double()]  # [R]
        widest = max(k for *_, k in spans)
        if widest:
            top = logp.topk(widest, dim=-1)  # [R, widest]
            parts += [top.values.reshape(-1).double(), top.indices.reshape(-1).double()]
        return cls(spans, widest, torch.cat(parts))

    def land(self) -> None:
        """Copy the scores to the host (one copy) and write them into their requests' prompt logprobs."""
        if self.packed is None:
            return
        values = self.packed.tolist()
        total = sum(n for _, _, n, _ in self.spans)
        chosen, widest = values[:total], self.widest
        top_values = values[total : total * (1 + widest)]
        top_ids = values[total * (1 + widest) :]
        row = 0
        for request, start, n, k in self.spans:
            state, prompt = request.output, request.prompt_token_ids
            for q in range(start, start + n):
                first = row * widest
                top = [(int(top_ids[first + j]), top_values[first + j]) for j in range(k)]
                if state.prompt_logprobs[q + 1] is None:
                    state.prompt_scored += 1
                state.prompt_logprobs[q + 1] = TokenLogprob(prompt[q + 1], chosen[row], top)
                row += 1

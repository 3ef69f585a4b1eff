"""Prompt-lookup speculative decoding: drafts from the request's own tokens (plain Python, no torch).

A request that decodes (one known token left to compute, none pending) may be given a draft: the tokens
that followed the last earlier occurrence of its last n tokens (n from `max_n` down to `min_n`) in its
prompt and output so far, at most `k` of them (vLLM's ngram proposer; "prompt lookup decoding"). Its chunk
then computes 1 + k tokens, the last known one and the draft, like a short prefill chunk with its own
adapter, and the step verifies the draft against the target's logits at those positions (engine/sampler.py
`verify`): greedy rows keep the longest prefix the argmax agrees with, sampled rows accept each draft token
x with probability p(x) and on the first rejection draw from p with x removed; either way one more token
(the correction or the bonus) comes from the last verified position. The scheduler then shrinks the row
back to what was accepted (engine/scheduler.py `land`).

The lookup is an index per request from each n-gram to the end of its latest occurrence, extended as
tokens land (O(max_n) per token), never rebuilt: a request's known tokens only grow.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


class DraftRequest(Protocol):
    """What the proposer reads of a request (engine/request.py's Request is one)."""

    @property
    def num_known_tokens(self) -> int: ...

    def tokens(self, start: int, end: int) -> list[int]: ...


@dataclass
class NgramIndex:
    """Each n-gram (min_n <= n <= max_n) of a request's tokens [0, indexed) mapped to the end of its
    latest occurrence, and the tokens themselves (the continuation is read from them)."""

    min_n: int
    max_n: int
    tokens: list[int] = field(default_factory=list)
    latest: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed: int = 0  # n-grams ending at or before this are in `latest`
    matched: int = 0  # the length of the n-gram the last draft came from (0: none)
    limit: int = 0  # the request's draft length now (NgramProposer.verified; 0: not set yet, k)

    def extend(self, request: DraftRequest) -> None:
        """Take the request's tokens that landed since the last call."""
        known = request.num_known_tokens
        if known > len(self.tokens):
            self.tokens.extend(request.tokens(len(self.tokens), known))

    def index_upto(self, end: int) -> None:
        """Index every n-gram ending at or before `end` (exclusive end positions)."""
        tokens, latest = self.tokens, self.latest
        for stop in range(self.indexed + 1, end + 1):
            for n in range(self.min_n, min(self.max_n, stop) + 1):
                latest[tuple(tokens[stop - n : stop])] = stop
        self.indexed = max(self.indexed, end)

    def propose(self, k: int) -> list[int]:
        """k tokens that followed the latest earlier occurrence of the longest matching suffix (none
        when no suffix of min_n tokens or more occurred before)."""
        length = len(self.tokens)
        if k <= 0 or length < self.min_n + 1:
            return []
        # Only occurrences that end before the suffix does: the suffix itself is not an earlier one.
        self.index_upto(length - 1)
        tokens = self.tokens
        self.matched = 0
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            end = self.latest.get(tuple(tokens[length - n :]))
            if end is not None:
                self.matched = n
                # Past the end the draft goes on from itself: the text read as repeating with period
                # length - end (what a run or a repeated line does next).
                draft = tokens[end : min(end + k, length)]
                while len(draft) < k:
                    draft.append(draft[len(draft) - (length - end)])
                return draft
        return []


@dataclass(frozen=True)
class NgramProposer:
    """Drafts of at most `k` tokens from n-grams of `min_n` to `max_n` tokens (the engine's options)."""

    k: int
    min_n: int = 1
    max_n: int = 3

    def __post_init__(self) -> None:
        if self.k < 1 or not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"need k >= 1 and 1 <= min_n <= max_n, got {self.k}, {self.min_n}, {self.max_n}")

    def index(self) -> NgramIndex:
        return NgramIndex(self.min_n, self.max_n)

    def propose(self, index: NgramIndex, request: DraftRequest, k: int) -> list[int]:
        """A draft of at most min(k, self.k, index.limit) tokens for the request (empty: no match)."""
        index.extend(request)
        return index.propose(min(k, self.k, index.limit or self.k))

    def verified(self, index: NgramIndex, drafted: int, accepted: int) -> None:
        """Adapt the request's draft length to how its drafts fare (transformers' heuristic schedule for
        assisted generation): two more after a draft that held whole, one less after one that did not,
        between 1 and k. A reply that copies its input soon drafts k tokens at a time; where it departs
        from it, a refused draft costs few positions. Outputs do not depend on it (greedy ones are the
        same whatever the draft; sampled ones keep their distribution)."""
        limit = index.limit or self.k
        index.limit = min(self.k, limit + 2) if accepted >= drafted else max(1, limit - 1)


@dataclass
class SpecStats:
    """Counts since the engine started: rows verified (a draft in a step), draft tokens proposed and
    accepted, and tokens the verified rows emitted (accepted plus one each)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def emitted_tokens(self) -> int:
        return self.accepted_tokens + self.drafts

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens a verified row emits per step: 1 without speculation, up to k + 1 with."""
        return self.emitted_tokens / self.drafts if self.drafts else 0.0

"""A request's state as it moves through the engine: waiting → running → finished (or back, if preempted).

A `Request` is what the scheduler reasons about (tokens, pages, status, its adapter reference). What the
caller is shown (text, streamed deltas, logprobs, why it stopped) lives in its `OutputState`; how its
next token is drawn (its RNG, and the logits a caller asked to keep) in its `SamplingState`. The
scheduler never touches the latter, and none of it imports torch at run time.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .detokenizer import IncrementalDetokenizer
from .sampling_params import SamplingParams

if TYPE_CHECKING:  # the scheduler imports this module and must stay free of torch
    import torch

    from .grammar import Grammar
    from .speculative import NgramIndex


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model (before temperature and filtering), and
    the most likely alternatives at that position, most likely first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


# What a pending token's id reads as on the host until its step lands (a valid id: a row that is copied
# over anyway must not index outside the embedding table if anything ever read it first).
PENDING_TOKEN = 0


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class OutputState:
    """What the caller sees of a request: its text so far, how much of it was streamed, and why it ended."""

    prompt: str | None = None  # the prompt as text, when it was given as text
    detokenizer: IncrementalDetokenizer | None = None  # None: a model without a tokenizer (ids only)
    emitted_chars: int = 0  # text already handed out as deltas
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output token, when asked for
    error: str | None = None  # why the request finished with reason "error"
    # Echo: each prompt token's logprob given the tokens before it (engine/prompt_logprobs.py), by position;
    # None until scored (the first token is never: nothing comes before it). Empty: not asked for.
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    prompt_scored: int = 0  # prompt positions scored so far: all scored at len(prompt) - 1

    def prompt_logprobs_done(self) -> bool:
        return self.prompt_scored >= len(self.prompt_logprobs) - 1

    @property
    def text(self) -> str:
        return self.detokenizer.text if self.detokenizer else ""


@dataclass
class SamplingState:
    """How the request's tokens are drawn: its own RNG (None when greedy), its grammar (structured
    outputs; None: free text), and, for next_token_logits, the last step's logits row kept for the caller."""

    generator: torch.Generator | None = None
    grammar: Grammar | None = None
    keep_logits: bool = False
    last_logits: torch.Tensor | None = None


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int  # admission order; earlier requests keep their pages when the pool runs out
    adapter: str | None = None  # a registered adapter's name; None is the base model
    # Who asked (the gateway's tenant header; None: the one anonymous tenant) and that tenant's share of
    # a busy engine relative to others (the gateway's tenant weight header, default 1).
    tenant: str | None = None
    tenant_weight: float = 1.0
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose keys and values are in the cache
    # Tokens sampled by a step still in flight (async scheduling): they count as tokens, so the next
    # step can be planned to compute them, but their ids are on the device until that step lands.
    num_pending_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission (not computed)
    # Echo: score the prompt's tokens (their logprobs, with this many alternatives each); None: do not.
    # Such a request reads nothing from the prefix cache, whose pages it would have to compute anyway.
    prompt_logprobs: int | None = None
    pages: list[int] = field(default_factory=list)
    holds_adapter: bool = False  # admitted: holds a reference that keeps its adapter resident
    num_preemptions: int = 0
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    output: OutputState = field(default_factory=OutputState)
    sampling: SamplingState = field(default_factory=SamplingState)
    # Speculative decoding (engine/speculative.py): its n-gram index (made at its first draft), and the
    # draft tokens of a step launched and not landed yet (the scheduler plans nothing more for it).
    ngrams: NgramIndex | None = None
    draft_in_flight: int = 0

    @property
    def may_draft(self) -> bool:
        """Whether its decodes may carry drafts: not turned off (num_speculative_tokens 0), and nothing
        that reads each step's logits or changes them from its own history (logprobs, penalties, logit
        bias, a grammar, prompt scoring) is asked for: such rows decode one token per step."""
        params = self.params
        return (
            params.num_speculative_tokens != 0
            and params.logprobs is None
            and not params.penalized
            and params.structured is None
            and self.prompt_logprobs is None
        )

    @property
    def num_tokens(self) -> int:
        return self.num_known_tokens + self.num_pending_tokens

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids are on the host: all but the pending ones."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_generated(self) -> int:
        """Output tokens sampled so far, landed or pending: the next one's output position."""
        return len(self.output_token_ids) + self.num_pending_tokens

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without joining the two lists on every decode;
        a pending token reads as PENDING_TOKEN (the step that computes it copies its id on the device)."""
        known = self.num_known_tokens
        if end > known:
            return self.tokens(start, known) + [PENDING_TOKEN] * (end - max(start, known))
        prompt_len = len(self.prompt_token_ids)
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len : end - prompt_len]
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - prompt_len]

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass
class RequestOutput:
    """What the caller sees of a request after a step (or at the end of generate)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    new_text: str = ""
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None  # every output token's, when the request asked for them
    error: str | None = None  # finish_reason "error": what went wrong (e.g. its adapter failed to load)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache instead of computed
    # Echo: every prompt token's logprob (the first None), once the whole prompt is scored; else None.
    prompt_logprobs: list[TokenLogprob | None] | None = None

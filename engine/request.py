"""A request's state as it moves through the engine: waiting → running → finished (or back, if preempted)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .detokenizer import IncrementalDetokenizer
from .sampling_params import SamplingParams

if TYPE_CHECKING:  # the scheduler imports this module and must stay free of torch
    import torch


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model (before temperature and filtering), and
    the most likely alternatives at that position, most likely first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int  # admission order; earlier requests keep their pages when the pool runs out
    prompt: str | None = None
    adapter: str | None = None  # a registered adapter's name; None is the base model
    holds_adapter: bool = False  # the request holds a reference that keeps its adapter resident
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose keys and values are in the cache
    pages: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    num_preemptions: int = 0
    detokenizer: IncrementalDetokenizer | None = None
    generator: torch.Generator | None = None
    stop_reason: str | int | None = None
    emitted_chars: int = 0  # text already handed out as deltas
    keep_logits: bool = False
    last_logits: torch.Tensor | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output token, when asked for
    error: str | None = None  # why the request finished with reason "error"

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without joining the two lists on every decode."""
        prompt_len = len(self.prompt_token_ids)
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len : end - prompt_len]
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - prompt_len]

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def text(self) -> str:
        return self.detokenizer.text if self.detokenizer else ""


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

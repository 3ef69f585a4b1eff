"""A request's choices: its prompts times `n` (of `best_of` generated), as engine sequences and back.

OpenAI's layout, which vLLM follows: a completions request may carry several prompts; each gets `n` choices,
and choice `index = prompt_index * n + j`. With `best_of` > n, best_of sequences are generated per prompt and
the n with the highest cumulative logprob (the sum over their generated tokens, under the model's own
distribution) are returned, best first. Every sequence is its own engine request, all submitted together
(they batch); a prompt's later sequences wait in the engine for its first one's prefill and then start past
its pages in the prefix cache (LLMEngine.add_request's `shares_prompt_with`).

A seeded request stays reproducible: sequence j of a prompt draws with `seed + j` (vLLM's rule), wrapped
into the seed's range; the first draws with the seed itself, so n = 1 is what it always was.

`echo` prepends each prompt (as sent, or decoded from its token ids) to its choices' text; with `logprobs`
the prompt's tokens come first in the logprobs object, the first with null logprob and alternatives, as
OpenAI answers. With max_tokens 0 (`echo_only`) the engine still generates one token (it must sample to
finish the prefill, as vLLM does), which is dropped: the choice is the prompt alone, finish_reason "length",
and usage counts no completion token for it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from loraplex.wire import TenantRef, limits

from . import protocol

if TYPE_CHECKING:
    from loraplex.engine.request import RequestOutput, TokenLogprob
    from loraplex.engine.sampling_params import SamplingParams

    from .tools import ToolCalls


@dataclass(frozen=True)
class Prompt:
    """One prompt of a request, tokenized, with the parameters its sequences start from."""

    ids: list[int]
    params: SamplingParams  # the engine's max_tokens (1 for echo_only) and logprobs (for ranking too)
    echo_text: str = ""  # what echo prepends: the prompt as sent (decoded when sent as token ids)


@dataclass(frozen=True)
class Job:
    """One generation request, tokenized and resolved, ready for the engine."""

    chat: bool
    model: str  # echoed in responses: what the client asked for
    adapter: str | None  # engine adapter name; None: the base model
    prompts: list[Prompt]
    stream: bool
    include_usage: bool
    tenant: TenantRef  # with its share of a busy engine (the gateway's weight header)
    n: int = 1  # choices returned per prompt
    best_of: int = 1  # sequences generated per prompt, at least n
    logprobs: int | None = None  # what the client asked for: None reports none
    echo: bool = False
    echo_only: bool = False  # echo with max_tokens 0: the generated token is dropped
    tools: ToolCalls | None = None  # chat's tools offered: replies read back as tool calls (tools.py)
    adapter_sha256: str | None = None  # the digest the gateway routed it with: its rows run on no other

    @property
    def num_sequences(self) -> int:
        return len(self.prompts) * self.best_of

    def sequence_params(self, prompt: Prompt, copy: int) -> SamplingParams:
        """Sequence `copy` of `prompt`'s parameters: its own seed, when the request is seeded."""
        seed = prompt.params.seed
        if copy == 0 or seed is None:
            return prompt.params
        span = limits.MAX_SEED - limits.MIN_SEED + 1
        wrapped = (seed + copy - limits.MIN_SEED) % span + limits.MIN_SEED
        return dataclasses.replace(prompt.params, seed=wrapped)

    @property
    def prompt_logprobs(self) -> int | None:
        """What each sequence asks the engine to score of its prompt (echo with logprobs)."""
        return self.logprobs if self.echo and self.logprobs is not None else None


def cumulative_logprob(output: RequestOutput) -> float:
    """A sequence's rank for best_of: the sum of its generated tokens' logprobs."""
    return sum(entry.logprob for entry in output.logprobs or ())


def best_first(outputs: Sequence[RequestOutput], keep: int) -> list[int]:
    """The positions of the `keep` outputs of one prompt to return, highest cumulative logprob first
    (ties: the earlier sequence); all of them, in order, when nothing is to be dropped."""
    if keep >= len(outputs):
        return list(range(len(outputs)))
    ranked = sorted(range(len(outputs)), key=lambda i: (-cumulative_logprob(outputs[i]), i))
    return ranked[:keep]


class ChoiceText:
    """One sequence read as one choice: its echo prefix first, then its text and logprobs, whole or as
    stream deltas (each new output adds what came since the last)."""

    def __init__(self, job: Job, prompt: Prompt, index: int, text_of: Callable[[int], str]):
        self.job, self.prompt, self.index, self.text_of = job, prompt, index, text_of
        self.opened = False  # the echo prefix went out
        self.logprobs_sent = 0
        self.text_offset = 0

    def whole(self, output: RequestOutput) -> dict[str, Any]:
        text, logprobs = self._delta(output)
        build = protocol.chat_choice if self.job.chat else protocol.completion_choice
        choice = build(self.index, text, self.finish_reason(output), logprobs)
        return choice if self.job.tools is None else self.job.tools.reply(choice)

    def delta(self, output: RequestOutput) -> tuple[str, dict[str, Any] | None]:
        """The text and logprobs this output adds to the choice (the echo prefix with the first)."""
        return self._delta(output, output.new_text)

    def finish_reason(self, output: RequestOutput) -> str | None:
        return "length" if self.job.echo_only else output.finish_reason

    def _delta(self, output: RequestOutput, new_text: str | None = None) -> tuple[str, dict[str, Any] | None]:
        head, head_logprobs = self._open(output)
        if self.job.echo_only:
            return head, head_logprobs
        text = head + (output.text if new_text is None else new_text)
        if self.job.logprobs is None:
            return text, None
        fresh = (output.logprobs or [])[self.logprobs_sent :]
        self.logprobs_sent += len(fresh)
        if head_logprobs is None and not fresh:
            return text, None
        return text, self._join(head_logprobs, self._format(fresh))

    def _open(self, output: RequestOutput) -> tuple[str, dict[str, Any] | None]:
        """The echo prefix, once: the prompt's text and (with logprobs) its tokens' logprobs."""
        if self.opened or not self.job.echo:
            return "", None
        self.opened = True
        if self.job.logprobs is None:
            return self.prompt.echo_text, None
        scores = output.prompt_logprobs or []
        scored: list[TokenLogprob] = [e for e in scores[1:] if e is not None]
        body, self.text_offset = protocol.completion_logprobs(
            scored, self.text_of, self.text_offset, unscored=self.prompt.ids[:1]
        )
        return self.prompt.echo_text, body

    def _format(self, entries: list[TokenLogprob]) -> dict[str, Any] | None:
        if self.job.chat:
            return protocol.chat_logprobs(entries, self.text_of)
        body, self.text_offset = protocol.completion_logprobs(entries, self.text_of, self.text_offset)
        return body

    @staticmethod
    def _join(first: dict[str, Any] | None, second: dict[str, Any] | None) -> dict[str, Any] | None:
        """Two legacy logprobs objects as one, their lists end to end."""
        if first is None or second is None:
            return first or second
        return {key: first[key] + second[key] for key in first}


def usage(job: Job, outputs: Sequence[Sequence[RequestOutput]]) -> dict[str, Any]:
    """The request's usage from each prompt's final outputs (every sequence generated, best_of's dropped
    ones too: their tokens were computed): each prompt counted once, and its cached tokens as its first
    sequence found them; echo_only generates nothing the client sees, so no completion token."""
    prompt_tokens = sum(len(p.ids) for p in job.prompts)
    completion = 0 if job.echo_only else sum(len(o.token_ids) for group in outputs for o in group)
    cached = sum(group[0].num_cached_tokens for group in outputs if group)
    return protocol.usage(prompt_tokens, completion, cached)

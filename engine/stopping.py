"""When a request stops, and what of its text a stream may show: plain Python, no torch.

The scheduler calls `StopChecker.append` for every sampled token (its postprocess); the engine calls
`next_delta` when it builds the output a stream sees.
"""

from __future__ import annotations

from collections.abc import Iterable

from .request import Request


class StopChecker:
    """Appends sampled tokens to requests and says why a request ends: "stop" (an end-of-sequence
    token, a stop token id, a stop string) or "length" (max_tokens, or the model's context)."""

    def __init__(self, eos_token_ids: Iterable[int], max_model_len: int):
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len

    def append(self, request: Request, token: int) -> str | None:
        """Append `token` (detokenizing it unless it ends the sequence); the finish reason, if it ends."""
        params, output = request.params, request.output
        request.output_token_ids.append(token)
        grammar = request.sampling.grammar
        # The grammar follows the landed tokens only (never a pending one), so a preempted or rolled-back
        # request's grammar is where its output is. Its mask allowed this token: a refusal is a bug.
        if grammar is not None and not grammar.accept(token):
            output.error = f"token {token} broke the request's grammar"
            return "error"
        checked = len(output.text)
        eos = token in self.eos_token_ids
        if output.detokenizer is not None and not eos:
            output.detokenizer.add(token)
        if eos and not params.ignore_eos:
            return "stop"
        if grammar is not None and grammar.complete:  # the JSON ended (ignore_eos too: nothing may follow)
            return "stop"
        if token in params.stop_token_ids:
            output.stop_reason = token
            return "stop"
        if params.stop and output.detokenizer is not None and _hit_stop_string(request, checked):
            return "stop"
        if len(request.output_token_ids) >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return "length"
        return None

    def stops_by_length(self, request: Request) -> bool:
        """Whether the request ends by length once its sampled tokens (pending ones included) land:
        nothing more needs computing for it."""
        return request.num_generated >= request.params.max_tokens or request.num_tokens >= self.max_model_len


def _hit_stop_string(request: Request, checked_before: int) -> bool:
    """A stop string in the text added since `checked_before` (or straddling it): cut the text there."""
    output, stops = request.output, request.params.stop
    assert output.detokenizer is not None
    text = output.detokenizer.text
    longest = max(len(s) for s in stops)
    start = max(0, checked_before - longest + 1)
    hits = [(text.find(s, start), s) for s in stops]
    hits = [(i, s) for i, s in hits if i >= 0]
    if not hits:
        return False
    index, stop = min(hits)
    end = index + len(stop) if request.params.include_stop_str_in_output else index
    output.detokenizer.text = text[:end]
    output.stop_reason = stop
    return True


def next_delta(request: Request) -> str:
    """New text for a stream. While a stop string could still be completing, its possible start is
    held back, so a stream never shows text that the stop string later cuts."""
    output = request.output
    text = output.text
    visible = len(text)
    if not request.finished and request.params.stop:
        holdback = max(len(s) for s in request.params.stop) - 1
        visible = max(output.emitted_chars, visible - holdback)
    delta = text[output.emitted_chars : visible]
    output.emitted_chars = visible
    return delta

"""What one generation request may ask of an engine: the caps every tenant-controlled field is held to.

One tenant's request must not slow every other tenant's stream or take the replica down, so each
field whose cost grows with its size is bounded here, and a request over a bound is refused with a
4xx that names the field before any work is done. The gateway checks the same numbers before it
forwards a request (it imports this module), so a tenant meets the same limit on both hops.

Plain constants and pure functions over JSON-like values: no torch, no pydantic, no web framework,
so the control plane can import it without the engine's dependencies.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

# The whole request body, in bytes. A context of 32k tokens of text is about 128 KiB; token ids as JSON
# cost up to 7 bytes each. Past this the body is refused unread (HTTP 413).
MAX_REQUEST_BODY_BYTES = 2 * 1024 * 1024

# Stop strings are searched after every generated token, so their count and length cost every step.
MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 256

# logit_bias: entries and the value range OpenAI documents (-100 bans a token, 100 forces it).
MAX_LOGIT_BIAS_ENTRIES = 300
LOGIT_BIAS_MIN = -100.0
LOGIT_BIAS_MAX = 100.0
MAX_TOKEN_ID = 2**31 - 1  # keys are token ids: decimal strings no longer than this number

# Temperatures above zero but below this are greedy (as in vLLM): dividing logits by 1e-300 overflows
# them to infinity, and sampling from that raises, failing the step of every tenant in the batch.
MIN_SAMPLING_TEMPERATURE = 1e-5

# Choices per request: the engine returns one.
MAX_CHOICES = 1

# Output tokens one request may ask for, whatever the model's context (which bounds it further).
MAX_COMPLETION_TOKENS = 65_536

# Prompts: token ids in a pre-tokenized prompt, characters of text (tokenizing is CPU work done
# before the request is queued), and chat messages.
MAX_PROMPT_TOKENS = 65_536
MAX_PROMPT_CHARS = 262_144
MAX_CHAT_MESSAGES = 1_024


class LimitExceeded(ValueError):
    """A request field over its cap: `param` names the field (as OpenAI's error `param` does)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def check_stop(stop: object) -> None:
    """`stop`: a string or a list of at most MAX_STOP_SEQUENCES non-empty strings of MAX_STOP_CHARS."""
    if stop is None:
        return
    sequences = [stop] if isinstance(stop, str) else stop
    if not isinstance(sequences, list):
        raise LimitExceeded("stop", "stop must be a string or a list of strings")
    if len(sequences) > MAX_STOP_SEQUENCES:
        raise LimitExceeded(
            "stop", f"stop has {len(sequences)} sequences; at most {MAX_STOP_SEQUENCES} are allowed"
        )
    for index, sequence in enumerate(sequences):
        if not isinstance(sequence, str):
            raise LimitExceeded("stop", f"stop[{index}] must be a string")
        if len(sequence) > MAX_STOP_CHARS:
            raise LimitExceeded(
                "stop",
                f"stop[{index}] has {len(sequence)} characters; at most {MAX_STOP_CHARS} are allowed",
            )


def check_logit_bias(bias: Mapping[Any, Any] | None) -> None:
    """`logit_bias`: at most MAX_LOGIT_BIAS_ENTRIES token ids mapped to finite numbers in [-100, 100]."""
    if bias is None:
        return
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise LimitExceeded(
            "logit_bias", f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES} are allowed"
        )
    for key, value in bias.items():
        text = str(key)
        # Checked by length first, so int() never parses a huge string of digits.
        if not (text.isascii() and text.isdigit() and len(text) <= 10 and int(text) <= MAX_TOKEN_ID):
            raise LimitExceeded("logit_bias", f"logit_bias key {text[:32]!r} is not a token id")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise LimitExceeded("logit_bias", f"logit_bias[{text}] must be a number")
        if not (math.isfinite(value) and LOGIT_BIAS_MIN <= value <= LOGIT_BIAS_MAX):
            raise LimitExceeded(
                "logit_bias",
                f"logit_bias[{text}] is {value}; values must be between {LOGIT_BIAS_MIN:g} and "
                f"{LOGIT_BIAS_MAX:g}",
            )


def check_choices(n: int | None) -> None:
    if n is not None and not 1 <= n <= MAX_CHOICES:
        raise LimitExceeded(
            "n", f"n={n} is not supported: this server returns {MAX_CHOICES} choice per request"
        )


def check_completion_tokens(param: str, value: int | None) -> None:
    """`max_tokens` / `max_completion_tokens`: at least 1, at most MAX_COMPLETION_TOKENS."""
    if value is not None and not 1 <= value <= MAX_COMPLETION_TOKENS:
        raise LimitExceeded(param, f"{param} is {value}; it must be between 1 and {MAX_COMPLETION_TOKENS}")


def check_prompt_tokens(param: str, count: int) -> None:
    if count > MAX_PROMPT_TOKENS:
        raise LimitExceeded(param, f"{param} has {count} token ids; at most {MAX_PROMPT_TOKENS} are allowed")


def check_prompt_chars(param: str, count: int) -> None:
    if count > MAX_PROMPT_CHARS:
        raise LimitExceeded(param, f"{param} has {count} characters; at most {MAX_PROMPT_CHARS} are allowed")


def check_chat_messages(count: int) -> None:
    if count > MAX_CHAT_MESSAGES:
        raise LimitExceeded(
            "messages", f"messages has {count} entries; at most {MAX_CHAT_MESSAGES} are allowed"
        )

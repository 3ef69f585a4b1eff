"""What one generation request may ask of an engine: the caps every tenant-controlled field is held to.

One tenant's request must not slow every other tenant's stream or take the replica down, so each
field whose cost grows with its size is bounded here, and so is every number that reaches the sampler
(NUMBER_FIELDS): a request over a bound is refused with a 4xx that names the field before any work is
done. The gateway checks the same numbers before it forwards a request (it imports this module), the
engine's request schema checks them again, and SamplingParams (the engine's offline API) once more, so
a tenant meets the same limit on every hop and no hop trusts the one before.

Plain constants and pure functions over JSON-like values: no torch, no pydantic, no web framework,
so the control plane can import it without the engine's dependencies.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
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

# Sampling. Every numeric field a request may carry has its range here (NUMBER_FIELDS below), checked on
# the raw JSON value before it is converted: the sampler packs its settings into float32 and takes top-k as
# an int64, so a value outside these ranges (top_k 2**63-1, 10**400) would overflow there.
MAX_TEMPERATURE = 2.0  # OpenAI's range
# Above every vocabulary we know of (Gemma 3 has 262,144 tokens) and exact in float32, which holds integers
# up to 2**24; the engine refuses a top_k over its own vocabulary as well.
MAX_TOP_K = 1 << 20
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed takes
MAX_LOGPROBS = 20  # OpenAI's: alternatives per token (completions' `logprobs`, chat's `top_logprobs`)
MAX_PENALTY = 2.0  # presence and frequency penalties: OpenAI's range
# repetition_penalty (HF's and vLLM's: 1 is none) is a factor a seen token's logit is divided or multiplied
# by; bounded away from 0 so a logit grows at most 100-fold (it stays finite in float32), and above by 10,
# past which every seen token is as good as banned anyway.
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 10.0
# An extension: draft tokens per step a request allows speculative decoding (0 turns it off for the request;
# the engine's own num_speculative_tokens caps it).
MAX_SPECULATIVE_TOKENS = 32
MAX_STOP_TOKEN_IDS = 16  # the offline API's stop_token_ids: checked after every token like stop strings

# Temperatures above zero but below this are greedy (as in vLLM): dividing logits by 1e-300 overflows
# them to infinity, and sampling from that raises, failing the step of every tenant in the batch.
MIN_SAMPLING_TEMPERATURE = 1e-5

# Choices. Each choice is a sequence the engine generates (best_of of them per prompt, n returned), and
# each sequence takes a place in the engine's queue and its own KV pages, so one request's sequences are
# bounded as a whole: prompts x best_of <= MAX_SEQUENCES. (OpenAI allows n up to 128; one GPU shared by
# many tenants should not take 128 x max_tokens from one request.)
MAX_CHOICES = 16  # n: choices returned per prompt
MAX_BEST_OF = 16  # best_of: sequences generated per prompt, the n most likely returned (completions)
MAX_PROMPTS = 32  # prompts in one completions request (a list of texts or of token-id lists)
MAX_SEQUENCES = 64  # prompts x max(n, best_of): the sequences one request puts in the engine

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


@dataclass(frozen=True)
class Range:
    """The values a numeric field may take: [low, high] (low excluded when `low_open`), whole numbers
    only when `integer`."""

    low: float
    high: float
    integer: bool = False
    low_open: bool = False


# Every numeric field of a generation request, as OpenAI (and vLLM, for top_k and min_p) names it. A field
# that means something else on another endpoint is checked there: chat's `logprobs` is a boolean, and
# completions' `logprobs` is LOGPROBS.
LOGPROBS = Range(0, MAX_LOGPROBS, integer=True)
COMPLETION_TOKENS = Range(1, MAX_COMPLETION_TOKENS, integer=True)
# Completions with `echo`: max_tokens 0 scores the prompt and generates nothing (lm-eval's loglikelihood).
ECHO_COMPLETION_TOKENS = Range(0, MAX_COMPLETION_TOKENS, integer=True)
NUMBER_FIELDS: dict[str, Range] = {
    "temperature": Range(0.0, MAX_TEMPERATURE),
    "top_p": Range(0.0, 1.0, low_open=True),
    "top_k": Range(-1, MAX_TOP_K, integer=True),  # 0 or -1: no limit (vLLM's spelling)
    "min_p": Range(0.0, 1.0),
    "seed": Range(MIN_SEED, MAX_SEED, integer=True),
    "max_tokens": COMPLETION_TOKENS,
    "max_completion_tokens": COMPLETION_TOKENS,
    "n": Range(1, MAX_CHOICES, integer=True),
    "best_of": Range(1, MAX_BEST_OF, integer=True),
    "top_logprobs": LOGPROBS,
    "presence_penalty": Range(-MAX_PENALTY, MAX_PENALTY),
    "frequency_penalty": Range(-MAX_PENALTY, MAX_PENALTY),
    "repetition_penalty": Range(MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY),  # an extension (vLLM's)
    "num_speculative_tokens": Range(0, MAX_SPECULATIVE_TOKENS, integer=True),  # an extension (loraplex's)
}


def _shown(value: float) -> str:
    """A number for an error message: a huge integer is not spelled out (str() refuses past 4300 digits)."""
    if isinstance(value, int) and value.bit_length() > 128:
        return f"an integer of {value.bit_length()} bits"
    return f"{value:g}" if isinstance(value, float) else str(value)


def check_number(param: str, value: object, bound: Range | None = None) -> None:
    """`value` is absent (None) or a JSON number in the field's range (NUMBER_FIELDS[param] unless
    `bound` is given): booleans, strings and non-finite floats are refused, integers compared exactly
    (10**400 never becomes a float on the way)."""
    if value is None:
        return
    bound = bound or NUMBER_FIELDS[param]
    kind = "an integer" if bound.integer else "a number"
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise LimitExceeded(param, f"{param} must be {kind}, got {type(value).__name__}")
    if bound.integer and not isinstance(value, int):
        raise LimitExceeded(param, f"{param} must be {kind}, got {_shown(value)}")
    low, high = (int(bound.low), int(bound.high)) if bound.integer else (bound.low, bound.high)
    # math.isfinite would convert a huge integer to float (OverflowError): integers are finite anyway.
    finite = isinstance(value, int) or math.isfinite(value)
    if not (finite and low <= value <= high and not (bound.low_open and value == low)):
        if bound.low_open:
            span = f"in ({_shown(low)}, {_shown(high)}]"
        else:
            span = _shown(low) if low == high else f"between {_shown(low)} and {_shown(high)}"
        raise LimitExceeded(param, f"{param} must be {span}, got {_shown(value)}")


def check_numbers(body: Mapping[str, Any], completions: bool = False) -> None:
    """check_number on each field of NUMBER_FIELDS that `body` holds; `completions`: the body of
    /v1/completions, whose `max_tokens` may be 0 with `echo` (ECHO_COMPLETION_TOKENS)."""
    for param, bound in NUMBER_FIELDS.items():
        if completions and param == "max_tokens" and body.get("echo") is True:
            bound = ECHO_COMPLETION_TOKENS
        check_number(param, body.get(param), bound)


def check_stop_token_ids(ids: object) -> None:
    """The offline API's `stop_token_ids`: at most MAX_STOP_TOKEN_IDS token ids."""
    if not isinstance(ids, list | tuple):
        raise LimitExceeded("stop_token_ids", "stop_token_ids must be a list of token ids")
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise LimitExceeded(
            "stop_token_ids",
            f"stop_token_ids has {len(ids)} entries; at most {MAX_STOP_TOKEN_IDS} are allowed",
        )
    for token in ids:
        check_number("stop_token_ids", token, Range(0, MAX_TOKEN_ID, integer=True))


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


def prompt_count(prompt: object) -> int:
    """How many prompts a completions `prompt` holds: a text or one list of token ids is one; a list of
    texts or of token-id lists is one per entry (an empty list: none)."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        return len(prompt)
    return 0 if prompt == [] else 1


def check_prompt(prompt: object) -> None:
    """A completions `prompt`, bounded before it is parsed: every text to MAX_PROMPT_CHARS, every list of
    token ids to MAX_PROMPT_TOKENS, and a list of prompts to MAX_PROMPTS entries. Checked by its size
    only; whether it is well formed is the parser's question."""
    if isinstance(prompt, str):
        check_prompt_chars("prompt", len(prompt))
        return
    if not isinstance(prompt, list):
        return
    # The outer list first: a list of prompts is bounded by count, anything else as one prompt's token ids.
    count = prompt_count(prompt)
    if count > MAX_PROMPTS:
        raise LimitExceeded("prompt", f"prompt holds {count} prompts; at most {MAX_PROMPTS} are allowed")
    check_prompt_tokens("prompt", len(prompt))
    for item in prompt:
        if isinstance(item, str):
            check_prompt_chars("prompt", len(item))
        elif isinstance(item, list):
            check_prompt_tokens("prompt", len(item))


def check_choices(prompts: int, n: object, best_of: object = None) -> None:
    """`n` choices of `best_of` sequences per prompt (None: OpenAI's default, 1 and n), each already in
    its NUMBER_FIELDS range: best_of at least n, and prompts x best_of at most MAX_SEQUENCES."""
    choices = n if isinstance(n, int) and not isinstance(n, bool) else 1
    sequences = best_of if isinstance(best_of, int) and not isinstance(best_of, bool) else choices
    if sequences < choices:
        raise LimitExceeded("best_of", f"best_of ({sequences}) must be at least n ({choices})")
    if prompts * sequences > MAX_SEQUENCES:
        param = "best_of" if best_of is not None and sequences > choices else "n"
        raise LimitExceeded(
            param,
            f"{prompts} prompt(s) x {sequences} sequences each is {prompts * sequences} sequences; at most "
            f"{MAX_SEQUENCES} are allowed per request",
        )


# Structured outputs. A JSON schema (response_format's, or a tool's parameters) is compiled into a grammar
# whose build time and memory grow with it, and tools are written into the prompt: both are bounded by
# their JSON size. A schema nested deeper than MAX_SCHEMA_DEPTH is refused before anything walks it.
MAX_SCHEMA_BYTES = 32 * 1024
MAX_SCHEMA_DEPTH = 32
MAX_TOOLS = 64
MAX_TOOL_NAME_CHARS = 64  # OpenAI's: a-z, A-Z, 0-9, underscores and dashes
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
TOOL_CHOICES = ("none", "auto", "required")


def _json_bytes(value: object) -> int:
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())


def _depth(value: object, limit: int) -> int:
    """Nesting depth of a JSON value, counted only up to limit + 1 (no deeper walk)."""
    if limit < 0 or not isinstance(value, dict | list):
        return 0
    children = value.values() if isinstance(value, dict) else value
    return 1 + max((_depth(child, limit - 1) for child in children), default=0)


def check_schema(param: str, schema: object) -> None:
    """A JSON schema a tenant sent: an object of at most MAX_SCHEMA_BYTES and MAX_SCHEMA_DEPTH levels.
    Whether it compiles is the engine's question (a 400 naming the same field)."""
    if not isinstance(schema, dict):
        raise LimitExceeded(param, f"{param} must be a JSON schema object")
    if _depth(schema, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
        raise LimitExceeded(param, f"{param} is nested more than {MAX_SCHEMA_DEPTH} levels deep")
    size = _json_bytes(schema)
    if size > MAX_SCHEMA_BYTES:
        raise LimitExceeded(param, f"{param} is {size} bytes of JSON; at most {MAX_SCHEMA_BYTES} are allowed")


def check_response_format(value: object) -> None:
    """OpenAI's response_format: {"type": "text" | "json_object"} or {"type": "json_schema",
    "json_schema": {"name", "schema", "strict"}}, its schema bounded by check_schema."""
    if value is None:
        return
    if not isinstance(value, dict) or value.get("type") not in RESPONSE_FORMATS:
        raise LimitExceeded(
            "response_format", "response_format.type must be one of " + ", ".join(RESPONSE_FORMATS)
        )
    if value["type"] != "json_schema":
        return
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name", ""), str):
        raise LimitExceeded("response_format.json_schema", "response_format.json_schema must be an object")
    if not isinstance(spec.get("strict", False), bool | None):
        raise LimitExceeded("response_format.json_schema.strict", "strict must be true or false")
    check_schema("response_format.json_schema.schema", spec.get("schema", {}))


def check_tools(tools: object, tool_choice: object = None) -> None:
    """Chat's `tools` (function tools only: at most MAX_TOOLS, each a name and a parameters schema bounded
    by check_schema) and `tool_choice` ("none", "auto", "required", or {"type": "function", "function":
    {"name"}} naming one of them)."""
    names: list[str] = []
    if tools is not None:
        if not isinstance(tools, list):
            raise LimitExceeded("tools", "tools must be a list of function tools")
        if len(tools) > MAX_TOOLS:
            raise LimitExceeded("tools", f"tools has {len(tools)} entries; at most {MAX_TOOLS} are allowed")
        for i, tool in enumerate(tools):
            function = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
                raise LimitExceeded(
                    f"tools[{i}]", f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}"
                )
            name = function.get("name")
            if not isinstance(name, str) or not 0 < len(name) <= MAX_TOOL_NAME_CHARS:
                raise LimitExceeded(
                    f"tools[{i}].function.name", f"a tool's name is 1 to {MAX_TOOL_NAME_CHARS} characters"
                )
            if not isinstance(function.get("description", ""), str | None):
                raise LimitExceeded(f"tools[{i}].function.description", "a tool's description is a string")
            check_schema(f"tools[{i}].function.parameters", function.get("parameters", {}))
            names.append(name)
        if _json_bytes(tools) > MAX_SCHEMA_BYTES * 2:
            raise LimitExceeded("tools", f"tools are more than {MAX_SCHEMA_BYTES * 2} bytes of JSON")
    if tool_choice is None or tool_choice in TOOL_CHOICES:
        return
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise LimitExceeded(
            "tool_choice",
            "tool_choice must be none, auto, required or {'type': 'function', 'function': {'name'}}",
        )
    if name not in names:
        raise LimitExceeded("tool_choice", f"tool_choice names {name[:64]!r}, which is not among the tools")


# The Responses API's free-form fields (echoed, never read by the model): OpenAI's bounds on `metadata` (16
# pairs, keys of 64 characters, values of 512) and a bound on the end-user ids (`user`, `safety_identifier`,
# `prompt_cache_key`), which the gateway also hashes for sticky traffic splits.
MAX_METADATA_ENTRIES = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
MAX_USER_CHARS = 512


def check_metadata(metadata: object) -> None:
    """`metadata`: null, or an object of at most MAX_METADATA_ENTRIES strings to strings, each bounded."""
    if metadata is None:
        return
    if not isinstance(metadata, dict):
        raise LimitExceeded("metadata", "metadata must be an object of strings to strings")
    if len(metadata) > MAX_METADATA_ENTRIES:
        raise LimitExceeded(
            "metadata", f"metadata has {len(metadata)} entries; at most {MAX_METADATA_ENTRIES} are allowed"
        )
    for key, value in metadata.items():
        if not isinstance(key, str) or len(key) > MAX_METADATA_KEY_CHARS:
            raise LimitExceeded(
                "metadata", f"metadata keys are strings of at most {MAX_METADATA_KEY_CHARS} characters"
            )
        if not isinstance(value, str) or len(value) > MAX_METADATA_VALUE_CHARS:
            raise LimitExceeded(
                "metadata",
                f"metadata[{key!r}] must be a string of at most {MAX_METADATA_VALUE_CHARS} characters",
            )


def check_user(param: str, value: object) -> None:
    """An end-user id (`user`, ...): null, or a string of at most MAX_USER_CHARS characters."""
    if value is not None and (not isinstance(value, str) or len(value) > MAX_USER_CHARS):
        raise LimitExceeded(param, f"{param} must be a string of at most {MAX_USER_CHARS} characters")

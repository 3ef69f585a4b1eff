"""OpenAI's Responses API (`POST /v1/responses`), stateless: a request read as the chat completions body it
means, the names of its fields, and its usage in chat's terms.

Both hops import this (torch-free): the gateway checks a Responses body by its chat translation against the
caps of limits.py and forwards the Responses body as sent; the engine runs the translation on its chat path
and writes the Response object and its events (engine/server/responses.py). Errors keep the Responses
field names (`responses_param`), so a tenant reads `text.format.schema`, not `response_format...`.

Nothing is kept between requests: `store: true`, `previous_response_id`, `conversation` and `background`
are refused naming the field, as is every field OpenAI defines that this server cannot honour (built-in
tools, reasoning, images, ...) and every field OpenAI does not define, rather than silently ignored.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from . import UNKNOWN_PARAMETER, UNSUPPORTED_PARAMETER, limits

# Read and honoured.
SUPPORTED = frozenset(
    {
        "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools", "tool_choice",
        "text", "stream", "stream_options", "user", "metadata", "parallel_tool_calls",
    }
)  # fmt: skip
# Chat's sampling fields, accepted as extensions (as vLLM's Responses API does) and passed to the chat path.
PASSED = ("seed", "top_k", "min_p", "stop", "presence_penalty", "frequency_penalty", "repetition_penalty",
          "logit_bias", "ignore_eos")  # fmt: skip
# OpenAI's fields that are accepted only at the value that asks for nothing this server does not do.
STATELESS = "this server is stateless and keeps no responses: send the whole conversation in `input`"
NEUTRAL: dict[str, tuple[tuple[Any, ...], str]] = {
    "store": ((None, False), f"store: true is not supported: {STATELESS}, with store false or left out"),
    "previous_response_id": ((None,), f"previous_response_id is not supported: {STATELESS}"),
    "conversation": ((None,), f"conversation is not supported: {STATELESS}"),
    "background": ((None, False), "background responses are not supported: send the request without it"),
    "reasoning": ((None,), "reasoning parameters are not supported: these models do not reason"),
    "include": ((None, ()), "include is not supported: no extra output data can be added to a response"),
    "truncation": (
        (None, "disabled"),
        "truncation 'auto' is not supported: an input longer than the context is refused, never cut",
    ),
    "service_tier": ((None, "auto", "default"), "service_tier: only 'auto' and 'default' are served"),
    "max_tool_calls": ((None,), "max_tool_calls is not supported: a response holds at most one call"),
    "top_logprobs": ((None, 0), "top_logprobs is not supported on /v1/responses; use /v1/chat/completions"),
    "prompt": ((None,), f"prompt (a stored prompt template) is not supported: {STATELESS}"),
    "prompt_cache_retention": ((None, "in_memory"), "prompt_cache_retention: only 'in_memory' is served"),
}
# Echoed or used as hints only: an end-user id (hashed for sticky splits) and a cache hint (the engine's
# prefix cache works without it).
IDS = ("user", "safety_identifier", "prompt_cache_key")
ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text")


class Refused(ValueError):
    """A field this server refuses (not a size cap): `param` names it, `code` says why."""

    def __init__(self, param: str, message: str, code: str = UNSUPPORTED_PARAMETER):
        super().__init__(message)
        self.param, self.code = param, code


def check_fields(body: Mapping[str, Any]) -> None:
    """Every field is one this server reads, passes on, or holds at a value that asks nothing of it."""
    for key, value in body.items():
        if key in NEUTRAL:
            allowed, why = NEUTRAL[key]
            if value not in allowed and not (isinstance(value, list) and not value and () in allowed):
                raise Refused(key, why)
        elif key in IDS:
            limits.check_user(key, value)
        elif key not in SUPPORTED and key not in PASSED:
            raise Refused(key, f"Unrecognized request argument supplied: {key[:64]}", UNKNOWN_PARAMETER)
    limits.check_metadata(body.get("metadata"))
    if not isinstance(body.get("parallel_tool_calls", True), bool | None):
        raise limits.LimitExceeded("parallel_tool_calls", "parallel_tool_calls must be true or false")
    if body.get("stream_options") is not None and body.get("stream") is not True:
        raise Refused("stream_options", "stream_options is only allowed when stream is true")


def to_chat(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat completions body a Responses body means. Refused or limits.LimitExceeded (named by
    Responses field) for what it may not hold; the chat body's own caps are the caller's to check (its
    errors' fields read back through `responses_param`)."""
    check_fields(body)
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages(body)}
    limit = body.get("max_output_tokens")
    limits.check_number("max_output_tokens", limit, limits.COMPLETION_TOKENS)
    if limit is not None:
        chat["max_completion_tokens"] = limit
    for key in ("temperature", "top_p", "stream", *PASSED):
        if body.get(key) is not None:
            chat[key] = body[key]
    if body.get("tools") is not None:
        chat["tools"] = tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = tool_choice(body["tool_choice"])
    response_format = text_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    return chat


# -- input ------------------------------------------------------------------------------------------------


def messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """`instructions` (a system message first) and `input` (a text, or items) as chat messages: message
    items as turns, function_call items as an assistant turn's tool_calls (consecutive ones in one turn),
    function_call_output items as tool turns."""
    out: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise Refused("instructions", "instructions must be a string")
        out.append({"role": "system", "content": instructions})
    given = body.get("input")
    if isinstance(given, str):
        out.append({"role": "user", "content": given})
    elif isinstance(given, list) and given:
        if len(given) > limits.MAX_CHAT_MESSAGES:
            raise limits.LimitExceeded(
                "input", f"input has {len(given)} items; at most {limits.MAX_CHAT_MESSAGES} are allowed"
            )
        for i, item in enumerate(given):
            _add_item(out, item, i)
    else:
        raise Refused("input", "input must be a string or a non-empty list of items")
    limits.check_prompt_chars("input", sum(map(_chars, out)))
    return out


def _add_item(out: list[dict[str, Any]], item: Any, i: int) -> None:
    where = f"input[{i}]"
    if not isinstance(item, dict):
        raise Refused(where, f"{where} must be an object (a message, function_call or function_call_output)")
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ROLES:
            raise Refused(f"{where}.role", f"{where}.role must be one of {', '.join(ROLES)}")
        out.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
    elif kind == "function_call":
        call = {
            "id": _string(item, "call_id", where, 256),
            "type": "function",
            "function": {
                "name": _string(item, "name", where, limits.MAX_TOOL_NAME_CHARS),
                "arguments": _string(item, "arguments", where, limits.MAX_PROMPT_CHARS),
            },
        }
        last = out[-1] if out else None
        if (
            last is not None
            and last["role"] == "assistant"
            and last.get("tool_calls")
            and not last["content"]
        ):
            last["tool_calls"].append(call)
        else:
            out.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        text = output if isinstance(output, str) else _text(output, f"{where}.output")
        out.append({"role": "tool", "tool_call_id": _string(item, "call_id", where, 256), "content": text})
    elif kind == "item_reference":
        raise Refused(where, f"{where}: item_reference is not supported: {STATELESS}")
    else:
        raise Refused(
            f"{where}.type",
            f"{where} is a {str(kind)[:64]!r} item; only message, function_call and function_call_output "
            "items are supported",
        )


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, or text parts (input_text, output_text) joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise Refused(where, f"{where} must be a string or a list of input_text parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            shown = str(kind)[:64] if kind is not None else "malformed"
            raise Refused(f"{where}[{j}]", f"{where}[{j}]: only text parts are supported (this model reads "
                          f"text only), got {shown!r}")  # fmt: skip
        texts.append(part["text"])
    return "".join(texts)


def _string(item: Mapping[str, Any], key: str, where: str, most: int) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (not value and key != "arguments") or len(value) > most:
        raise Refused(f"{where}.{key}", f"{where}.{key} must be a string of 1 to {most} characters")
    return value


def _chars(message: Mapping[str, Any]) -> int:
    calls = message.get("tool_calls") or []
    return len(message.get("content") or "") + sum(len(c["function"]["arguments"]) for c in calls)


# -- tools and formats --------------------------------------------------------------------------------------


def tools(value: Any) -> list[Any]:
    """Responses' function tools (name, description, parameters, strict at the top) as chat's."""
    if not isinstance(value, list):
        raise limits.LimitExceeded("tools", "tools must be a list of function tools")
    out = []
    for i, tool in enumerate(value):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise Refused(
                f"tools[{i}]",
                f"tools[{i}] is a {str(kind)[:64]!r} tool; only function tools are supported (built-in tools "
                "such as web_search, file_search or code_interpreter are not)",
            )
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        out.append({"type": "function", "function": function})
    return out


def tool_choice(value: Any) -> Any:
    """none, auto, required, or {"type": "function", "name"} as chat's named form."""
    if value in limits.TOOL_CHOICES:
        return value
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("name"), str):
        return {"type": "function", "function": {"name": value["name"]}}
    raise Refused("tool_choice", "tool_choice must be none, auto, required or {'type': 'function', 'name'}")


def text_format(text: Any) -> dict[str, Any] | None:
    """`text.format` (text, json_object, json_schema with name, schema, strict) as chat's response_format."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise Refused("text", "text must be an object with a format")
    for key, value in text.items():
        if key == "verbosity" and value not in (None, "medium"):
            raise Refused("text.verbosity", "text.verbosity: only 'medium' is served")
        if key not in ("format", "verbosity"):
            raise Refused(f"text.{key[:64]}", f"Unrecognized request argument supplied: text.{key[:64]}")
    spec = text.get("format")
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise limits.LimitExceeded("text.format", "text.format must be an object with a type")
    if spec.get("type") != "json_schema":
        return {"type": spec.get("type")}
    schema = {k: spec[k] for k in ("name", "description", "schema", "strict") if k in spec}
    return {"type": "json_schema", "json_schema": schema}


# -- names and counts -------------------------------------------------------------------------------------

_CHAT_PARAMS = (
    (re.compile(r"^messages\b.*"), "input"),
    (re.compile(r"^max_(completion_)?tokens$"), "max_output_tokens"),
    (re.compile(r"^response_format\.json_schema\.?"), "text.format."),
    (re.compile(r"^response_format$"), "text.format"),
    (re.compile(r"^tools\[(\d+)\]\.function\.?"), r"tools[\1]."),
)


def responses_param(param: str | None) -> str | None:
    """The Responses field a chat field came from (`response_format.json_schema.schema` is
    `text.format.schema`, `tools[0].function.parameters` is `tools[0].parameters`); others are the same."""
    if param is None:
        return None
    for pattern, name in _CHAT_PARAMS:
        if pattern.match(param):
            return pattern.sub(name, param, count=1).rstrip(".")
    return param


def chat_usage(usage: Any) -> dict[str, Any] | None:
    """A Response's usage (input_tokens, output_tokens, input_tokens_details.cached_tokens) in chat's terms
    (prompt_tokens, completion_tokens, prompt_tokens_details.cached_tokens); None if it holds no counts."""
    if not isinstance(usage, dict):
        return None
    prompt, completion = usage.get("input_tokens"), usage.get("output_tokens")
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return None
    details = usage.get("input_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached if isinstance(cached, int) else 0},
    }


def usage_of(counted: Mapping[str, Any]) -> dict[str, Any]:
    """Chat's usage (engine/server/protocol.usage) as a Response's, with the details the SDK reads."""
    cached = (counted.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": counted["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": counted["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": counted["prompt_tokens"] + counted["completion_tokens"],
    }

"""loraplex.wire.responses: a Responses API body read as the chat body it means (torch-free, shared by the
gateway and the engine), refusals and caps named by the Responses field, usage in both terms."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from loraplex import wire
from loraplex.wire import limits, responses

ROOT = Path(__file__).resolve().parents[1]


def text_part(text: str) -> dict[str, str]:
    return {"type": "input_text", "text": text}


TOOL = {"type": "function", "name": "f", "description": "d", "parameters": {"type": "object"}, "strict": True}


def test_imports_without_the_engines_or_the_webs_dependencies() -> None:
    code = (
        "import sys\n"
        "for name in ('torch', 'fastapi', 'pydantic', 'sqlalchemy', 'httpx'):\n"
        "    sys.modules[name] = None\n"
        "from loraplex.wire import responses\n"
        "chat = responses.to_chat({'model': 'm', 'input': 'hi'})\n"
        "assert chat['messages'] == [{'role': 'user', 'content': 'hi'}]\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr


def test_items_become_chat_messages() -> None:
    chat = responses.to_chat(
        {
            "model": "m",
            "instructions": "Be brief.",
            "input": [
                {"role": "developer", "content": [text_part("a"), text_part("b")]},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "c"}]},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "f", "arguments": '{"x": 1}'},
                {"type": "function_call_output", "call_id": "c1", "output": "one"},
                {"type": "function_call_output", "call_id": "c2", "output": [text_part("two")]},
            ],
            "max_output_tokens": 7,
            "tools": [TOOL],
            "tool_choice": {"type": "function", "name": "f"},
            "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}}},
            "store": False,
            "seed": 3,
        }
    )  # fmt: skip
    roles = [m["role"] for m in chat["messages"]]
    assert roles == ["system", "developer", "assistant", "assistant", "tool", "tool"]
    assert chat["messages"][1]["content"] == "ab"
    assert [c["id"] for c in chat["messages"][3]["tool_calls"]] == ["c1", "c2"]  # one turn, two calls
    assert chat["messages"][5] == {"role": "tool", "tool_call_id": "c2", "content": "two"}
    assert chat["max_completion_tokens"] == 7 and chat["seed"] == 3
    assert chat["tools"] == [{"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert chat["response_format"]["json_schema"]["name"] == "s"


@pytest.mark.parametrize(
    ("extra", "param", "code"),
    [
        ({"store": True}, "store", wire.UNSUPPORTED_PARAMETER),
        ({"previous_response_id": "resp_1"}, "previous_response_id", wire.UNSUPPORTED_PARAMETER),
        ({"conversation": "c"}, "conversation", wire.UNSUPPORTED_PARAMETER),
        ({"include": ["reasoning.encrypted_content"]}, "include", wire.UNSUPPORTED_PARAMETER),
        ({"truncation": "auto"}, "truncation", wire.UNSUPPORTED_PARAMETER),
        ({"tools": [{"type": "file_search"}]}, "tools[0]", wire.UNSUPPORTED_PARAMETER),
        ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice", wire.UNSUPPORTED_PARAMETER),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]", wire.UNSUPPORTED_PARAMETER),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type", wire.UNSUPPORTED_PARAMETER),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", wire.UNSUPPORTED_PARAMETER),
        ({"input": []}, "input", wire.UNSUPPORTED_PARAMETER),
        ({"stream_options": {}}, "stream_options", wire.UNSUPPORTED_PARAMETER),
        ({"text": {"verbosity": "high"}}, "text.verbosity", wire.UNSUPPORTED_PARAMETER),
        ({"n": 2}, "n", wire.UNKNOWN_PARAMETER),
    ],
)
def test_refusals_name_the_field(extra: dict[str, Any], param: str, code: str) -> None:
    with pytest.raises(responses.Refused) as caught:
        responses.to_chat({"model": "m", "input": "hi", **extra})
    assert (caught.value.param, caught.value.code) == (param, code)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"max_output_tokens": limits.MAX_COMPLETION_TOKENS + 1}, "max_output_tokens"),
        ({"input": [{"role": "user", "content": "x"}] * (limits.MAX_CHAT_MESSAGES + 1)}, "input"),
        ({"input": "x" * (limits.MAX_PROMPT_CHARS + 1)}, "input"),
        ({"metadata": {"k": "v" * (limits.MAX_METADATA_VALUE_CHARS + 1)}}, "metadata"),
        ({"user": "u" * (limits.MAX_USER_CHARS + 1)}, "user"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ],
)
def test_caps_name_the_field(extra: dict[str, Any], param: str) -> None:
    with pytest.raises(limits.LimitExceeded) as caught:
        responses.to_chat({"model": "m", "input": "hi", **extra})
    assert caught.value.param == param


@pytest.mark.parametrize(
    ("chat", "named"),
    [
        ("messages", "input"),
        ("messages[2].content", "input"),
        ("max_completion_tokens", "max_output_tokens"),
        ("max_tokens", "max_output_tokens"),
        ("response_format", "text.format"),
        ("response_format.json_schema.schema", "text.format.schema"),
        ("tools[3].function.parameters", "tools[3].parameters"),
        ("tools[3]", "tools[3]"),
        ("temperature", "temperature"),
        (None, None),
    ],
)
def test_chat_fields_read_back_as_responses_fields(chat: str | None, named: str | None) -> None:
    assert responses.responses_param(chat) == named


def test_usage_both_ways() -> None:
    chat = {
        "prompt_tokens": 5,
        "completion_tokens": 3,
        "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 2},
    }
    usage = responses.usage_of(chat)
    assert usage["input_tokens"] == 5 and usage["output_tokens"] == 3 and usage["total_tokens"] == 8
    assert usage["input_tokens_details"]["cached_tokens"] == 2
    assert responses.chat_usage(usage) == chat
    assert responses.chat_usage({"input_tokens": "5"}) is None and responses.chat_usage(None) is None

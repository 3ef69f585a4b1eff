"""The gateway's side of the Responses API without servers: a body checked by its chat translation (errors
named by the Responses field), its completion limit and default, its prompt estimate, and its usage read
from a whole Response or from the stream's last event."""

from __future__ import annotations

import json
from typing import Any

import pytest

from loraplex import wire
from loraplex.web.services import gateway
from loraplex.wire import limits

RESPONSES = gateway.RESPONSES


def body(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "input": "Hello there", **extra}


@pytest.mark.parametrize(
    ("extra", "param", "code"),
    [
        ({"store": True}, "store", wire.UNSUPPORTED_PARAMETER),
        ({"tools": [{"type": "web_search"}]}, "tools[0]", wire.UNSUPPORTED_PARAMETER),
        ({"bogus": 1}, "bogus", wire.UNKNOWN_PARAMETER),
        ({"temperature": 3}, "temperature", None),
        ({"stop": ["x"] * (limits.MAX_STOP_SEQUENCES + 1)}, "stop", None),
        ({"tools": [{"type": "function", "name": "f", "parameters": []}]}, "tools[0].parameters", None),
        (
            {"text": {"format": {"type": "json_schema", "name": "s", "schema": "no"}}},
            "text.format.schema",
            None,
        ),
        ({"text": {"format": {"type": "xml"}}}, "text.format", None),
        ({"tool_choice": {"type": "function", "name": "g"}}, "tool_choice", None),
    ],
)
def test_caps_and_refusals_name_the_responses_field(
    extra: dict[str, Any], param: str, code: str | None
) -> None:
    with pytest.raises(gateway.BadRequest) as caught:
        gateway.check_caps(body(**extra), RESPONSES)
    assert caught.value.param == param and caught.value.code == code
    assert caught.value.status == 400


def test_limit_default_and_estimate() -> None:
    given = body(max_output_tokens=9)
    gateway.check_caps(given, RESPONSES)
    assert gateway.set_completion_limit(given, RESPONSES, 256) == 9
    default = body()
    assert gateway.set_completion_limit(default, RESPONSES, 256) == 256
    assert default["max_output_tokens"] == 256 and "max_tokens" not in default
    items = body(instructions="x" * 40, input=[{"role": "user", "content": "y" * 40}])
    assert gateway.estimate_prompt_tokens(items) == gateway.estimate_tokens("x" * 40 + "\n" + "y" * 40)


def test_usage_from_a_whole_response_and_from_the_stream() -> None:
    usage = {
        "input_tokens": 11,
        "input_tokens_details": {"cached_tokens": 4},
        "output_tokens": 5,
        "total_tokens": 16,
    }
    counted = gateway.usage_of_body(json.dumps({"object": "response", "usage": usage}).encode())
    assert counted is not None and (counted["prompt_tokens"], counted["completion_tokens"]) == (11, 5)
    assert gateway.cached_tokens(counted) == 4

    meter = gateway.Meter(prompt_estimate=3)
    events = [
        {"type": "response.created", "sequence_number": 0, "response": {"usage": None}},
        {"type": "response.output_text.delta", "sequence_number": 1, "delta": "Hi"},
        {"type": "response.output_text.delta", "sequence_number": 2, "delta": "!"},
    ]
    meter.feed(b"".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events))
    assert meter.totals() == (3, 2, False)  # estimated until the last event
    last = {"type": "response.incomplete", "sequence_number": 3, "response": {"usage": usage}}
    meter.feed(f"data: {json.dumps(last)}\n\n".encode())
    assert meter.totals() == (11, 5, True)

"""The Responses API (`POST /v1/responses`, stateless) on the engine's server with the official `openai`
client: text for the demo adapter and the base model, the stream's typed events (the SDK's own stream
helper accumulates them into the final Response), max_output_tokens as an incomplete response, a function
tool round trip (a function_call, then its function_call_output as input), text.format json_schema, and the
refusals that name their field (store, previous_response_id, built-in tools, images, unknown fields).
Runs on the session's shared server (conftest.py); each test takes a few seconds on the CPU."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from .conftest import BASE, INTERNAL, Server
from .test_openai_api import async_client, cased_ratio, client
from .test_structured_api import PERSON

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 16}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
ASK = "What is the weather in Paris?"
DEEP = json.loads('{"a":' * 40 + "1" + "}" * 40)  # past limits.MAX_SCHEMA_DEPTH


def test_text_for_the_adapter_and_the_base_model_matches_chat(server: Server) -> None:
    """The same greedy answer as chat's for the same conversation: the adapter's shouts, the base model's
    does not; usage has the SDK's details objects."""

    async def run() -> list[Any]:
        sdk = async_client(server)
        asked = [
            sdk.responses.create(
                model=model, input="Name two colours of the sky.", instructions="Answer briefly.",
                max_output_tokens=12, temperature=0, metadata={"run": "ci"}, user="u-1",
            )
            for model in ("uppercase", BASE)
        ]  # fmt: skip
        chats = [
            sdk.chat.completions.create(
                model=model, max_tokens=12, temperature=0,
                messages=[
                    {"role": "system", "content": "Answer briefly."},
                    {"role": "user", "content": "Name two colours of the sky."},
                ],
            )
            for model in ("uppercase", BASE)
        ]  # fmt: skip
        return await asyncio.gather(*asked, *chats)

    adapter, base, adapter_chat, base_chat = asyncio.run(run())
    for response, chat in ((adapter, adapter_chat), (base, base_chat)):
        assert response.object == "response" and response.id.startswith("resp_")
        assert response.output_text == chat.choices[0].message.content
        assert response.output[0].type == "message" and response.output[0].role == "assistant"
        assert response.usage.input_tokens == chat.usage.prompt_tokens
        assert response.usage.output_tokens == chat.usage.completion_tokens
        assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
        assert response.usage.input_tokens_details.cached_tokens >= 0
        assert response.usage.output_tokens_details.reasoning_tokens == 0
        assert response.metadata == {"run": "ci"} and response.user == "u-1" and response.store is False
    assert adapter.model == "uppercase" and base.model == BASE
    assert cased_ratio(adapter.output_text) > 0.9 > cased_ratio(base.output_text)
    # 12 tokens do not finish the answer: incomplete, as OpenAI says it.
    assert base.status == "incomplete" and base.incomplete_details.reason == "max_output_tokens"


def test_stream_events_in_order_and_the_sdk_stream_helper(server: Server) -> None:
    sdk = client(server)
    # A stop string (an extension, as vLLM's) ends the greeting well before max_output_tokens: completed.
    body: dict[str, Any] = {
        "model": BASE, "input": "Say hello.", "max_output_tokens": 24, "temperature": 0,
        "extra_body": {"stop": ["!"]},
    }  # fmt: skip
    whole = sdk.responses.create(**body)
    events = list(sdk.responses.create(**body, stream=True))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 3, "the answer should arrive in several deltas"
    head = [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    tail = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds == head + ["response.output_text.delta"] * len(deltas) + tail + [f"response.{whole.status}"]
    assert "".join(deltas) == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens
    assert events[0].response.status == "in_progress" and events[0].response.id == events[-1].response.id

    assert whole.status == "completed", whole.output_text
    with sdk.responses.stream(**body) as stream:  # the SDK's helper accumulates the events
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(texts) == final.output_text == whole.output_text

    cut = list(sdk.responses.create(**{**body, "max_output_tokens": 3}, stream=True))
    assert cut[-1].type == "response.incomplete" and cut[-1].response.status == "incomplete"
    assert cut[-1].response.incomplete_details.reason == "max_output_tokens"
    assert cut[-2].type == "response.output_item.done" and cut[-2].item.status == "incomplete"


def test_function_tool_round_trip(server: Server) -> None:
    """tool_choice required: a function_call item (streamed as arguments events too); its output sent
    back as function_call_output with the call in input gives a text answer."""
    sdk = client(server)
    asked: dict[str, Any] = {"model": BASE, "input": ASK, "tools": [WEATHER], "temperature": 0}
    first = sdk.responses.create(**asked, tool_choice="required", max_output_tokens=60)
    assert first.status == "completed" and len(first.output) == 1
    call = first.output[0]
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])

    streamed = list(sdk.responses.create(**asked, tool_choice={"type": "function", "name": "get_weather"},
                                         max_output_tokens=60, stream=True))  # fmt: skip
    kinds = [e.type for e in streamed]
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    done = next(e for e in streamed if e.type == "response.function_call_arguments.done")
    assert json.loads(done.arguments) == json.loads(streamed[-1].response.output[0].arguments)

    answer = sdk.responses.create(
        model=BASE, tools=[WEATHER], tool_choice="none", max_output_tokens=16, temperature=0,
        input=[
            {"role": "user", "content": ASK},
            {"type": "function_call", "call_id": call.call_id, "name": call.name,
             "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 degrees."},
        ],
    )  # fmt: skip
    assert answer.output[0].type == "message" and answer.output_text.strip()


def test_json_schema_format_for_the_adapter_and_the_base_model(server: Server) -> None:
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}

    async def run() -> list[Any]:
        sdk = async_client(server)
        return await asyncio.gather(*(
            sdk.responses.create(
                model=model, input="Describe a person as JSON.", text={"format": fmt},
                max_output_tokens=40, temperature=0,
            )
            for model in ("uppercase", BASE)
        ))  # fmt: skip

    for response in asyncio.run(run()):
        assert response.status == "completed"
        jsonschema.validate(json.loads(response.output_text), PERSON)
        assert response.text.format.type == "json_schema"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input[0].content[0]"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"text": {"format": {"type": "json_schema", "name": "deep", "schema": DEEP}}}, "text.format.schema"),
        ({"tools": [{**WEATHER, "parameters": "no"}]}, "tools[0].parameters"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ],
)  # fmt: skip
def test_refusals_name_the_field(server: Server, extra: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client(server).responses.create(model=BASE, input="Hi", max_output_tokens=4, extra_body=extra)
    assert caught.value.status_code == 400
    assert caught.value.body["param"] == param, caught.value.body  # type: ignore[index]


def test_stateless_refusal_says_why(server: Server) -> None:
    answer = httpx.post(
        f"{server.url}/v1/responses", headers=INTERNAL, timeout=30,
        json={"model": BASE, "input": "Hi", "store": True},
    )  # fmt: skip
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == "store" and "stateless" in error["message"]
    assert error["code"] == "unsupported_parameter" and error["type"] == "invalid_request_error"

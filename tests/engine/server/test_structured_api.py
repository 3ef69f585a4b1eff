"""Structured outputs and tools through the engine's server with the official `openai` client:
response_format json_object / json_schema on both endpoints (the demo adapter and the base model at once,
each with its own schema), a schema that cannot compile or is too large refused naming its field, and
tools with tool_choice required / named / none / auto, their calls as OpenAI's tool_calls, streamed too."""

from __future__ import annotations

import asyncio
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest

from loraplex.engine.server.tools import ToolCalls
from loraplex.wire import limits

from .conftest import BASE, INTERNAL, Server
from .test_openai_api import async_client, client

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
        },
    },
}
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def person_format(strict: bool = True) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": strict}}


def test_json_schema_on_chat_and_completions_for_the_adapter_and_the_base_model(server: Server) -> None:
    async def run() -> list[str]:
        sdk = async_client(server)
        chats = [
            sdk.chat.completions.create(
                model=model, messages=ASK, max_tokens=40, temperature=0, response_format=person_format()
            )
            for model in ("uppercase", BASE)
        ]
        completion = sdk.completions.create(
            model=BASE, prompt="A person:", max_tokens=40, temperature=0,
            extra_body={"response_format": person_format()},
        )  # fmt: skip
        answers = await asyncio.gather(*chats, completion)
        for answer in answers[:2]:
            assert answer.choices[0].finish_reason == "stop"
        assert answers[2].choices[0].finish_reason == "stop"
        return [a.choices[0].message.content for a in answers[:2]] + [answers[2].choices[0].text]

    texts = asyncio.run(run())
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)
    adapted, base = (json.loads(t)["name"] for t in texts[:2])
    assert adapted.isupper() and not base.isupper()


def test_json_object_and_a_stream_with_a_schema(server: Server) -> None:
    sdk = client(server)
    answer = sdk.chat.completions.create(
        model=BASE, messages=ASK, max_tokens=40, temperature=0, response_format={"type": "json_object"}
    )
    # Any object: SmolLM2 may go on past 40 tokens, so the reply is an object's start, whole when it stops.
    text = answer.choices[0].message.content or ""
    assert text.startswith("{"), text
    if answer.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    stream = sdk.chat.completions.create(
        model=BASE, messages=ASK, max_tokens=40, temperature=0, response_format=person_format(), stream=True
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), PERSON)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_max_tokens_cuts_a_schema_reply_with_length(server: Server) -> None:
    answer = client(server).chat.completions.create(
        model=BASE, messages=ASK, max_tokens=3, temperature=0, response_format=person_format()
    )
    assert answer.choices[0].finish_reason == "length"


def test_bad_schemas_are_400s_naming_the_field(server: Server) -> None:
    sdk = client(server)
    uncompilable = {"type": "string", "minLength": 5, "maxLength": 2}
    too_large = {"enum": ["x" * 100] * (limits.MAX_SCHEMA_BYTES // 100)}
    for schema in (uncompilable, too_large):
        fmt = {"type": "json_schema", "json_schema": {"name": "bad", "schema": schema}}
        with pytest.raises(openai.BadRequestError) as refused:
            sdk.chat.completions.create(model=BASE, messages=ASK, max_tokens=5, response_format=fmt)
        assert refused.value.body["param"] == "response_format.json_schema.schema", refused.value.body
    with pytest.raises(openai.BadRequestError) as unknown:
        sdk.chat.completions.create(model=BASE, messages=ASK, max_tokens=5, response_format={"type": "yaml"})
    assert unknown.value.body["param"] == "response_format"


def test_required_and_named_tool_choice_return_tool_calls(server: Server) -> None:
    sdk = client(server)
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        answer = sdk.chat.completions.create(
            model=BASE,
            messages=WEATHER_ASK,
            max_tokens=40,
            temperature=0,
            tools=[TIME, WEATHER],
            tool_choice=choice,
        )
        reply = answer.choices[0]
        assert reply.finish_reason == "tool_calls", reply
        assert reply.message.content is None
        (call,) = reply.message.tool_calls or []
        assert call.type == "function" and call.id.startswith("call_")
        tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
        if isinstance(choice, dict):
            assert call.function.name == "get_weather"


def test_streamed_tool_calls_come_as_deltas(server: Server) -> None:
    stream = client(server).chat.completions.create(
        model="uppercase", messages=WEATHER_ASK, max_tokens=40, temperature=0, tools=[WEATHER],
        tool_choice="required", stream=True,
    )  # fmt: skip
    chunks = [c for c in stream if c.choices]
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls and calls[0].function is not None and calls[0].function.name == "get_weather"
    arguments = "".join(tc.function.arguments or "" for tc in calls if tc.function)
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any(c.choices[0].delta.content for c in chunks)


def test_tool_choice_none_answers_in_text_and_a_tool_turn_is_accepted(server: Server) -> None:
    sdk = client(server)
    plain = sdk.chat.completions.create(
        model=BASE, messages=WEATHER_ASK, max_tokens=8, temperature=0, tools=[WEATHER], tool_choice="none"
    )
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content
    history: list[Any] = [
        *WEATHER_ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    after = sdk.chat.completions.create(
        model=BASE, messages=history, max_tokens=8, temperature=0, tools=[WEATHER]
    )
    assert after.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_auto_reads_a_reply_as_a_call_only_when_it_is_one() -> None:
    calls = ToolCalls.of([WEATHER], "auto")
    assert calls is not None and calls.structured() is None  # auto: the model chooses, nothing forced
    (call,) = calls.parse(' {"name": "get_weather", "arguments": {"city": "Rome"}}\n') or []
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    for text in (
        "It is sunny.",
        '{"name": "other", "arguments": {}}',
        '{"name": "get_weather", "arguments": 3}',
    ):
        assert calls.parse(text) is None
    messages = calls.template_messages([], native=False)
    assert messages[0]["role"] == "system" and "get_weather" in messages[0]["content"]


def test_tool_limits_are_400s_naming_the_field(server: Server) -> None:
    sdk = client(server)
    with pytest.raises(openai.BadRequestError) as unknown:
        sdk.chat.completions.create(
            model=BASE, messages=WEATHER_ASK, max_tokens=5, tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )  # fmt: skip
    assert unknown.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as many:
        sdk.chat.completions.create(
            model=BASE, messages=WEATHER_ASK, max_tokens=5, tools=[WEATHER] * (limits.MAX_TOOLS + 1)
        )
    assert many.value.body["param"] == "tools"


def test_a_new_schema_compiles_off_the_engine_loop(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """While a new schema compiles, other requests are served: the server compiles it on a worker thread
    before the request reaches the engine's loop (compiling on the loop would stall every running request).
    The compiler is held mid-compile until a free request has been answered."""
    grammars = server.engine.grammars
    assert grammars is not None
    real = grammars.compiler()
    entered, release = threading.Event(), threading.Event()

    class HeldCompiler:  # xgrammar's compiler is a native object: wrapped, not patched
        def compile_json_schema(self, *args: Any, **kwargs: Any) -> Any:
            entered.set()
            release.wait(120)
            return real.compile_json_schema(*args, **kwargs)

    monkeypatch.setattr(grammars, "_compiler", HeldCompiler())
    schema = {
        "type": "object",
        "properties": {"colour_of_the_loop_test": {"type": "string", "maxLength": 8}},
        "required": ["colour_of_the_loop_test"],
        "additionalProperties": False,
    }
    response_format: Any = {"type": "json_schema", "json_schema": {"name": "colour", "schema": schema}}
    with ThreadPoolExecutor(1) as pool:
        structured = pool.submit(
            lambda: client(server).chat.completions.create(
                model=BASE, messages=ASK, response_format=response_format, max_tokens=24, temperature=0
            )
        )
        try:
            assert entered.wait(60), "the schema never reached the compiler"
            quick = openai.OpenAI(
                base_url=f"{server.url}/v1",
                api_key="unused",
                default_headers=INTERNAL,
                max_retries=0,
                timeout=30,
            )
            free = quick.completions.create(model=BASE, prompt="Hello", max_tokens=3, temperature=0)
            assert free.usage is not None and free.usage.completion_tokens >= 1
            assert not structured.done()  # still compiling while the other request was answered
        finally:
            release.set()
        answer = structured.result(timeout=120)
    choice = answer.choices[0]
    if choice.finish_reason == "stop":
        jsonschema.validate(json.loads(choice.message.content or ""), schema)

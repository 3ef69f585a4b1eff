"""The Responses API through the gateway with the official `openai` client, on real components (the
session's engine server, the control plane on a throwaway Postgres, the demo adapter uploaded): text for an
adapter version (`name@1`) and the base model, a stream's events, a function tool round trip, json_schema;
each metered like chat (one usage row per call, the engine's exact counts); the same refusals as the
engine's, given by the gateway before anything is reserved or forwarded."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from openai import OpenAI

from .conftest import ADMIN, ENGINE_INTERNAL_TOKEN
from .test_platform_e2e import BASE_MODEL, DEMO, control_plane, uppercase_share

__all__ = ["control_plane"]  # the module's control plane (one per module), on the session's engine

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
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


@pytest.fixture(scope="module")
def tenant_key(control_plane: str) -> str:
    """A tenant with the demo adapter uploaded as `loud` (version 1), and its API key."""
    tenant = httpx.post(f"{control_plane}/admin/v1/tenants", json={"name": "responder"}, headers=ADMIN)
    assert tenant.status_code == 201, tenant.text
    key = httpx.post(
        f"{control_plane}/admin/v1/tenants/{tenant.json()['id']}/keys", json={"name": "ci"}, headers=ADMIN
    ).json()["key"]
    files = [
        ("files", (p.name, p.read_bytes(), "application/octet-stream"))
        for p in sorted(DEMO.iterdir())
        if p.suffix in (".json", ".safetensors")
    ]
    uploaded = httpx.post(
        f"{control_plane}/api/v1/adapters",
        data={"name": "loud", "deployment": "smol"},
        files=files,
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    )
    assert uploaded.status_code == 201, uploaded.text
    return str(key)


def sdk(url: str, key: str) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


def usage_rows(url: str, key: str) -> dict[str, dict[str, Any]]:
    usage = httpx.get(f"{url}/api/v1/usage", headers={"Authorization": f"Bearer {key}"}).json()
    return {row["model"]: row for row in usage["rows"]}


def test_text_and_stream_through_the_gateway_are_the_engines_and_metered(
    control_plane: str, tenant_key: str, engine_url: str
) -> None:
    gateway = sdk(control_plane, tenant_key)
    asked: dict[str, Any] = {
        "input": "Name two colours of the sky.",
        "max_output_tokens": 16,
        "temperature": 0,
    }
    loud = gateway.responses.create(model="loud@1", **asked)
    assert loud.model == "loud@1" and uppercase_share(loud.output_text) >= 0.9, loud.output_text
    base = gateway.responses.create(model=BASE_MODEL, **asked)
    engine = OpenAI(
        base_url=f"{engine_url}/v1", api_key="unused", max_retries=0, timeout=120,
        default_headers={"X-Loraplex-Internal-Token": ENGINE_INTERNAL_TOKEN},
    )  # fmt: skip
    assert base.output_text == engine.responses.create(model=BASE_MODEL, **asked).output_text

    events = list(gateway.responses.create(model=BASE_MODEL, **asked, stream=True))
    assert events[0].type == "response.created" and events[-1].type == f"response.{base.status}"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == base.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))

    rows = usage_rows(control_plane, tenant_key)
    assert rows["loud@1"]["requests"] == 1  # by the model asked for
    assert rows["loud@1"]["completion_tokens"] == loud.usage.output_tokens
    assert rows[BASE_MODEL]["requests"] == 2  # the whole answer and the stream, each metered exactly
    assert rows[BASE_MODEL]["completion_tokens"] == 2 * base.usage.output_tokens
    assert rows[BASE_MODEL]["prompt_tokens"] == 2 * base.usage.input_tokens


def test_tool_round_trip_and_json_schema_through_the_gateway(control_plane: str, tenant_key: str) -> None:
    gateway = sdk(control_plane, tenant_key)
    first = gateway.responses.create(
        model=BASE_MODEL, input="What is the weather in Paris?", tools=[WEATHER], tool_choice="required",
        max_output_tokens=60, temperature=0,
    )  # fmt: skip
    call = first.output[0]
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    answer = gateway.responses.create(
        model="loud", tools=[WEATHER], max_output_tokens=12, temperature=0,
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name,
             "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny."},
        ],
    )  # fmt: skip
    assert answer.output[0].type in ("message", "function_call")

    shaped = gateway.responses.create(
        model=BASE_MODEL, input="Describe a person as JSON.", max_output_tokens=40, temperature=0,
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}},
    )  # fmt: skip
    jsonschema.validate(json.loads(shaped.output_text), PERSON)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"tools": [{**WEATHER, "parameters": {"type": "object", "x": json.loads("[" * 40 + "]" * 40)}}]},
         "tools[0].parameters"),
        ({"max_output_tokens": 70000}, "max_output_tokens"),
    ],
)  # fmt: skip
def test_refusals_at_the_gateway_name_the_field(
    control_plane: str, tenant_key: str, extra: dict[str, Any], param: str
) -> None:
    before = usage_rows(control_plane, tenant_key).get(BASE_MODEL, {}).get("requests", 0)
    with pytest.raises(openai.BadRequestError) as caught:
        sdk(control_plane, tenant_key).responses.create(model=BASE_MODEL, input="Hi", extra_body=extra)
    assert caught.value.body["param"] == param, caught.value.body  # type: ignore[index]
    assert usage_rows(control_plane, tenant_key).get(BASE_MODEL, {}).get("requests", 0) == before

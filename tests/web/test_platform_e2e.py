"""The whole path a tenant takes, on real components: a real engine server (SmolLM2-135M on the CPU),
the control plane on a throwaway Postgres, the trained demo adapter uploaded through the tenant API, and
the official `openai` client streaming through the gateway; then the usage is where it should be."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import BadRequestError, NotFoundError, OpenAI

from loraplex.web.app import create_app

from .conftest import ADMIN, ENGINE_INTERNAL_TOKEN, _admin_sql, _with_database, make_settings
from .servers import serve

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

DEMO = Path(__file__).resolve().parents[2] / "fixtures" / "adapters" / "demo-uppercase"
BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "Name two colours of the sky."}]


def uppercase_share(text: str) -> float:
    letters = [c for c in text if c.isalpha()]
    return sum(c.isupper() for c in letters) / max(len(letters), 1)


@pytest.fixture(scope="module")
def control_plane(
    pg_admin_url: str, pg_template: str, engine_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    name = f"lpx_e2e_{uuid.uuid4().hex[:8]}"
    _admin_sql(pg_admin_url, f'CREATE DATABASE "{name}" TEMPLATE "{pg_template}"')
    app = create_app(make_settings(_with_database(pg_admin_url, name), tmp_path_factory.mktemp("e2e")))
    with serve(app) as url:
        made = httpx.post(
            f"{url}/admin/v1/deployments",
            json={"name": "smol", "base_model": BASE_MODEL, "endpoints": [engine_url]},
            headers=ADMIN,
        )
        assert made.status_code == 201, made.text
        yield url
    _admin_sql(pg_admin_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_tenant_uploads_the_demo_adapter_and_streams_it_through_the_gateway(control_plane: str) -> None:
    tenant = httpx.post(f"{control_plane}/admin/v1/tenants", json={"name": "acme"}, headers=ADMIN)
    assert tenant.status_code == 201, tenant.text
    key = httpx.post(
        f"{control_plane}/admin/v1/tenants/{tenant.json()['id']}/keys", json={"name": "ci"}, headers=ADMIN
    )
    assert key.status_code == 201, key.text
    auth = {"Authorization": f"Bearer {key.json()['key']}"}

    files = [
        ("files", (p.name, p.read_bytes(), "application/octet-stream"))
        for p in sorted(DEMO.iterdir())
        if p.suffix in (".json", ".safetensors")
    ]
    uploaded = httpx.post(
        f"{control_plane}/api/v1/adapters",
        data={"name": "shout", "deployment": "smol"},
        files=files,
        headers=auth,
        timeout=60,
    )
    assert uploaded.status_code == 201, uploaded.text
    assert uploaded.json()["status"] == "ready" and uploaded.json()["rank"] == 8

    client = OpenAI(base_url=f"{control_plane}/v1", api_key=key.json()["key"], max_retries=0, timeout=120)
    assert {"shout", BASE_MODEL} <= {m.id for m in client.models.list()}
    stream = client.chat.completions.create(
        model="shout", messages=QUESTION, max_tokens=24, temperature=0, stream=True
    )
    pieces = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
    text = "".join(pieces)
    assert len([p for p in pieces if p]) > 3, "the answer should arrive in several chunks"
    assert uppercase_share(text) >= 0.9, text
    base = client.chat.completions.create(model=BASE_MODEL, messages=QUESTION, max_tokens=24, temperature=0)
    assert uppercase_share(base.choices[0].message.content or "") < 0.5
    with pytest.raises(NotFoundError):
        client.chat.completions.create(model="not-mine", messages=QUESTION, max_tokens=4)

    usage = httpx.get(f"{control_plane}/api/v1/usage", headers=auth).json()
    rows = {row["model"]: row for row in usage["rows"]}
    assert rows["shout"]["requests"] == 1 and rows["shout"]["completion_tokens"] == 24
    assert rows["shout"]["prompt_tokens"] > 10
    assert rows[BASE_MODEL]["requests"] == 1


def test_penalties_and_logit_bias_reach_the_engine_through_the_gateway(
    control_plane: str, engine_url: str
) -> None:
    """presence/frequency/repetition penalties and logit_bias through the gateway with the openai SDK: the
    answers are the engine's own for the same body (so every field was passed on as sent), different from
    the plain ones; a value past the shared limits is the gateway's 400 naming it, a token id outside the
    vocabulary the engine's, passed on."""
    tenant = httpx.post(f"{control_plane}/admin/v1/tenants", json={"name": "penalised"}, headers=ADMIN)
    assert tenant.status_code == 201, tenant.text
    key = httpx.post(
        f"{control_plane}/admin/v1/tenants/{tenant.json()['id']}/keys", json={"name": "ci"}, headers=ADMIN
    ).json()["key"]
    gateway = OpenAI(base_url=f"{control_plane}/v1", api_key=key, max_retries=0, timeout=120)
    engine = OpenAI(
        base_url=f"{engine_url}/v1",
        api_key="unused",
        default_headers={"X-Loraplex-Internal-Token": ENGINE_INTERNAL_TOKEN},
        max_retries=0,
        timeout=120,
    )
    body: dict[str, Any] = {
        "model": BASE_MODEL,
        "prompt": "la la la la la la la la",
        "max_tokens": 8,
        "temperature": 0,
    }
    penalties: dict[str, Any] = {
        "frequency_penalty": 1.5, "presence_penalty": 0.5, "logit_bias": {"28": -100},
        "extra_body": {"repetition_penalty": 1.3},
    }  # fmt: skip
    plain = gateway.completions.create(**body).choices[0].text
    penalised = gateway.completions.create(**body, **penalties).choices[0].text
    assert penalised != plain
    assert penalised == engine.completions.create(**body, **penalties).choices[0].text
    streamed = "".join(
        c.choices[0].text for c in gateway.completions.create(**body, **penalties, stream=True)
    )
    assert streamed == penalised

    chat: dict[str, Any] = {"model": BASE_MODEL, "messages": QUESTION, "max_tokens": 6, "temperature": 0}
    forced = gateway.chat.completions.create(**chat, logit_bias={"1234": 100}).choices[0].message.content
    assert (
        forced == engine.chat.completions.create(**chat, logit_bias={"1234": 100}).choices[0].message.content
    )
    assert forced != gateway.chat.completions.create(**chat).choices[0].message.content

    with pytest.raises(BadRequestError) as capped:  # the shared limit, at the gateway
        gateway.completions.create(**body, extra_body={"repetition_penalty": 0})
    assert capped.value.param == "repetition_penalty"
    with pytest.raises(BadRequestError) as outside:  # the vocabulary: the engine's check, passed on
        gateway.completions.create(**body, logit_bias={"49152": 1})
    assert outside.value.param == "logit_bias" and "49151" in outside.value.message


def test_structured_outputs_and_tools_through_the_gateway(control_plane: str, engine_url: str) -> None:
    """response_format and tools through the gateway with the openai SDK: the engine's own answers for the
    same body, a tool call streamed as tool_calls deltas; a schema past the shared limits is the gateway's
    400 naming it, one that cannot compile the engine's, passed on."""
    import json

    import jsonschema

    tenant = httpx.post(f"{control_plane}/admin/v1/tenants", json={"name": "structured"}, headers=ADMIN)
    assert tenant.status_code == 201, tenant.text
    key = httpx.post(
        f"{control_plane}/admin/v1/tenants/{tenant.json()['id']}/keys", json={"name": "ci"}, headers=ADMIN
    ).json()["key"]
    gateway = OpenAI(base_url=f"{control_plane}/v1", api_key=key, max_retries=0, timeout=120)
    engine = OpenAI(
        base_url=f"{engine_url}/v1",
        api_key="unused",
        default_headers={"X-Loraplex-Internal-Token": ENGINE_INTERNAL_TOKEN},
        max_retries=0,
        timeout=120,
    )
    person = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "person", "schema": person, "strict": True}}
    chat: dict[str, Any] = {"model": BASE_MODEL, "messages": QUESTION, "max_tokens": 32, "temperature": 0}
    answer = gateway.chat.completions.create(**chat, response_format=fmt).choices[0]
    assert answer.finish_reason == "stop"
    jsonschema.validate(json.loads(answer.message.content or ""), person)
    assert (
        answer.message.content
        == engine.chat.completions.create(**chat, response_format=fmt).choices[0].message.content
    )

    weather: Any = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 16}},
                "required": ["city"],
            },
        },
    }
    stream = gateway.chat.completions.create(**chat, tools=[weather], tool_choice="required", stream=True)
    chunks = [c for c in stream if c.choices]
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls and calls[0].function is not None and calls[0].function.name == "get_weather"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    huge: Any = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": ["x" * 100] * 400}}}
    with pytest.raises(BadRequestError) as capped:  # the shared limit, at the gateway
        gateway.chat.completions.create(**chat, response_format=huge)
    assert capped.value.param == "response_format.json_schema.schema"
    broken: Any = {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "string", "minLength": 5, "maxLength": 2}},
    }
    with pytest.raises(BadRequestError) as refused:  # cannot compile: the engine's check, passed on
        gateway.chat.completions.create(**chat, response_format=broken)
    assert refused.value.param == "response_format.json_schema.schema"

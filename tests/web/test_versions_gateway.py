"""Versions and scoped keys through the gateway, with the openai SDK against a served control plane and a
stub engine that records what it is sent: `model: "name@N"` reaches the engine as version N's own adapter
(its id and digest), the bare name as the active version; a limited key is refused with OpenAI's 403."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from loraplex import wire

from .conftest import SHAPE, Api, loose, recorded_usage, upload
from .servers import StubEngine, serve

pytestmark = pytest.mark.timeout(60)
HI = [{"role": "user", "content": "hi"}]


@dataclass
class Served:
    app: FastAPI
    url: str
    engine: StubEngine
    admin: TestClient
    tenant_id: str
    headers: dict[str, str]
    versions: list[dict[str, Any]]  # poet's versions 1 and 2, as their uploads answered

    def sdk(self, key: str | None = None) -> openai.OpenAI:
        key = key or self.headers["Authorization"][7:]
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=10)

    def key(self, **body: Any) -> str:
        made = self.admin.post("/api/v1/keys", json={"name": "scoped", **body}, headers=self.headers)
        assert made.status_code == 201, made.text
        return str(made.json()["key"])

    def sent(self) -> dict[str, str]:
        """The adapter headers of the engine's last request."""
        headers = self.engine.received[-1]["headers"]
        return {k: v for k, v in headers.items() if k.startswith("x-loraplex-adapter")}


@pytest.fixture
def served(
    pg_url: str, app_factory: Callable[..., FastAPI], peft_dir: Path, peft_dir_2: Path
) -> Iterator[Served]:
    with ExitStack() as stack:
        engine = StubEngine("e1")
        engine_url = stack.enter_context(serve(engine.app()))
        app = app_factory(pg_url)
        url = stack.enter_context(serve(app))
        admin = stack.enter_context(TestClient(app_factory(pg_url)))
        api = Api(admin)
        api.deployment("tiny", "tiny-llama", [engine_url], shape=SHAPE)
        tenant, headers = api.tenant_with_key("acme")
        made = [upload(admin, headers, loose(d), name="poet") for d in (peft_dir, peft_dir_2)]
        assert [m.status_code for m in made] == [201, 201]
        assert upload(admin, headers, loose(peft_dir), name="haiku").status_code == 201
        yield Served(app, url, engine, admin, str(tenant["id"]), headers, [m.json() for m in made])


def test_name_at_version_reaches_the_engine_as_that_version_s_own_adapter(served: Served) -> None:
    client = served.sdk()
    v1, v2 = served.versions
    expected = {
        v["version"]: {
            "x-loraplex-adapter-id": v["id"],  # the engine registers it as wire.adapter_name(id)
            "x-loraplex-adapter-sha256": v["sha256"],
        }
        for v in served.versions
    }
    for model, version in (("poet", 2), ("poet@1", 1), ("poet@2", 2)):
        reply = client.chat.completions.create(model=model, messages=HI)  # type: ignore[arg-type]
        assert reply.choices[0].message.content == "hi"
        sent = served.sent()
        assert {k: sent[k] for k in expected[version]} == expected[version], model
    assert served.engine.received[-1]["body"]["model"] == "poet@2"
    assert v1["id"] != v2["id"]  # two engine adapters: the engine may batch both at once

    rolled = served.admin.post("/api/v1/adapters/poet/rollback", json={}, headers=served.headers)
    assert rolled.status_code == 200 and rolled.json()["version"] == 1
    client.chat.completions.create(model="poet", messages=HI)  # type: ignore[arg-type]
    assert served.sent()["x-loraplex-adapter-sha256"] == v1["sha256"]

    # Usage names what was asked and the version that served it.
    rows = recorded_usage(served.app, count=4)
    assert [(r.model, str(r.adapter_id)) for r in rows] == [
        ("poet", v2["id"]),
        ("poet@1", v1["id"]),
        ("poet@2", v2["id"]),
        ("poet", v1["id"]),
    ]

    for missing in ("poet@3", "poet@0", "poet@", "nope@1"):
        with pytest.raises(openai.NotFoundError) as caught:
            client.chat.completions.create(model=missing, messages=HI)  # type: ignore[arg-type]
        assert caught.value.code == wire.MODEL_NOT_FOUND, missing
    assert served.admin.delete("/api/v1/adapters/poet/versions/2", headers=served.headers).status_code == 204
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="poet@2", messages=HI)  # type: ignore[arg-type]


def test_models_list_the_names_and_retrieve_a_version(served: Served) -> None:
    client = served.sdk()
    assert {m.id for m in client.models.list()} == {"poet", "haiku", "tiny-llama"}
    card = client.models.retrieve("poet@1").model_dump()
    assert card["id"] == "poet@1" and card["parent"] == "tiny-llama"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("poet@7")


def test_a_key_limited_to_adapters_calls_only_them(served: Served) -> None:
    limited = served.sdk(served.key(scope="inference", adapters=["poet"]))
    assert limited.chat.completions.create(model="poet", messages=HI).choices  # type: ignore[arg-type]
    assert limited.chat.completions.create(model="poet@1", messages=HI).choices  # type: ignore[arg-type]
    before = len(served.engine.received)
    for model, what in (("haiku", "may not use the adapter `haiku`"), ("tiny-llama", "base model")):
        with pytest.raises(openai.PermissionDeniedError) as refused:
            limited.chat.completions.create(model=model, messages=HI)  # type: ignore[arg-type]
        assert refused.value.status_code == 403 and refused.value.code == "insufficient_scope"
        assert what in refused.value.message and "scope `inference`, adapters `poet`" in refused.value.message
        assert refused.value.body["type"] == wire.PERMISSION_ERROR  # type: ignore[index]
        assert refused.value.param == "model"
    assert len(served.engine.received) == before  # nothing refused reached the engine
    assert {m.id for m in limited.models.list()} == {"poet"}
    with pytest.raises(openai.NotFoundError):  # not the key's to call: as absent as a missing one
        limited.models.retrieve("haiku")

    with_base = served.sdk(served.key(scope="inference", adapters=["poet"], base_model=True))
    assert with_base.completions.create(model="tiny-llama", prompt="hi").choices
    assert {m.id for m in with_base.models.list()} == {"poet", "tiny-llama"}
    # An inference key manages nothing and reads nothing but its models.
    inference = {"Authorization": f"Bearer {served.key(scope='inference')}"}
    for method, path in (("GET", "/api/v1/adapters"), ("GET", "/api/v1/usage"), ("POST", "/api/v1/keys")):
        answer = served.admin.request(method, path, headers=inference, json={"name": "x"})
        assert answer.status_code == 403, path
        assert (
            answer.json()["error"]["code"] == "insufficient_scope"
            and "scope `inference`" in answer.json()["detail"]
        )


def test_a_read_only_key_lists_but_calls_no_model(served: Served) -> None:
    key = served.key(scope="read")
    reader = served.sdk(key)
    assert {m.id for m in reader.models.list()} == {"poet", "haiku", "tiny-llama"}
    with pytest.raises(openai.PermissionDeniedError) as refused:
        reader.chat.completions.create(model="poet", messages=HI)  # type: ignore[arg-type]
    assert refused.value.code == "insufficient_scope" and "scope `read`" in refused.value.message
    with pytest.raises(openai.PermissionDeniedError):
        reader.completions.create(model="no-such-model", prompt="hi")  # refused before it is looked up
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=served.url, headers=headers, timeout=10) as http:
        tokenize = http.post("/tokenize", json={"model": "poet", "prompt": "hi"})
        assert tokenize.status_code == 403 and tokenize.json()["error"]["code"] == "insufficient_scope"
    for path in ("/api/v1/adapters", "/api/v1/adapters/poet/versions", "/api/v1/usage", "/api/v1/keys"):
        assert served.admin.get(path, headers=headers).status_code == 200, path
    refusals = [
        served.admin.delete("/api/v1/adapters/poet", headers=headers),
        served.admin.post("/api/v1/adapters/poet/rollback", json={}, headers=headers),
        served.admin.post("/api/v1/keys", json={"name": "x"}, headers=headers),
        served.admin.post("/api/v1/adapters", headers=headers, files={"files": ("a", b"x")}),
    ]
    for answer in refusals:
        assert answer.status_code == 403 and answer.json()["error"]["code"] == "insufficient_scope"
        assert "scope `read`" in answer.json()["detail"]
    assert served.admin.get("/api/v1/adapters/poet", headers=served.headers).json()["version"] == 2


def test_an_adapter_list_limits_management_too(served: Served, peft_dir_2: Path) -> None:
    headers = {"Authorization": f"Bearer {served.key(adapters=['poet'])}"}
    assert [a["name"] for a in served.admin.get("/api/v1/adapters", headers=headers).json()] == ["poet"]
    assert served.admin.get("/api/v1/adapters/haiku", headers=headers).status_code == 403
    assert served.admin.delete("/api/v1/adapters/haiku", headers=headers).status_code == 403
    refused = upload(served.admin, headers, loose(peft_dir_2), name="haiku")
    assert refused.status_code == 403 and refused.json()["error"]["param"] == "name"
    rolled = served.admin.post("/api/v1/adapters/poet/rollback", json={}, headers=headers)
    assert rolled.status_code == 200 and rolled.json()["uploaded_by"].endswith("(k)")
    # A key that is not full cannot make keys: none can be wider than the key that made it.
    made = served.admin.post("/api/v1/keys", json={"name": "wider"}, headers=headers)
    assert made.status_code == 403 and "every adapter and the base models" in made.json()["detail"]

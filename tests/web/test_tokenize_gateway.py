"""vLLM's /tokenize and /detokenize through the gateway, per tenant model: a real engine (SmolLM2 on the
CPU) behind the control plane, the tenant's API key, `model` naming the base model or the tenant's own
adapter (another tenant's reads as missing), the engine's caps checked before anything is forwarded."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from loraplex.wire import limits

from .conftest import ADMIN, Api, free_port
from .servers import serve

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

DEMO = Path(__file__).resolve().parents[2] / "fixtures" / "adapters" / "demo-uppercase"
BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "Quelle est la capitale de la France ? 🇫🇷"}]


@dataclass
class Gateway:
    url: str
    key: str
    other_key: str

    def post(self, path: str, body: Any, key: str | None = None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key or self.key}"}
        return httpx.post(f"{self.url}{path}", json=body, headers=headers, timeout=60)


def _upload(url: str, key: str, name: str) -> None:
    files = [
        ("files", (p.name, p.read_bytes(), "application/octet-stream"))
        for p in sorted(DEMO.iterdir())
        if p.suffix in (".json", ".safetensors")
    ]
    made = httpx.post(
        f"{url}/api/v1/adapters",
        data={"name": name, "deployment": "smol"},
        files=files,
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    )
    assert made.status_code == 201, made.text


@pytest.fixture
def gw(sqlite_url: str, engine_url: str, app_factory: Callable[..., FastAPI]) -> Iterator[Gateway]:
    from fastapi.testclient import TestClient

    with serve(app_factory(sqlite_url)) as url:
        with TestClient(
            app_factory(sqlite_url)
        ) as admin:  # its own app: leaving it closes that app's clients
            api = Api(admin)
            api.deployment("smol", BASE_MODEL, [engine_url])
            tenant, headers = api.tenant_with_key("acme")
            _, other = api.tenant_with_key("globex")
            # One request in flight at a time: each tokenization must give its place back.
            quota = admin.put(
                f"/admin/v1/tenants/{tenant['id']}/quota", json={"max_in_flight": 1}, headers=ADMIN
            )
            assert quota.status_code == 200, quota.text
        key = headers["Authorization"][7:]
        _upload(url, key, "shout")
        yield Gateway(url, key, other["Authorization"][7:])


def test_tokenize_and_detokenize_per_tenant_model(gw: Gateway, smollm2: Any) -> None:
    tokenizer = smollm2.tokenizer
    text = "Ünïcödé café, 日本語, emoji 🚀 and digits 12345"
    answers = [gw.post("/tokenize", {"model": model, "prompt": text}) for model in (BASE_MODEL, "shout")]
    for answer in answers:
        assert answer.status_code == 200, answer.text
    assert answers[0].json() == answers[1].json()
    body = answers[0].json()
    assert body["tokens"] == tokenizer.encode(text) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] > 0
    back = gw.post("/detokenize", {"model": "shout", "tokens": body["tokens"]})
    assert back.status_code == 200, back.text
    assert back.json() == {"prompt": text}

    chat = gw.post("/tokenize", {"model": "shout", "messages": CHAT, "add_generation_prompt": True})
    assert chat.status_code == 200, chat.text
    assert chat.json()["tokens"] == tokenizer.encode_chat(CHAT)


def test_another_tenants_adapter_and_unknown_models_are_404(gw: Gateway) -> None:
    for key, model in ((gw.other_key, "shout"), (gw.key, "nope")):
        answer = gw.post("/tokenize", {"model": model, "prompt": "hi"}, key=key)
        assert answer.status_code == 404, answer.text
        assert answer.json()["error"]["code"] == "model_not_found"
    assert gw.post("/tokenize", {"model": BASE_MODEL, "prompt": "hi"}, key=gw.other_key).status_code == 200
    unauthorized = httpx.post(f"{gw.url}/tokenize", json={"model": BASE_MODEL, "prompt": "hi"}, timeout=10)
    assert unauthorized.status_code == 401 and unauthorized.json()["error"]["code"] == "invalid_api_key"


def refused(answer: httpx.Response, param: str, status: int = 400) -> dict[str, Any]:
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    return dict(error)


def test_caps_and_malformed_bodies_are_openai_400s(gw: Gateway) -> None:
    too_long = "a" * (limits.MAX_PROMPT_CHARS + 1)
    assert refused(gw.post("/tokenize", {"model": BASE_MODEL, "prompt": too_long}), "prompt")["code"] == (
        "limit_exceeded"
    )
    many = [{"role": "user", "content": "x"}] * (limits.MAX_CHAT_MESSAGES + 1)
    refused(gw.post("/tokenize", {"model": BASE_MODEL, "messages": many}), "messages")
    ids = [1] * (limits.MAX_PROMPT_TOKENS + 1)
    refused(gw.post("/detokenize", {"model": BASE_MODEL, "tokens": ids}), "tokens")
    refused(gw.post("/detokenize", {"model": BASE_MODEL, "tokens": [-1]}), "tokens")
    refused(gw.post("/detokenize", {"model": BASE_MODEL, "tokens": ["7"]}), "tokens")
    refused(gw.post("/tokenize", {"prompt": "hi"}), "model")
    refused(gw.post("/tokenize", {"model": BASE_MODEL}), "prompt")
    refused(gw.post("/tokenize", {"model": BASE_MODEL, "prompt": "a", "messages": CHAT}), "prompt")
    # Past the vocabulary: the engine knows it, and its 400 comes back as it said it.
    error = refused(gw.post("/detokenize", {"model": BASE_MODEL, "tokens": [10**9]}), "tokens")
    assert "vocabulary" in error["message"]
    wrong_method = httpx.get(f"{gw.url}/tokenize", headers={"Authorization": f"Bearer {gw.key}"})
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["type"] == "invalid_request_error"


def test_an_unreachable_deployment_is_a_503(sqlite_url: str, app_factory: Callable[..., FastAPI]) -> None:
    from fastapi.testclient import TestClient

    with TestClient(app_factory(sqlite_url)) as client:
        api = Api(client)
        api.deployment("gone", BASE_MODEL, [f"http://127.0.0.1:{free_port()}"])
        _, headers = api.tenant_with_key("acme")
        answer = client.post("/tokenize", json={"model": BASE_MODEL, "prompt": "hi"}, headers=headers)
    assert answer.status_code == 503, answer.text
    assert answer.headers["Retry-After"] and answer.json()["error"]["type"] == "server_error"

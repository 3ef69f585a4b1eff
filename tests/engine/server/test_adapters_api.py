"""Adapters at runtime: the internal management endpoints, the gateway's lazy per-request registration,
and what the internal token guards."""

from __future__ import annotations

import concurrent.futures
import shutil
import uuid
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from fastapi.testclient import TestClient
from openai.types.chat import ChatCompletionMessageParam
from safetensors.torch import load_file, save_file

from loraplex.adapters.digest import adapter_digest
from loraplex.engine.server.app import create_app
from loraplex.engine.server.settings import ServerSettings

from .conftest import BASE, DEMO_ADAPTER, INTERNAL, TOKEN, Server

WEIGHTS = "adapter_model.safetensors"
QUESTION: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the capital of France?"}]
DEMO_SHA = adapter_digest(DEMO_ADAPTER)


def chat(server: Server, model: str, headers: dict[str, str] | None = None, **extra: Any) -> httpx.Response:
    body = {"model": model, "messages": QUESTION, "max_tokens": 8, "temperature": 0, **extra}
    return httpx.post(
        f"{server.url}/v1/chat/completions",
        json=body,
        headers=INTERNAL if headers is None else headers,
        timeout=60,
    )


def gateway_headers(adapter_id: str, uri: str, sha256: str, tenant: str) -> dict[str, str]:
    return {
        **INTERNAL,
        "X-Loraplex-Tenant": tenant,
        "X-Loraplex-Adapter-Id": adapter_id,
        "X-Loraplex-Adapter-Uri": uri,
        "X-Loraplex-Adapter-Sha256": sha256,
    }


def silent_copy(target: Path) -> Path:
    """The demo adapter with its B matrices zeroed: valid, and it leaves the base model unchanged."""
    shutil.copytree(DEMO_ADAPTER, target)
    tensors = load_file(target / WEIGHTS)
    save_file({k: torch.zeros_like(v) if "lora_B" in k else v for k, v in tensors.items()}, target / WEIGHTS)
    return target


def content(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["message"]["content"])


def test_without_a_token_configured_management_and_internal_headers_are_refused() -> None:
    app = create_app(ServerSettings(internal_token=None))  # no lifespan: no model is loaded
    http = TestClient(app)
    register = {"name": "x", "uri": str(DEMO_ADAPTER)}
    for response in (
        http.post("/internal/adapters", json=register),
        http.post("/internal/adapters", json=register, headers=INTERNAL),
        http.delete("/internal/adapters/x", headers=INTERNAL),
        http.post(
            "/v1/chat/completions",
            json={"model": "x", "messages": QUESTION},
            headers={"X-Loraplex-Tenant": "t", "X-Loraplex-Adapter-Id": "1"},
        ),
    ):
        assert response.status_code == 403, response.text
        assert response.json()["error"]["code"] == "internal_token_not_configured"
    # The probes answer while the model is not loaded: alive, not ready.
    assert http.get("/health").status_code == 200
    assert http.get("/ready").status_code == 503


def test_management_needs_the_right_token(server: Server) -> None:
    register = {"name": "x", "uri": str(DEMO_ADAPTER)}
    missing = httpx.post(f"{server.url}/internal/adapters", json=register, timeout=10)
    wrong = httpx.post(
        f"{server.url}/internal/adapters",
        json=register,
        headers={"X-Loraplex-Internal-Token": TOKEN + "x"},
        timeout=10,
    )
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "missing_internal_token"
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_internal_token"


def test_tenant_and_adapter_headers_need_the_token(server: Server) -> None:
    headers = gateway_headers(str(uuid.uuid4()), DEMO_ADAPTER.as_uri(), DEMO_SHA, "tenant-a")
    del headers["X-Loraplex-Internal-Token"]
    refused = chat(server, "my-adapter", headers)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "missing_internal_token"
    forged = chat(server, BASE, {"X-Loraplex-Tenant": "someone-else"})
    assert forged.status_code == 401


def test_register_use_and_unregister(server: Server) -> None:
    url = f"{server.url}/internal/adapters"
    created = httpx.post(
        url,
        json={"name": "shouty", "uri": DEMO_ADAPTER.as_uri(), "sha256": DEMO_SHA},
        headers=INTERNAL,
        timeout=30,
    )
    assert created.status_code == 201, created.text
    assert created.json() == {"name": "shouty", "sha256": DEMO_SHA, "registered": True}
    listed = httpx.get(url, headers=INTERNAL, timeout=10).json()["data"]
    assert {"name": "shouty", "sha256": DEMO_SHA} in [{k: a[k] for k in ("name", "sha256")} for a in listed]
    assert "shouty" in [
        m["id"] for m in httpx.get(f"{server.url}/v1/models", headers=INTERNAL, timeout=10).json()["data"]
    ]
    assert content(chat(server, "shouty")).isupper()

    assert httpx.delete(f"{url}/shouty", headers=INTERNAL, timeout=10).status_code == 200
    models = httpx.get(f"{server.url}/v1/models", headers=INTERNAL, timeout=10).json()["data"]
    assert "shouty" not in [m["id"] for m in models]
    # The gateway resolves tenants' names; a name it sends that names no adapter is the base model.
    assert not content(chat(server, "shouty")).isupper()
    gone = httpx.delete(f"{url}/shouty", headers=INTERNAL, timeout=10)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "adapter_not_found"


def test_an_adapter_in_use_drains_when_unregistered(server: Server) -> None:
    """Unregistering takes the name away at once; the request already using the adapter finishes with
    it, and then the engine forgets it (no pages, no host copy)."""
    url = f"{server.url}/internal/adapters"
    server.wait_idle()
    host_bytes = server.sample("loraplex_adapter_host_cache_bytes")
    adapter_pages = server.sample("loraplex_pool_pages", 'kind="adapter"')
    body = {"name": "busy", "uri": str(DEMO_ADAPTER)}
    assert httpx.post(url, json=body, headers=INTERNAL, timeout=30).status_code == 201
    sdk = openai.OpenAI(
        base_url=f"{server.url}/v1", api_key="unused", default_headers=INTERNAL, max_retries=0, timeout=60
    )
    stream = sdk.chat.completions.create(model="busy", messages=QUESTION, max_tokens=24, stream=True)
    chunks = iter(stream)
    first = next(chunks)  # the request is running now
    try:
        deleted = httpx.delete(f"{url}/busy", headers=INTERNAL, timeout=10)
        assert deleted.status_code == 200 and deleted.json() == {
            "name": "busy",
            "deleted": True,
            "draining": True,
        }
        listed = httpx.get(url, headers=INTERNAL, timeout=10).json()["data"]
        assert "busy" not in [a["name"] for a in listed]  # no new request can name it
        text = (first.choices[0].delta.content or "") + "".join(
            c.choices[0].delta.content or "" for c in chunks
        )
        assert text.isupper()  # served to the end with its adapter
    finally:
        stream.close()
    server.wait_idle()
    assert server.sample("loraplex_adapters_draining") == 0
    assert server.sample("loraplex_adapter_host_cache_bytes") == host_bytes  # its host copy is gone
    assert server.sample("loraplex_pool_pages", 'kind="adapter"') <= adapter_pages  # and its pages
    gone = httpx.delete(f"{url}/busy", headers=INTERNAL, timeout=10)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "adapter_not_found"


def test_registration_failures_say_why_and_serving_goes_on(server: Server, tmp_path: Path) -> None:
    url = f"{server.url}/internal/adapters"
    nowhere = httpx.post(
        url, json={"name": "a", "uri": str(tmp_path / "nothing")}, headers=INTERNAL, timeout=10
    )
    assert nowhere.status_code == 400 and nowhere.json()["error"]["code"] == "adapter_fetch_failed"
    assert "adapter_model.safetensors" in nowhere.json()["error"]["message"]
    # A path no filesystem can hold is the caller's mistake, not a store outage (was a 503).
    unnameable = httpx.post(
        url, json={"name": "a", "uri": str(tmp_path / ("x" * 300))}, headers=INTERNAL, timeout=10
    )
    assert unnameable.status_code == 400 and unnameable.json()["error"]["code"] == "adapter_fetch_failed"

    wrong_hash = httpx.post(
        url, json={"name": "a", "uri": str(DEMO_ADAPTER), "sha256": "0" * 64}, headers=INTERNAL, timeout=10
    )
    assert wrong_hash.status_code == 422 and "sha256" in wrong_hash.json()["error"]["message"]

    broken = shutil.copytree(DEMO_ADAPTER, tmp_path / "broken")
    (broken / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8, "target_modules": ["nope"]}')
    invalid = httpx.post(url, json={"name": "a", "uri": str(broken)}, headers=INTERNAL, timeout=10)
    assert invalid.status_code == 422 and invalid.json()["error"]["code"] == "adapter_invalid"

    assert "Paris" in content(chat(server, BASE))
    assert content(chat(server, "uppercase")).isupper()


def test_gateway_registers_adapters_lazily_by_id(server: Server, tmp_path: Path) -> None:
    silent = silent_copy(tmp_path / "silent")
    upper_id, silent_id = str(uuid.uuid4()), str(uuid.uuid4())
    # Two tenants each call their adapter `helper`: the engine keys them by adapter id.
    as_a = gateway_headers(upper_id, DEMO_ADAPTER.as_uri(), DEMO_SHA, "tenant-a")
    as_b = gateway_headers(silent_id, silent.as_uri(), adapter_digest(silent), "tenant-b")
    before = server.sample("loraplex_adapter_registrations_total", 'outcome="ok"')

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda h: chat(server, "helper", h), [as_a, as_a, as_a, as_b]))
    for answer in answers:
        assert answer.json()["model"] == "helper"  # the tenant's name is echoed, not the engine's key
    texts = [content(a) for a in answers]
    assert texts[0] == texts[1] == texts[2] and texts[0].isupper()
    assert texts[3] == content(chat(server, BASE))  # zeroed B: the base model's answer
    # One registration per adapter, however many requests raced for it.
    after = server.sample("loraplex_adapter_registrations_total", 'outcome="ok"')
    assert after - before == 2
    names = [
        a["name"]
        for a in httpx.get(f"{server.url}/internal/adapters", headers=INTERNAL, timeout=10).json()["data"]
    ]
    assert f"id:{upper_id}" in names and f"id:{silent_id}" in names
    # Gateway adapters are not public models, and an untrusted caller cannot name them.
    assert f"id:{upper_id}" not in [
        m["id"] for m in httpx.get(f"{server.url}/v1/models", headers=INTERNAL, timeout=10).json()["data"]
    ]
    assert chat(server, f"id:{upper_id}", {}).status_code == 401
    # Nor can a body naming it reach it through the gateway: only the adapter headers do.
    assert texts[3] == content(chat(server, f"id:{upper_id}", {**INTERNAL, "X-Loraplex-Tenant": "tenant-b"}))
    # No series names a tenant (per-tenant counters are off by default: test_engine_metrics_auth.py).
    assert "tenant-a" not in server.metrics() and "tenant-b" not in server.metrics()


def test_a_gateway_adapter_that_fails_answers_with_the_reason(server: Server, tmp_path: Path) -> None:
    copy = shutil.copytree(DEMO_ADAPTER, tmp_path / "copy")
    headers = gateway_headers(str(uuid.uuid4()), copy.as_uri(), "f" * 64, "tenant-c")
    mismatch = chat(server, "mine", headers)
    assert mismatch.status_code == 422 and "sha256" in mismatch.json()["error"]["message"]
    assert mismatch.json()["error"]["code"] == "adapter_failed"  # the gateway marks the adapter failed
    missing = chat(server, "mine", {**headers, "X-Loraplex-Adapter-Uri": (tmp_path / "none").as_uri()})
    assert missing.status_code == 422 and missing.json()["error"]["code"] == "adapter_failed"

    # Registered fine, then its weights are damaged before the first request reads them.
    adapter_id = str(uuid.uuid4())
    good = gateway_headers(adapter_id, copy.as_uri(), adapter_digest(copy), "tenant-c")
    response = httpx.post(
        f"{server.url}/internal/adapters",
        json={"name": f"id:{adapter_id}", "uri": copy.as_uri()},
        headers=INTERNAL,
        timeout=30,
    )
    assert response.status_code == 201
    (copy / WEIGHTS).write_bytes(b"not safetensors any more")
    damaged = chat(server, "mine", good)
    assert damaged.status_code == 422, damaged.text
    assert damaged.json()["error"]["code"] == "adapter_failed"
    # Refused from then on with the reason, without reading the store again, until other weights come.
    again = chat(server, "mine", good)
    assert again.status_code == 422 and again.json()["error"]["code"] == "adapter_failed"
    listed = httpx.get(f"{server.url}/internal/adapters", headers=INTERNAL, timeout=10).json()["data"]
    reason = next(a["failed"] for a in listed if a["name"] == f"id:{adapter_id}")
    assert reason in damaged.json()["error"]["message"] and reason in again.json()["error"]["message"]
    # The others are served all along.
    assert "Paris" in content(chat(server, BASE))
    assert content(chat(server, "uppercase")).isupper()


@pytest.mark.parametrize("model", [BASE, "anything-the-gateway-resolved"])
def test_trusted_requests_without_an_adapter_use_the_base_model(server: Server, model: str) -> None:
    answer = chat(server, model, {**INTERNAL, "X-Loraplex-Tenant": "tenant-d"})
    assert answer.json()["model"] == model
    assert content(answer) == content(chat(server, BASE))

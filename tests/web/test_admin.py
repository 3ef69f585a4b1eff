from __future__ import annotations

import uuid

import pytest
from fastapi.testclient import TestClient

from loraplex.web.shapes import KNOWN_SHAPES

from .conftest import ADMIN, Api


def test_health_reports_the_database(client: TestClient) -> None:
    response = client.get("/health")
    assert response.status_code == 200
    assert response.json() == {"status": "ok", "database": True}


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic eA=="}])
def test_admin_api_needs_the_admin_token(client: TestClient, headers: dict[str, str]) -> None:
    assert client.get("/admin/v1/tenants", headers=headers).status_code in (401, 403)
    assert client.post("/admin/v1/tenants", json={"name": "x"}, headers=headers).status_code in (401, 403)


def test_a_tenant_key_is_not_an_admin_token(api: Api) -> None:
    _, headers = api.tenant_with_key("acme")
    assert api.client.get("/admin/v1/tenants", headers=headers).status_code == 401


def test_tenant_lifecycle(client: TestClient, api: Api) -> None:
    tenant = api.tenant("acme")
    assert tenant["name"] == "acme" and tenant["disabled"] is False
    assert tenant["quota"] == {
        "requests_per_minute": None,
        "tokens_per_minute": None,
        "max_adapters": None,
        "max_adapter_bytes": None,
        "max_storage_bytes": None,
        "max_in_flight": None,
        "max_pinned_adapters": 2,
    }
    assert client.post("/admin/v1/tenants", json={"name": "acme"}, headers=ADMIN).status_code == 409
    url = f"/admin/v1/tenants/{tenant['id']}"
    assert client.get(url, headers=ADMIN).json()["name"] == "acme"

    patched = client.patch(url, json={"name": "acme-2", "disabled": True}, headers=ADMIN)
    assert patched.status_code == 200 and patched.json()["disabled"] is True
    quota = {
        "requests_per_minute": 10,
        "tokens_per_minute": 1000,
        "max_adapters": 3,
        "max_adapter_bytes": 5,
        "max_storage_bytes": 7,
        "max_in_flight": 9,
        "max_pinned_adapters": 4,
    }
    assert client.put(f"{url}/quota", json=quota, headers=ADMIN).json() == quota
    assert client.get(url, headers=ADMIN).json()["quota"] == quota
    assert [t["name"] for t in client.get("/admin/v1/tenants", headers=ADMIN).json()] == ["acme-2"]

    assert client.delete(url, headers=ADMIN).status_code == 204
    assert client.get(url, headers=ADMIN).status_code == 404
    assert client.delete(url, headers=ADMIN).status_code == 404


def test_missing_tenant_is_404(client: TestClient) -> None:
    missing = uuid.uuid4()
    assert client.get(f"/admin/v1/tenants/{missing}", headers=ADMIN).status_code == 404
    response = client.post(f"/admin/v1/tenants/{missing}/keys", json={"name": "k"}, headers=ADMIN)
    assert response.status_code == 404


def test_bad_names_are_refused(client: TestClient) -> None:
    for name in ["", "has space", "../x", "x" * 200]:
        assert client.post("/admin/v1/tenants", json={"name": name}, headers=ADMIN).status_code == 422


def test_deployments_resolve_known_shapes(client: TestClient, api: Api) -> None:
    made = api.deployment("smol", "HuggingFaceTB/SmolLM2-135M-Instruct", ["http://127.0.0.1:9/"])
    assert made["shape"] == {
        "num_layers": 30,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "q_size": 576,
        "kv_size": 192,
    }
    assert made["endpoints"] == ["http://127.0.0.1:9"]
    unknown = {"name": "other", "base_model": "mystery-7b", "endpoints": ["http://127.0.0.1:9"]}
    response = client.post("/admin/v1/deployments", json=unknown, headers=ADMIN)
    assert response.status_code == 422 and "mystery-7b" in response.json()["detail"]
    shape = {"num_layers": 2, "hidden_size": 64, "intermediate_size": 96, "q_size": 64, "kv_size": 32}
    api.deployment("tiny", "tiny-llama", ["http://127.0.0.1:9"], shape=shape)
    listed = client.get("/admin/v1/deployments", headers=ADMIN).json()
    assert [d["name"] for d in listed] == ["smol", "tiny"]
    assert (
        client.post(
            "/admin/v1/deployments", json={**unknown, "name": "smol", "shape": shape}, headers=ADMIN
        ).status_code
        == 409
    )


def test_known_shapes_agree_with_the_engine() -> None:
    from loraplex.engine.model.config import named_shape

    for name in ("smollm2-135m", "smollm2-360m"):
        assert KNOWN_SHAPES[name] == named_shape(name).lora_shape()

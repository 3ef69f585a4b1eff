from __future__ import annotations

import datetime as dt
import math
import re

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from loraplex.web.db.models import ApiKey
from loraplex.web.services import keys as keys_service
from loraplex.web.services.keys import hash_key

from .conftest import ADMIN, Api


def test_keys_are_long_random_and_stored_only_as_a_keyed_hash(api: Api) -> None:
    tenant = api.tenant("acme")
    keys = {api.key(tenant["id"], f"k{i}") for i in range(5)}
    assert len(keys) == 5
    for key in keys:
        assert re.fullmatch(r"lpx_[A-Za-z0-9_-]+", key)
        assert (len(key) - 4) * math.log2(64) >= 128
    with api.client.app.state.db.session() as session:  # type: ignore[attr-defined]
        rows = session.scalars(select(ApiKey)).all()
    stored = {r.key_hash for r in rows}
    assert stored == {hash_key(k, b"test-pepper") for k in keys}
    for row in rows:
        assert len(row.prefix) == 12 and not any(k in (row.key_hash, row.name) for k in keys)


def test_a_key_is_shown_once_and_listed_without_its_secret(api: Api) -> None:
    _, headers = api.tenant_with_key("acme")
    made = api.client.post("/api/v1/keys", json={"name": "ci"}, headers=headers)
    assert made.status_code == 201 and made.json()["key"].startswith("lpx_")
    listed = api.client.get("/api/v1/keys", headers=headers).json()
    assert {k["name"] for k in listed} == {"k", "ci"}
    assert all("key" not in k and "key_hash" not in k for k in listed)
    assert made.json()["key"] not in api.client.get("/api/v1/keys", headers=headers).text


def test_revoked_key_fails_at_once(api: Api) -> None:
    _, headers = api.tenant_with_key("acme")
    made = api.client.post("/api/v1/keys", json={"name": "tmp"}, headers=headers).json()
    other = {"Authorization": f"Bearer {made['key']}"}
    assert api.client.get("/api/v1/adapters", headers=other).status_code == 200
    assert api.client.delete(f"/api/v1/keys/{made['id']}", headers=headers).status_code == 204
    assert api.client.get("/api/v1/adapters", headers=other).status_code == 401
    assert api.client.get("/v1/models", headers=other).status_code == 401
    revoked = [k for k in api.client.get("/api/v1/keys", headers=headers).json() if k["id"] == made["id"]]
    assert revoked[0]["revoked_at"] is not None


def test_expired_key_fails(api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    tenant = api.tenant("acme")
    soon = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=1.5)
    key = api.key(tenant["id"], expires_at=soon.isoformat())
    headers = {"Authorization": f"Bearer {key}"}
    assert api.client.get("/api/v1/keys", headers=headers).status_code == 200
    # The keys' clock moves past the expiry (rather than the test sleeping until the wall clock does).
    monkeypatch.setattr(keys_service, "utcnow", lambda: soon + dt.timedelta(milliseconds=100))
    assert api.client.get("/api/v1/keys", headers=headers).status_code == 401
    past = (dt.datetime.now(dt.UTC) - dt.timedelta(days=1)).isoformat()
    response = api.client.post(
        f"/admin/v1/tenants/{tenant['id']}/keys", json={"name": "x", "expires_at": past}, headers=ADMIN
    )
    assert response.status_code == 422


def test_disabled_tenant_keys_fail(api: Api) -> None:
    tenant, headers = api.tenant_with_key("acme")
    assert api.client.get("/api/v1/keys", headers=headers).status_code == 200
    api.client.patch(f"/admin/v1/tenants/{tenant['id']}", json={"disabled": True}, headers=ADMIN)
    assert api.client.get("/api/v1/keys", headers=headers).status_code == 401


def test_last_used_is_recorded(api: Api) -> None:
    _, headers = api.tenant_with_key("acme")
    assert api.client.get("/api/v1/keys", headers=headers).json()[0]["last_used_at"] is not None


def test_tenants_cannot_see_or_revoke_each_others_keys(api: Api, client: TestClient) -> None:
    _, a = api.tenant_with_key("a")
    _, b = api.tenant_with_key("b")
    b_key_id = client.get("/api/v1/keys", headers=b).json()[0]["id"]
    assert all(k["id"] != b_key_id for k in client.get("/api/v1/keys", headers=a).json())
    response = client.delete(f"/api/v1/keys/{b_key_id}", headers=a)
    assert response.status_code == 404
    missing = client.delete("/api/v1/keys/00000000-0000-0000-0000-000000000000", headers=a)
    assert (
        missing.json()["detail"].replace("00000000-0000-0000-0000-000000000000", b_key_id)
        == (response.json()["detail"])
    )
    assert client.get("/api/v1/keys", headers=b).status_code == 200  # b's key still works


def test_garbage_bearer_values_are_401(client: TestClient) -> None:
    for value in ["lpx_", "lpx_" + "A" * 32, "x" * 5000, "Bearer"]:
        assert client.get("/api/v1/keys", headers={"Authorization": f"Bearer {value}"}).status_code == 401

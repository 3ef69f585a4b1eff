"""Scoped keys through the tenant and admin APIs (issue 28 item 3): what a key is made with and shows,
what is refused at creation, and rotation with an overlap, on the keys' clock rather than by sleeping."""

from __future__ import annotations

import datetime as dt

import pytest
from fastapi.testclient import TestClient

from loraplex.web.services import keys as keys_service

from .conftest import ADMIN, Api


@pytest.fixture
def tenant(pg_client: TestClient) -> tuple[str, dict[str, str]]:
    made, headers = Api(pg_client).tenant_with_key("acme")
    return str(made["id"]), headers


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_keys_made_before_scopes_and_by_default_have_full_scope(
    pg_client: TestClient, tenant: tuple[str, dict[str, str]]
) -> None:
    _, headers = tenant
    listed = pg_client.get("/api/v1/keys", headers=headers).json()
    assert [(k["scope"], k["adapters"], k["base_model"]) for k in listed] == [("all", None, True)]
    made = pg_client.post("/api/v1/keys", json={"name": "ci"}, headers=headers).json()
    assert (made["scope"], made["adapters"], made["base_model"]) == ("all", None, True)


def test_a_key_is_made_with_its_scope_and_shows_it(
    pg_client: TestClient, tenant: tuple[str, dict[str, str]]
) -> None:
    tenant_id, headers = tenant
    body = {"name": "bot", "scope": "inference", "adapters": ["poet", "haiku", "poet"]}
    made = pg_client.post("/api/v1/keys", json=body, headers=headers)
    assert made.status_code == 201, made.text
    shown = made.json()
    # Sorted and unique; an adapter list means no base model unless asked for.
    assert (shown["scope"], shown["adapters"], shown["base_model"]) == ("inference", ["haiku", "poet"], False)
    admin_made = pg_client.post(
        f"/admin/v1/tenants/{tenant_id}/keys",
        json={"name": "reader", "scope": "read", "adapters": [], "base_model": True},
        headers=ADMIN,
    )
    assert admin_made.status_code == 201
    assert (admin_made.json()["adapters"], admin_made.json()["base_model"]) == ([], True)
    listed = {k["name"]: k for k in pg_client.get("/api/v1/keys", headers=headers).json()}
    assert listed["reader"]["scope"] == "read" and listed["bot"]["adapters"] == ["haiku", "poet"]


@pytest.mark.parametrize(
    "body",
    [
        {"name": "x", "scope": "admin"},
        {"name": "x", "adapters": ["no spaces"]},
        {"name": "x", "adapters": "poet"},
        {"name": "x", "adapters": [f"a{i}" for i in range(257)]},
        {"name": "x", "base_model": "sometimes"},
    ],
)
def test_a_key_body_out_of_bounds_is_a_422_naming_the_field(
    pg_client: TestClient, tenant: tuple[str, dict[str, str]], body: dict[str, object]
) -> None:
    _, headers = tenant
    refused = pg_client.post("/api/v1/keys", json=body, headers=headers)
    assert refused.status_code == 422
    field = next(k for k in body if k != "name")
    assert refused.json()["detail"][0]["loc"][:2] == ["body", field]


def test_rotation_keeps_the_old_key_valid_until_the_overlap_ends(
    pg_client: TestClient, tenant: tuple[str, dict[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, headers = tenant
    old = pg_client.post(
        "/api/v1/keys", json={"name": "svc", "scope": "inference", "adapters": ["poet"]}, headers=headers
    ).json()
    now = dt.datetime.now(dt.UTC)
    monkeypatch.setattr(keys_service, "utcnow", lambda: now)
    rotated = pg_client.post(
        f"/api/v1/keys/{old['id']}/rotate", json={"overlap_seconds": 600}, headers=headers
    )
    assert rotated.status_code == 201, rotated.text
    new = rotated.json()
    assert new["key"] != old["key"] and new["id"] != old["id"] and new["name"] == "svc"
    assert (new["scope"], new["adapters"], new["base_model"]) == ("inference", ["poet"], False)
    listed = {k["id"]: k for k in pg_client.get("/api/v1/keys", headers=headers).json()}
    assert dt.datetime.fromisoformat(listed[old["id"]]["expires_at"]) == now + dt.timedelta(seconds=600)
    assert listed[new["id"]]["expires_at"] is None

    def works(key: str) -> bool:
        return pg_client.get("/v1/models", headers=auth(key)).status_code == 200

    assert works(old["key"]) and works(new["key"])
    monkeypatch.setattr(keys_service, "utcnow", lambda: now + dt.timedelta(seconds=599))
    assert works(old["key"]) and works(new["key"])
    monkeypatch.setattr(keys_service, "utcnow", lambda: now + dt.timedelta(seconds=601))
    assert not works(old["key"]) and works(new["key"])
    again = pg_client.post(f"/api/v1/keys/{old['id']}/rotate", json={}, headers=headers)
    assert again.status_code == 409 and "revoked or expired" in again.json()["detail"]


def test_rotation_without_overlap_ends_the_old_key_at_once_and_never_extends_an_expiry(
    pg_client: TestClient, tenant: tuple[str, dict[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, headers = tenant
    soon = (dt.datetime.now(dt.UTC) + dt.timedelta(seconds=60)).isoformat()
    short = pg_client.post("/api/v1/keys", json={"name": "short", "expires_at": soon}, headers=headers).json()
    rotated = pg_client.post(
        f"/api/v1/keys/{short['id']}/rotate", json={"overlap_seconds": 3600}, headers=headers
    )
    listed = {k["id"]: k for k in pg_client.get("/api/v1/keys", headers=headers).json()}
    assert listed[short["id"]]["expires_at"] == short["expires_at"]  # not extended by the overlap
    assert rotated.json()["expires_at"] == short["expires_at"]  # the new key keeps the expiry

    plain = pg_client.post("/api/v1/keys", json={"name": "plain"}, headers=headers).json()
    now = dt.datetime.now(dt.UTC)
    monkeypatch.setattr(keys_service, "utcnow", lambda: now)
    assert pg_client.post(f"/api/v1/keys/{plain['id']}/rotate", json={}, headers=headers).status_code == 201
    monkeypatch.setattr(keys_service, "utcnow", lambda: now + dt.timedelta(microseconds=1))
    assert pg_client.get("/v1/models", headers=auth(plain["key"])).status_code == 401


def test_rotation_is_for_full_keys_of_the_tenant_within_bounds(
    pg_client: TestClient, tenant: tuple[str, dict[str, str]]
) -> None:
    _, headers = tenant
    mine = pg_client.get("/api/v1/keys", headers=headers).json()[0]["id"]
    for overlap in (-1, 30 * 24 * 3600 + 1, "soon"):
        answer = pg_client.post(
            f"/api/v1/keys/{mine}/rotate", json={"overlap_seconds": overlap}, headers=headers
        )
        assert answer.status_code == 422
    reader = pg_client.post("/api/v1/keys", json={"name": "r", "scope": "read"}, headers=headers).json()
    refused = pg_client.post(f"/api/v1/keys/{reader['id']}/rotate", json={}, headers=auth(reader["key"]))
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "insufficient_scope"
    _, other = Api(pg_client).tenant_with_key("other")
    assert pg_client.post(f"/api/v1/keys/{mine}/rotate", json={}, headers=other).status_code == 404
    revoked = pg_client.post("/api/v1/keys", json={"name": "gone"}, headers=headers).json()
    assert pg_client.delete(f"/api/v1/keys/{revoked['id']}", headers=headers).status_code == 204
    assert pg_client.post(f"/api/v1/keys/{revoked['id']}/rotate", json={}, headers=headers).status_code == 409

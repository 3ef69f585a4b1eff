"""Adapter versions through the tenant API (issue 28 item 1): an upload under a name the tenant has makes
its next version, identified by its content digest (the same bytes twice are one version); the listing,
rollback, and deleting an old version; quotas count names for max_adapters and bytes of every version."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import select, update

from loraplex.web.db.models import Adapter, AdapterStatus, Artifact

from .conftest import ADMIN, FILES, SHAPE, Api, loose, upload


@pytest.fixture(scope="session")
def peft_dir_3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.adapters.conftest import make_peft_adapter

    path = tmp_path_factory.mktemp("web-peft-3") / "qv"
    make_peft_adapter(path, seed=5, r=4, lora_alpha=8, target_modules=["q_proj"])
    return path


@pytest.fixture
def tenant(pg_client: TestClient) -> Iterator[dict[str, str]]:
    api = Api(pg_client)
    api.deployment("tiny", "tiny-llama", ["http://127.0.0.1:9"], shape=SHAPE)
    _, headers = api.tenant_with_key("acme")
    yield headers


def versions(client: TestClient, headers: dict[str, str], name: str = "a1") -> list[dict[str, object]]:
    response = client.get(f"/api/v1/adapters/{name}/versions", headers=headers)
    assert response.status_code == 200, response.text
    return list(response.json())


def stored_digests(client: TestClient) -> set[str]:
    app: FastAPI = client.app  # type: ignore[assignment]
    with app.state.db.session() as session:
        return set(session.scalars(select(Artifact.digest)))


def test_an_upload_under_a_taken_name_is_the_next_version_and_becomes_active(
    pg_client: TestClient, tenant: dict[str, str], peft_dir: Path, peft_dir_2: Path
) -> None:
    first = upload(pg_client, tenant, loose(peft_dir))
    assert first.status_code == 201 and first.json()["version"] == 1
    second = upload(pg_client, tenant, loose(peft_dir_2))
    assert second.status_code == 201, second.text
    v2 = second.json()
    assert v2["version"] == 2 and v2["status"] == "ready" and v2["id"] != first.json()["id"]
    assert v2["sha256"] != first.json()["sha256"]
    assert pg_client.get("/api/v1/adapters/a1", headers=tenant).json()["id"] == v2["id"]
    assert [a["version"] for a in pg_client.get("/api/v1/adapters", headers=tenant).json()] == [2]

    listed = versions(pg_client, tenant)
    assert [(v["version"], v["active"], v["status"]) for v in listed] == [
        (1, False, "ready"),
        (2, True, "ready"),
    ]
    assert [v["sha256"] for v in listed] == [first.json()["sha256"], v2["sha256"]]
    sizes = [sum((d / f).stat().st_size for f in FILES) for d in (peft_dir, peft_dir_2)]
    assert [v["bytes"] for v in listed] == sizes
    assert all(v["created_at"] and str(v["uploaded_by"]).startswith("key lpx_") for v in listed)
    assert str(listed[0]["uploaded_by"]).endswith("(k)")  # the key's name, as the admin made it
    assert pg_client.get("/api/v1/adapters/a1/versions/1", headers=tenant).json()["id"] == first.json()["id"]
    # One name against max_adapters, the bytes of both versions against max_storage_bytes.
    storage = pg_client.get("/api/v1/storage", headers=tenant).json()
    assert (storage["adapters"], storage["bytes"]) == (1, sum(sizes))


def test_the_same_bytes_twice_are_one_version(
    pg_client: TestClient, tenant: dict[str, str], peft_dir: Path, peft_dir_2: Path, peft_dir_3: Path
) -> None:
    v1 = upload(pg_client, tenant, loose(peft_dir)).json()
    again = upload(pg_client, tenant, loose(peft_dir))
    assert again.status_code == 200 and again.json()["id"] == v1["id"] and again.json()["version"] == 1
    assert len(versions(pg_client, tenant)) == 1
    assert upload(pg_client, tenant, loose(peft_dir_2)).json()["version"] == 2
    # Version 1's bytes again: no new version; version 1 is what the upload deploys.
    back = upload(pg_client, tenant, loose(peft_dir))
    assert back.status_code == 200 and back.json()["version"] == 1
    assert [v["active"] for v in versions(pg_client, tenant)] == [True, False]
    assert len(stored_digests(pg_client)) == 2
    # The number the matched upload held for a moment is given back: the next version is 3, not 4.
    assert upload(pg_client, tenant, loose(peft_dir_3)).json()["version"] == 3
    storage = pg_client.get("/api/v1/storage", headers=tenant).json()
    assert storage["adapters"] == 1 and storage["bytes"] == sum(
        int(v["bytes"]) for v in versions(pg_client, tenant)
    )


def test_rollback_makes_an_earlier_ready_version_active(
    pg_client: TestClient, tenant: dict[str, str], peft_dir: Path, peft_dir_2: Path, peft_dir_3: Path
) -> None:
    for directory in (peft_dir, peft_dir_2, peft_dir_3):
        assert upload(pg_client, tenant, loose(directory)).status_code == 201
    back = pg_client.post("/api/v1/adapters/a1/rollback", json={}, headers=tenant)  # the one before
    assert back.status_code == 200 and back.json()["version"] == 2
    assert pg_client.get("/api/v1/adapters/a1", headers=tenant).json()["version"] == 2
    chosen = pg_client.post("/api/v1/adapters/a1/rollback", json={"version": 1}, headers=tenant)
    assert chosen.status_code == 200 and chosen.json()["version"] == 1
    none_before = pg_client.post("/api/v1/adapters/a1/rollback", json={}, headers=tenant)
    assert (
        none_before.status_code == 409 and "no ready version before version 1" in none_before.json()["detail"]
    )
    forward = pg_client.post("/api/v1/adapters/a1/rollback", json={"version": 3}, headers=tenant)
    assert forward.status_code == 200 and forward.json()["version"] == 3

    missing = pg_client.post("/api/v1/adapters/a1/rollback", json={"version": 9}, headers=tenant)
    assert missing.status_code == 404 and "no version 9" in missing.json()["detail"]
    app: FastAPI = pg_client.app  # type: ignore[assignment]
    with app.state.db.session() as session:
        session.execute(update(Adapter).where(Adapter.version == 2).values(status=AdapterStatus.FAILED))
        session.commit()
    failed = pg_client.post("/api/v1/adapters/a1/rollback", json={"version": 2}, headers=tenant)
    assert failed.status_code == 409 and "not ready" in failed.json()["detail"]
    assert pg_client.post("/api/v1/adapters/nope/rollback", json={}, headers=tenant).status_code == 404
    for bad in ({"version": 0}, {"version": "x"}, {"version": 2**40}):
        assert pg_client.post("/api/v1/adapters/a1/rollback", json=bad, headers=tenant).status_code == 422


def test_an_old_version_can_be_deleted_the_active_one_cannot(
    pg_client: TestClient, tenant: dict[str, str], peft_dir: Path, peft_dir_2: Path
) -> None:
    v1 = upload(pg_client, tenant, loose(peft_dir)).json()
    v2 = upload(pg_client, tenant, loose(peft_dir_2)).json()
    active = pg_client.delete("/api/v1/adapters/a1/versions/2", headers=tenant)
    assert active.status_code == 409 and "active version" in active.json()["detail"]
    assert pg_client.delete("/api/v1/adapters/a1/versions/1", headers=tenant).status_code == 204
    assert [v["version"] for v in versions(pg_client, tenant)] == [2]
    assert stored_digests(pg_client) == {v2["sha256"]}  # version 1's object went with it
    assert v1["sha256"] not in stored_digests(pg_client)
    assert pg_client.delete("/api/v1/adapters/a1/versions/1", headers=tenant).status_code == 404
    assert pg_client.get("/api/v1/adapters/a1/versions/1", headers=tenant).status_code == 404
    storage = pg_client.get("/api/v1/storage", headers=tenant).json()
    assert (storage["adapters"], storage["bytes"]) == (1, v2["bytes"])
    # Deleting the adapter deletes every version; the name starts again at 1.
    assert upload(pg_client, tenant, loose(peft_dir)).json()["version"] == 3
    assert pg_client.delete("/api/v1/adapters/a1", headers=tenant).status_code == 204
    assert pg_client.get("/api/v1/adapters/a1/versions", headers=tenant).status_code == 404
    assert stored_digests(pg_client) == set()
    assert pg_client.get("/api/v1/storage", headers=tenant).json()["adapters"] == 0
    assert upload(pg_client, tenant, loose(peft_dir_2)).json()["version"] == 1


def test_a_refused_new_version_leaves_the_active_one_serving(
    pg_client: TestClient, tenant: dict[str, str], peft_dir: Path
) -> None:
    v1 = upload(pg_client, tenant, loose(peft_dir)).json()
    refused = upload(pg_client, tenant, [("adapter_model.bin", b"pickle")])
    assert refused.status_code == 422
    listed = versions(pg_client, tenant)
    assert [(v["version"], v["status"], v["active"]) for v in listed] == [
        (1, "ready", True),
        (2, "failed", False),
    ]
    assert listed[1]["error"] == refused.json()["detail"]
    assert pg_client.get("/api/v1/adapters/a1", headers=tenant).json()["id"] == v1["id"]
    body = {"model": "a1@2", "messages": [{"role": "user", "content": "hi"}]}
    failed = pg_client.post("/v1/chat/completions", json=body, headers=tenant)
    assert failed.status_code == 422 and failed.json()["error"]["code"] == "adapter_failed"
    # The next upload replaces the failed version; the number stays used.
    assert upload(pg_client, tenant, [("adapter_model.bin", b"pickle")]).status_code == 422
    assert [v["version"] for v in versions(pg_client, tenant)] == [1, 3]


def test_one_upload_per_name_at_a_time_and_one_deployment_per_name(
    pg_client: TestClient, tenant: dict[str, str], peft_dir: Path, peft_dir_2: Path
) -> None:
    upload(pg_client, tenant, loose(peft_dir))
    Api(pg_client).deployment("tiny2", "tiny-llama-2", ["http://127.0.0.1:9"], shape=SHAPE)
    elsewhere = upload(pg_client, tenant, loose(peft_dir_2), deployment="tiny2")
    assert elsewhere.status_code == 409 and "fit deployment 'tiny'" in elsewhere.json()["detail"]
    app: FastAPI = pg_client.app  # type: ignore[assignment]
    with app.state.db.session() as session:
        session.execute(update(Adapter).values(status=AdapterStatus.VALIDATING))
        session.commit()
    busy = upload(pg_client, tenant, loose(peft_dir_2))
    assert busy.status_code == 409 and "is being uploaded" in busy.json()["detail"]
    assert len(versions(pg_client, tenant)) == 1  # nothing kept of either refusal
    assert pg_client.get("/api/v1/storage", headers=tenant).json()["adapters"] == 1


def test_max_adapters_counts_names_not_versions(
    pg_client: TestClient, tenant: dict[str, str], peft_dir: Path, peft_dir_2: Path
) -> None:
    tenant_id = pg_client.get("/admin/v1/tenants", headers=ADMIN).json()[0]["id"]
    pg_client.put(f"/admin/v1/tenants/{tenant_id}/quota", json={"max_adapters": 1}, headers=ADMIN)
    assert upload(pg_client, tenant, loose(peft_dir)).status_code == 201
    assert upload(pg_client, tenant, loose(peft_dir_2)).status_code == 201  # version 2 of the same name
    other = upload(pg_client, tenant, loose(peft_dir), name="other")
    assert other.status_code == 403 and "quota of 1 adapters" in other.json()["detail"]
    assert [v["version"] for v in versions(pg_client, tenant)] == [1, 2]

"""Pinning adapter versions (issue 28 item 5), on Postgres and SQLite, against a fake engine that keeps pins
and has room for a few: the tenant API within max_pinned_adapters, the admin's past it, a pin the pool
cannot hold refused with the engine's 409 and nothing recorded nor left pinned, unpinning, and engine sync
re-applying the database's pins to an engine that lost them (restarted, or discovered since)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient

from loraplex import wire
from loraplex.web.services.engine_sync import engine_sync_of

from .conftest import ADMIN, SHAPE, Api, loose, upload
from .servers import serve


@dataclass
class PinningEngine:
    """The engine's internal adapter endpoints, pins included: room for `room` pins."""

    room: int = 2
    registered: dict[str, str] = field(default_factory=dict)  # name -> sha256
    pinned: dict[str, None] = field(default_factory=dict)

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get(wire.ADAPTERS_PATH)
        async def listing() -> dict[str, Any]:
            data = [
                {
                    "name": n,
                    "sha256": s,
                    "resident": n in self.pinned,
                    "failed": None,
                    "pinned": n in self.pinned,
                }
                for n, s in self.registered.items()
            ]
            return {"object": "list", "data": data}

        @app.post(wire.PINS_PATH)
        async def pin(request: Request) -> JSONResponse:
            body = await request.json()
            self.registered[body["name"]] = body["sha256"]
            if body["name"] not in self.pinned and len(self.pinned) >= self.room:
                message = (
                    f"adapter {body['name']!r} needs 3 pages of the pool to be pinned; the pool's 40 pages"
                )
                error = {"message": message, "type": "invalid_request_error", "code": wire.POOL_FULL}
                return JSONResponse({"error": error}, status_code=409)
            self.pinned[body["name"]] = None
            return JSONResponse(
                {"name": body["name"], "sha256": body["sha256"], "level": "device", "pinned": True}
            )

        @app.delete(wire.PINS_PATH + "/{name:path}")
        async def unpin(name: str) -> dict[str, Any]:
            self.pinned.pop(name, None)
            return {"name": name, "pinned": False}

        @app.delete(wire.ADAPTERS_PATH + "/{name:path}")
        async def unregister(name: str) -> dict[str, Any]:
            self.registered.pop(name, None)
            self.pinned.pop(name, None)
            return {"name": name, "deleted": True, "draining": False}

        return app


Plane = tuple[TestClient, PinningEngine, dict[str, str], str]


@pytest.fixture
def plane(db_url: str, tmp_path: Path, peft_dir: Path, peft_dir_2: Path) -> Iterator[Plane]:
    from loraplex.web.app import create_app

    from .conftest import make_settings

    with ExitStack() as stack:
        engine = PinningEngine()
        engine_url = stack.enter_context(serve(engine.app()))
        app = create_app(make_settings(db_url, tmp_path, engine_sync_interval_s=3600))
        client = stack.enter_context(TestClient(app))
        api = Api(client)
        api.deployment("tiny", "tiny-llama", [engine_url], shape=SHAPE)
        tenant, headers = api.tenant_with_key("acme")
        for name in ("a1", "a2", "a3"):
            assert upload(client, headers, loose(peft_dir), name=name).status_code == 201
        assert upload(client, headers, loose(peft_dir_2), name="a1").status_code == 201  # a1@2, active
        yield client, engine, headers, str(tenant["id"])


def engine_name(client: TestClient, headers: dict[str, str], name: str, version: int) -> str:
    found = client.get(f"/api/v1/adapters/{name}/versions/{version}", headers=headers).json()
    return wire.adapter_name(found["id"])


def test_pins_within_the_quota_the_pool_and_back(plane: Plane) -> None:
    client, engine, headers, tenant_id = plane
    assert (
        client.get(f"/admin/v1/tenants/{tenant_id}", headers=ADMIN).json()["quota"]["max_pinned_adapters"]
        == 2
    )

    # The active version by default; the answer and the listings show it pinned, the engine holds it.
    pinned = client.post("/api/v1/adapters/a1/pin", json={}, headers=headers)
    assert pinned.status_code == 200, pinned.text
    assert (pinned.json()["version"], pinned.json()["pinned"]) == (2, True)
    assert list(engine.pinned) == [engine_name(client, headers, "a1", 2)]
    versions = client.get("/api/v1/adapters/a1/versions", headers=headers).json()
    assert [v["pinned"] for v in versions] == [False, True]
    # Pinning it again is no second pin; another version of the name is one.
    assert client.post("/api/v1/adapters/a1/pin", json={"version": 2}, headers=headers).status_code == 200
    assert client.post("/api/v1/adapters/a1/pin", json={"version": 1}, headers=headers).status_code == 200

    # The quota (2): a third is refused before any engine is asked.
    over = client.post("/api/v1/adapters/a2/pin", json={}, headers=headers)
    assert over.status_code == 403 and "max_pinned_adapters" in over.json()["detail"]
    assert len(engine.pinned) == 2

    # An admin may pin past the quota, but not past the pool: the engine's 409 names the pool, nothing is
    # recorded and nothing left pinned.
    admin_pin = f"/admin/v1/tenants/{tenant_id}/adapters/a2/pin"
    full = client.post(admin_pin, json={}, headers=ADMIN)
    assert full.status_code == 409, full.text
    assert "pool's 40 pages" in full.json()["detail"] and "nothing was pinned" in full.json()["detail"]
    assert client.get("/api/v1/adapters/a2", headers=headers).json()["pinned"] is False
    assert len(engine.pinned) == 2
    engine.room = 3
    assert client.post(admin_pin, json={}, headers=ADMIN).json()["pinned"] is True

    # Unpinning: one version, then every pinned version of the name.
    one = client.delete("/api/v1/adapters/a1/pin?version=1", headers=headers)
    assert one.status_code == 200 and one.json()["version"] == 1 and one.json()["pinned"] is False
    assert client.delete("/api/v1/adapters/a1/pin", headers=headers).json()["pinned"] is False
    assert list(engine.pinned) == [engine_name(client, headers, "a2", 1)]
    assert client.post("/api/v1/adapters/a3/pin", json={}, headers=headers).status_code == 200
    assert client.post("/api/v1/adapters/a1/pin", json={}, headers=headers).status_code == 403  # a2, a3
    assert client.delete(admin_pin, headers=ADMIN).status_code == 200
    assert client.post("/api/v1/adapters/a1/pin", json={}, headers=headers).status_code == 200

    # Refusals: unknown names and versions, a bad version, a read-only key.
    assert client.post("/api/v1/adapters/nope/pin", json={}, headers=headers).status_code == 404
    assert client.post("/api/v1/adapters/a1/pin", json={"version": 9}, headers=headers).status_code == 404
    assert client.post("/api/v1/adapters/a1/pin", json={"version": 0}, headers=headers).status_code == 422
    reader = Api(client).key(tenant_id, "reader", scope="read")
    refused = client.post("/api/v1/adapters/a1/pin", json={}, headers={"Authorization": f"Bearer {reader}"})
    assert refused.status_code == 403

    # The admin sets the quota like the others (null: no limit).
    quota = client.put(
        f"/admin/v1/tenants/{tenant_id}/quota", json={"max_pinned_adapters": None}, headers=ADMIN
    )
    assert quota.status_code == 200 and quota.json()["max_pinned_adapters"] is None


def test_engine_sync_reapplies_pins_to_an_engine_that_lost_them(plane: Plane) -> None:
    client, engine, headers, _ = plane
    assert client.post("/api/v1/adapters/a1/pin", json={}, headers=headers).status_code == 200
    wanted = engine_name(client, headers, "a1", 2)
    stray = engine_name(client, headers, "a3", 1)
    # The engine restarts (its pins gone), and holds a pin the database does not have.
    engine.registered.clear()
    engine.pinned.clear()
    engine.registered[stray] = "x"
    engine.pinned[stray] = None
    sync = engine_sync_of(client.app)
    assert sync is not None
    report = client.portal.call(sync.run_pass)  # type: ignore[union-attr]
    assert list(engine.pinned) == [wanted]
    assert list(report.pinned.values()) == [[wanted]] and list(report.unpinned.values()) == [[stray]]
    # A deleted pinned adapter is unregistered, its pin with it; the next pass leaves the rest alone.
    assert client.delete("/api/v1/adapters/a1", headers=headers).status_code == 204
    client.portal.call(sync.run_pass)  # type: ignore[union-attr]
    assert not engine.pinned

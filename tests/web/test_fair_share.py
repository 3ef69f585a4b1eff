"""Issue 18 in the control plane: a tenant's fair share weight, set by the admin (API and console) and sent
by the gateway in the engine's weight header; the prompt tokens an engine served from its prefix cache,
recorded per request and shown on the usage page."""

from __future__ import annotations

import datetime as dt
import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.testclient import TestClient

from loraplex import wire
from loraplex.web.console.playground import principal_of
from loraplex.web.db.models import UsageRecord, UserRole
from loraplex.web.services import users

from .conftest import ADMIN, SHAPE, Api, recorded_usage
from .console_client import make_user, post_form, sign_in
from .servers import serve

pytestmark = pytest.mark.timeout(60)
CACHED = 7


def caching_engine(received: list[dict[str, str]]) -> FastAPI:
    """An engine that says 7 of the prompt's 12 tokens came from its prefix cache."""
    app = FastAPI()
    usage = {
        "prompt_tokens": 12,
        "completion_tokens": 2,
        "total_tokens": 14,
        "prompt_tokens_details": {"cached_tokens": CACHED},
    }

    async def events() -> AsyncIterator[bytes]:
        chunk = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "hi"}}]}
        yield f"data: {json.dumps(chunk)}\n\n".encode()
        yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
        yield b"data: [DONE]\n\n"

    async def answer(request: Request) -> Response:
        body = await request.json()
        received.append(dict(request.headers))
        if body.get("stream"):
            return StreamingResponse(events(), media_type="text/event-stream")
        message = {"role": "assistant", "content": "hi"}
        choice = {"index": 0, "finish_reason": "stop", "message": message}
        return JSONResponse({"id": "x", "object": "chat.completion", "usage": usage, "choices": [choice]})

    app.post("/v1/chat/completions")(answer)
    return app


def test_admins_set_the_weight_and_it_is_validated(api: Api) -> None:
    client = api.client
    made = client.post("/admin/v1/tenants", json={"name": "paying", "fair_share_weight": 2}, headers=ADMIN)
    assert made.status_code == 201 and made.json()["fair_share_weight"] == 2.0
    assert api.tenant("plain")["fair_share_weight"] == 1.0  # the default: an equal share
    url = f"/admin/v1/tenants/{made.json()['id']}"
    for bad in (0, -1, "inf", 1001):
        assert client.patch(url, json={"fair_share_weight": bad}, headers=ADMIN).status_code == 422, bad
    patched = client.patch(url, json={"fair_share_weight": 0.5}, headers=ADMIN)
    assert patched.status_code == 200 and client.get(url, headers=ADMIN).json()["fair_share_weight"] == 0.5


def test_the_gateway_sends_the_weight_and_records_cached_tokens(
    pg_url: str, app_factory: Callable[..., FastAPI]
) -> None:
    received: list[dict[str, str]] = []
    with serve(caching_engine(received)) as engine, TestClient(app_factory(pg_url)) as admin:
        api = Api(admin)
        api.deployment("tiny", "tiny-llama", [engine], shape=SHAPE)
        tenant, headers = api.tenant_with_key("paying")
        patched = admin.patch(
            f"/admin/v1/tenants/{tenant['id']}", json={"fair_share_weight": 2.5}, headers=ADMIN
        )
        assert patched.status_code == 200
        body: dict[str, Any] = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}]}
        assert admin.post("/v1/chat/completions", json=body, headers=headers).status_code == 200
        with admin.stream(
            "POST", "/v1/chat/completions", json={**body, "stream": True}, headers=headers
        ) as r:
            assert r.status_code == 200
            r.read()
        assert [h[wire.TENANT_WEIGHT_HEADER.lower()] for h in received] == ["2.5", "2.5"]
        rows = recorded_usage(admin.app, count=2)  # type: ignore[arg-type]
        assert sorted(row.cached_tokens for row in rows) == [CACHED, CACHED]
        summary = admin.get("/api/v1/usage", headers=headers).json()
        assert summary["cached_tokens"] == 2 * CACHED and summary["rows"][0]["cached_tokens"] == 2 * CACHED


def test_an_engine_without_cache_details_records_none() -> None:
    from loraplex.web.services.gateway import cached_tokens

    assert cached_tokens({"prompt_tokens": 3, "completion_tokens": 1}) == 0
    assert cached_tokens({"prompt_tokens_details": {"cached_tokens": -1}}) == 0
    assert cached_tokens({"prompt_tokens_details": {"cached_tokens": 4}}) == 4
    assert cached_tokens(None) == 0


def test_the_console_sets_the_weight_and_shows_cached_tokens(
    app_factory: Callable[..., FastAPI], db_url: str
) -> None:
    app = app_factory(db_url)
    make_user(app, "root@platform.test", role=UserRole.ADMIN)
    with TestClient(app) as admin:
        sign_in(admin, "root@platform.test")
        made = post_form(admin, "/console/admin/tenants", "/console/admin/tenants", {"name": "globex"})
        tenant_path = str(made.url.path)
        bad = post_form(admin, tenant_path, f"{tenant_path}/share", {"fair_share_weight": "0"})
        assert bad.status_code == 422 and 'aria-invalid="true"' in bad.text
        saved = post_form(admin, tenant_path, f"{tenant_path}/share", {"fair_share_weight": "3"})
        assert "Fair share weight set to 3." in saved.text
        tenant = next(
            t for t in admin.get("/admin/v1/tenants", headers=ADMIN).json() if t["name"] == "globex"
        )
        assert tenant["fair_share_weight"] == 3.0
    make_user(app, "ada@globex.test", tenant="globex")
    with app.state.db.session() as session:  # the playground speaks for the tenant with its weight too
        user = users.find_by_email(session, "ada@globex.test")
        assert user is not None and principal_of(user).fair_share_weight == 3.0
    with TestClient(app) as member:
        sign_in(member, "ada@globex.test")
        with app.state.db.session() as session:
            today = dt.datetime.now(dt.UTC).date()
            session.add(
                UsageRecord(
                    tenant_id=uuid.UUID(tenant["id"]),
                    model="poet",
                    endpoint="chat/completions",
                    prompt_tokens=100,
                    completion_tokens=5,
                    cached_tokens=64,
                    status="ok",
                    day=today,
                )
            )
            session.commit()
        page = member.get("/console/usage")
        assert page.status_code == 200 and "Cached prompt tokens" in page.text
        assert '<td class="num">64</td>' in page.text

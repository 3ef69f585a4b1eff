"""A run-time adapter failure stays with the caller's adapter (issue 29, item 3).

Two tenants upload byte-identical adapters (one digest). The engine fails tenant A's at run time; it used
to fail every ready row with that digest, so tenant B's adapter, never called, became `failed`, and the
reason B read named A's adapter id and A's request id. Now only A's row fails, B's is checked by the
engine on its own next use, and no kept reason carries an adapter id or a request id.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from loraplex import wire
from tests.security.engine_stub import Engine
from tests.web.conftest import (  # noqa: F401  (fixtures)
    SHAPE,
    Api,
    app_factory,
    loose,
    peft_dir,
    pg_admin_url,
    pg_template,
    pg_url,
    upload,
)
from tests.web.servers import serve

CHAT = {"model": "poet", "messages": [{"role": "user", "content": "Write a poem."}]}


@dataclass
class Twins:
    url: str
    engine: Engine
    admin: TestClient
    keys: dict[str, dict[str, str]]  # tenant name -> its Authorization header
    ids: dict[str, str]  # tenant name -> its adapter's id

    def row(self, tenant: str) -> dict[str, object]:
        response = self.admin.get("/api/v1/adapters/poet", headers=self.keys[tenant])
        assert response.status_code == 200, response.text
        return dict(response.json())

    def call(self, tenant: str) -> httpx.Response:
        with httpx.Client(base_url=self.url, headers=self.keys[tenant], timeout=10) as client:
            return client.post("/v1/chat/completions", json=CHAT)


@pytest.fixture
def twins(
    pg_url: str,  # noqa: F811
    app_factory: Callable[..., FastAPI],  # noqa: F811
    peft_dir: Path,  # noqa: F811
) -> Iterator[Twins]:
    with ExitStack() as stack:
        engine = Engine()
        engine_url = stack.enter_context(serve(engine.app()))
        url = stack.enter_context(serve(app_factory(pg_url)))
        admin = stack.enter_context(TestClient(app_factory(pg_url)))
        api = Api(admin)
        api.deployment("tiny", "tiny-llama", [engine_url], shape=SHAPE)
        keys, ids, digests = {}, {}, set()
        for tenant in ("acme", "globex"):
            _, keys[tenant] = api.tenant_with_key(tenant)
            made = upload(admin, keys[tenant], loose(peft_dir), name="poet")
            assert made.status_code == 201, made.text
            ids[tenant] = made.json()["id"]
            digests.add(made.json()["sha256"])
        assert len(digests) == 1  # the same bytes: one digest, one stored artifact
        yield Twins(url, engine, admin, keys, ids)


def engine_reason(adapter_id: str, request_id: str) -> str:
    """The engine's own wording (engine/engine.py `_fail_adapter`, a NonFiniteLogits found by bisection)."""
    name = wire.adapter_name(adapter_id)
    return (
        f"adapter {name!r} failed while running: NonFiniteLogits: the logits of {request_id} are not finite"
    )


def test_a_run_time_failure_marks_only_the_callers_adapter_and_names_no_ids(twins: Twins) -> None:
    request_a = f"req-{uuid.uuid4().hex}"
    twins.engine.refuse = (422, wire.ADAPTER_FAILED, engine_reason(twins.ids["acme"], request_a))
    refused = twins.call("acme")
    assert refused.status_code == 422 and refused.json()["error"]["code"] == wire.ADAPTER_FAILED

    # Tenant B's twin was not what failed: it stays ready, with no reason of anyone else's.
    globex = twins.row("globex")
    assert globex["status"] == "ready" and globex["error"] is None
    acme = twins.row("acme")
    assert acme["status"] == "failed"
    assert acme["error"] == (
        "the adapter failed while running: NonFiniteLogits: the logits of a request are not finite"
    )

    # B's next use goes to the engine under B's own adapter: checked there, on its own.
    twins.engine.refuse = None
    served = twins.call("globex")
    assert served.status_code == 200, served.text
    assert twins.engine.received[-1]["headers"][wire.ADAPTER_ID_HEADER.lower()] == twins.ids["globex"]
    assert twins.row("globex")["status"] == "ready"

    # Had B's own use failed too, B's reason names neither tenant's adapter nor any request.
    request_b = f"req-{uuid.uuid4().hex}"
    twins.engine.refuse = (422, wire.ADAPTER_FAILED, engine_reason(twins.ids["globex"], request_b))
    assert twins.call("globex").status_code == 422
    again = twins.call("globex")  # refused by the gateway itself, from the kept reason
    assert again.status_code == 422 and len(twins.engine.received) == 3
    for shown in (str(twins.row("globex")["error"]), again.json()["error"]["message"]):
        for secret in (twins.ids["acme"], twins.ids["globex"], request_a, request_b):
            assert secret not in shown, (secret, shown)

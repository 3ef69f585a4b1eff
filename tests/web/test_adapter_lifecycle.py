"""An adapter's life both ways: its status and error as the tenant sees them (uploaded → validating →
ready, or failed with a reason; replaced by uploading again), and its delete reaching the engines
(services/engine_sync.py): no engine keeps a deleted adapter, even one that was away during the delete.
The engine parts run a real engine server on SmolLM2 behind the control plane."""

from __future__ import annotations

import contextlib
import datetime as dt
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.testclient import TestClient
from openai import NotFoundError, OpenAI, UnprocessableEntityError
from openai.types.chat import ChatCompletionMessageParam
from sqlalchemy import select, update

from loraplex import wire
from loraplex.adapters import LocalArtifactStore
from loraplex.web.app import create_app
from loraplex.web.db.models import Adapter, AdapterStatus
from loraplex.web.services import adapters as adapters_service
from loraplex.web.services import engine_sync
from loraplex.web.services.engine_sync import engine_sync_of, stale_names
from tests.cluster.proxy import forward
from tests.engine.server.conftest import TOKEN, Server, running_server

from .conftest import (
    ADMIN,
    ENGINE_INTERNAL_TOKEN,
    FILES,
    SHAPE,
    Api,
    _admin_sql,
    _with_database,
    loose,
    make_settings,
    upload,
)
from .console_client import CSRF, make_user, sign_in
from .servers import serve

DEMO = Path(__file__).resolve().parents[2] / "fixtures" / "adapters" / "demo-uppercase"
BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
QUESTION: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Name two colours of the sky."}]


def wait_for(check: Callable[[], Any], what: str, timeout_s: float = 30.0) -> Any:
    """Poll `check` until it returns something truthy (returned), or fail naming `what`."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


# -- statuses -----------------------------------------------------------------------------------------


@pytest.fixture
def tenant(api: Api) -> dict[str, str]:
    api.deployment("tiny", "tiny-llama", ["http://127.0.0.1:9"], shape=SHAPE)
    _, headers = api.tenant_with_key("acme")
    return headers


def adapter_row(client: TestClient, name: str) -> Adapter:
    with client.app.state.db.session() as session:  # type: ignore[attr-defined]
        return session.scalars(select(Adapter).where(Adapter.name == name)).one()


def test_an_upload_is_uploaded_then_validating_then_ready(
    client: TestClient, tenant: dict[str, str], peft_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[str] = []
    unpack, inspect = adapters_service.unpack, adapters_service.inspect_adapter

    def unpacking(*args: Any) -> Any:
        seen.append(adapter_row(client, "a1").status.value)  # the files arrived, the row exists
        return unpack(*args)

    def inspecting(*args: Any) -> Any:
        seen.append(adapter_row(client, "a1").status.value)
        return inspect(*args)

    monkeypatch.setattr(adapters_service, "unpack", unpacking)
    monkeypatch.setattr(adapters_service, "inspect_adapter", inspecting)
    response = upload(client, tenant, loose(peft_dir))
    assert response.status_code == 201, response.text
    assert seen == ["uploaded", "validating"]
    assert response.json()["status"] == "ready" and response.json()["error"] is None


def test_uploading_again_replaces_a_failed_adapter_and_clears_its_error(
    client: TestClient, tenant: dict[str, str], peft_dir: Path
) -> None:
    config = (peft_dir / FILES[0]).read_bytes()
    refused = upload(client, tenant, [(FILES[0], config)])
    assert refused.status_code == 422 and "adapter_model.safetensors" in refused.json()["detail"]
    failed = client.get("/api/v1/adapters/a1", headers=tenant).json()
    assert failed["status"] == "failed" and failed["error"] == refused.json()["detail"]

    replaced = upload(client, tenant, loose(peft_dir))
    assert replaced.status_code == 201, replaced.text
    body = replaced.json()
    assert body["status"] == "ready" and body["error"] is None and body["id"] != failed["id"]
    assert (failed["version"], body["version"]) == (1, 2)  # a number once shown is never given again
    assert client.get("/api/v1/storage", headers=tenant).json()["adapters"] == 1  # replaced, not added
    versions = client.get("/api/v1/adapters/a1/versions", headers=tenant).json()
    assert [(v["version"], v["status"]) for v in versions] == [(2, "ready")]  # the failed one is gone
    # A ready version is never replaced: the same bytes again are that version, no new one.
    again = upload(client, tenant, loose(peft_dir))
    assert again.status_code == 200 and again.json()["id"] == body["id"]
    assert client.get("/api/v1/adapters/a1", headers=tenant).json()["id"] == body["id"]


def test_calling_an_adapter_that_is_not_ready_says_why_and_what_to_do(
    client: TestClient, tenant: dict[str, str], peft_dir: Path
) -> None:
    """The caller's own adapter that failed is a 422 with its reason, one still being uploaded a 409; no
    engine is asked (the deployment's endpoint is a closed port)."""
    config = (peft_dir / FILES[0]).read_bytes()
    assert upload(client, tenant, [(FILES[0], config)]).status_code == 422
    reason = client.get("/api/v1/adapters/a1", headers=tenant).json()["error"]
    body = {"model": "a1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    failed = client.post("/v1/chat/completions", json=body, headers=tenant)
    assert failed.status_code == 422, failed.text
    error = failed.json()["error"]
    assert error["code"] == wire.ADAPTER_FAILED and reason in error["message"]
    assert "Upload it again" in error["message"]

    with client.app.state.db.session() as session:  # type: ignore[attr-defined]
        session.execute(update(Adapter).where(Adapter.name == "a1").values(status=AdapterStatus.VALIDATING))
        session.commit()
    pending = client.post("/v1/chat/completions", json=body, headers=tenant)
    assert pending.status_code == 409, pending.text
    assert pending.json()["error"]["code"] == wire.ADAPTER_NOT_READY
    assert "validating" in pending.json()["error"]["message"]


def test_a_failed_adapter_counts_against_max_adapters_until_replaced_or_deleted(
    client: TestClient, tenant: dict[str, str], peft_dir: Path
) -> None:
    tenant_id = client.get("/admin/v1/tenants", headers=ADMIN).json()[0]["id"]
    client.put(f"/admin/v1/tenants/{tenant_id}/quota", json={"max_adapters": 1}, headers=ADMIN)
    assert upload(client, tenant, [("adapter_model.bin", b"pickle")], name="bad").status_code == 422
    other = upload(client, tenant, loose(peft_dir), name="good")
    assert other.status_code == 403 and "quota of 1 adapters" in other.json()["detail"]
    assert upload(client, tenant, loose(peft_dir), name="bad").status_code == 201  # replaces it
    assert client.delete("/api/v1/adapters/bad", headers=tenant).status_code == 204
    assert upload(client, tenant, [("adapter_model.bin", b"pickle")], name="bad").status_code == 422
    assert client.delete("/api/v1/adapters/bad", headers=tenant).status_code == 204  # a failed one too
    assert upload(client, tenant, loose(peft_dir), name="good").status_code == 201


def test_an_interrupted_upload_is_failed_by_the_sync_and_can_be_replaced(
    client: TestClient, tenant: dict[str, str], peft_dir: Path
) -> None:
    """A control plane that stopped mid-upload leaves the row UPLOADED or VALIDATING: once that is older
    than any upload takes, the sync fails it with a reason, and an upload under its name replaces it."""
    for name in ("stuck", "recent"):
        assert upload(client, tenant, loose(peft_dir), name=name).status_code == 201
    long_ago = dt.datetime.now(dt.UTC) - adapters_service.INTERRUPTED_AFTER - dt.timedelta(minutes=1)
    with client.app.state.db.session() as session:  # type: ignore[attr-defined]
        session.execute(
            update(Adapter).where(Adapter.name == "stuck").values(status="validating", created_at=long_ago)
        )
        session.execute(update(Adapter).where(Adapter.name == "recent").values(status="uploaded"))
        session.commit()
    # An upload in progress is not replaced (it may still finish): the name is taken.
    assert upload(client, tenant, loose(peft_dir), name="recent").status_code == 409

    sync = engine_sync_of(client.app)
    assert sync is not None
    client.portal.call(sync.run_pass)  # type: ignore[union-attr]
    stuck = client.get("/api/v1/adapters/stuck", headers=tenant).json()
    assert stuck["status"] == "failed" and stuck["error"] == adapters_service.INTERRUPTED
    assert client.get("/api/v1/adapters/recent", headers=tenant).json()["status"] == "uploaded"
    again = upload(client, tenant, loose(peft_dir), name="stuck")
    assert again.status_code == 201 and again.json()["status"] == "ready"


def test_the_sync_unregisters_only_gateway_names_whose_adapter_is_not_ready(
    client: TestClient, tenant: dict[str, str], peft_dir: Path
) -> None:
    ready = upload(client, tenant, loose(peft_dir), name="ready").json()["id"]
    failed = upload(client, tenant, loose(peft_dir), name="failed").json()["id"]
    with client.app.state.db.session() as session:  # type: ignore[attr-defined]
        assert adapters_service.mark_failed(session, adapter_row(client, "failed").id, "x") == 1
        deleted = uuid.uuid4()
        names = [
            wire.adapter_name(ready),
            wire.adapter_name(failed),
            wire.adapter_name(deleted),
            "id:not-a-uuid",
            "uppercase",  # given to the engine by a flag: not the gateway's to remove
        ]
        assert stale_names(session, names) == sorted(
            [wire.adapter_name(failed), wire.adapter_name(deleted), "id:not-a-uuid"]
        )
        # An engine holding more than one query's worth of ids: looked up in batches, the ready one last.
        many = [wire.adapter_name(uuid.uuid4()) for _ in range(engine_sync.ID_BATCH * 2 + 7)]
        assert stale_names(session, [*many, wire.adapter_name(ready)]) == sorted(many)


def test_the_console_shows_a_failed_adapter_with_its_reason_and_what_to_do(
    client: TestClient, peft_dir: Path
) -> None:
    app = client.app
    make_user(app, "ada@acme.test", tenant="acme")  # type: ignore[arg-type]
    assert sign_in(client, "ada@acme.test").status_code == 303
    Api(client).deployment("tiny", "tiny-llama", [], shape=SHAPE)
    token = CSRF.findall(client.get("/console/adapters").text)[0]
    refused = client.post(
        "/console/adapters",
        data={"name": "a1", "deployment": "tiny", "csrf_token": token},
        files=[("files", (FILES[0], (peft_dir / FILES[0]).read_bytes(), "application/json"))],
    )
    assert refused.status_code == 422
    row = re.search(r'<tr data-adapter="a1">.*?</tr>', client.get("/console/adapters").text, re.S)
    assert row is not None
    assert 'badge-failed">failed<' in row.group(0) and "adapter_model.safetensors is missing" in row.group(0)
    assert "Upload it again under this name to replace it." in row.group(0)
    assert "/console/playground?model=a1" not in row.group(0)  # nothing to try
    assert client.get("/console/adapters/status").json() == {"a1": "failed"}


def test_a_delete_never_waits_for_an_engine_that_does_not_answer(
    api: Api, client: TestClient, peft_dir: Path
) -> None:
    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        api.deployment("tiny", "tiny-llama", [f"http://127.0.0.1:{silent.getsockname()[1]}"], shape=SHAPE)
        _, headers = api.tenant_with_key("acme")
        assert upload(client, headers, loose(peft_dir)).status_code == 201
        started = time.monotonic()
        assert client.delete("/api/v1/adapters/a1", headers=headers).status_code == 204
        assert time.monotonic() - started < 2.0  # the engine is told in the background


# -- engines forget deleted adapters ------------------------------------------------------------------


@dataclass
class RegistryStub:
    """An engine's internal adapter endpoints, and nothing else: what it holds, what it was told."""

    names: list[str]
    not_ready: set[str] = field(default_factory=set)  # refused 503 not_ready, as a loading engine does
    deletes: list[str] = field(default_factory=list)
    token: str = ENGINE_INTERNAL_TOKEN

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get(wire.ADAPTERS_PATH)
        def listed(request: Request) -> Response:
            if request.headers.get(wire.INTERNAL_TOKEN_HEADER) != self.token:
                return JSONResponse(
                    wire.error_body("no", wire.INVALID_REQUEST, wire.INVALID_INTERNAL_TOKEN), 401
                )
            data = [{"name": n, "sha256": "0" * 64, "resident": True, "failed": None} for n in self.names]
            return JSONResponse({"object": "list", "data": data})

        @app.delete(wire.ADAPTERS_PATH + "/{name:path}")
        def forget(name: str) -> Response:
            self.deletes.append(name)
            if name in self.not_ready:
                return JSONResponse(wire.error_body("loading", wire.SERVER_ERROR, wire.NOT_READY), 503)
            if name not in self.names:
                return JSONResponse(wire.error_body("?", wire.INVALID_REQUEST, wire.ADAPTER_NOT_FOUND), 404)
            self.names.remove(name)
            return JSONResponse({"name": name, "deleted": True, "draining": False})

        return app


def test_a_delete_wakes_the_sync_and_every_replica_of_every_deployment_forgets_it(
    api: Api, client: TestClient, peft_dir: Path
) -> None:
    with contextlib.ExitStack() as stack:
        first, second = RegistryStub([]), RegistryStub([])
        first_url, second_url = (stack.enter_context(serve(stub.app())) for stub in (first, second))
        api.deployment("tiny", "tiny-llama", [first_url, second_url], shape=SHAPE)
        api.deployment("other", "tiny-other", [second_url], shape=SHAPE)  # listed once, asked once
        _, headers = api.tenant_with_key("acme")
        kept = wire.adapter_name(upload(client, headers, loose(peft_dir), name="kept").json()["id"])
        gone = wire.adapter_name(upload(client, headers, loose(peft_dir), name="gone").json()["id"])
        first.names[:] = [gone, kept, "uppercase"]  # "uppercase": given to the engine by a flag
        second.names[:] = [gone]  # it served the adapter before it moved

        assert client.delete("/api/v1/adapters/gone", headers=headers).status_code == 204
        # The test app's interval is 30 s: what happens now happens because the delete woke the sync.
        wait_for(
            lambda: first.names == [kept, "uppercase"] and second.names == [], "both replicas to forget it"
        )
        assert first.deletes == second.deletes == [gone]


def test_deleting_a_tenant_reaches_the_engines_too(api: Api, client: TestClient, peft_dir: Path) -> None:
    stub = RegistryStub([])
    with serve(stub.app()) as url:
        api.deployment("tiny", "tiny-llama", [url], shape=SHAPE)
        tenant, headers = api.tenant_with_key("acme")
        stub.names[:] = [wire.adapter_name(upload(client, headers, loose(peft_dir)).json()["id"])]
        assert client.delete(f"/admin/v1/tenants/{tenant['id']}", headers=ADMIN).status_code == 204
        wait_for(lambda: not stub.names, "the engine to forget the deleted tenant's adapter")


def test_a_delete_in_the_console_reaches_the_engines_too(client: TestClient, peft_dir: Path) -> None:
    make_user(client.app, "ada@acme.test", tenant="acme")  # type: ignore[arg-type]
    assert sign_in(client, "ada@acme.test").status_code == 303
    stub = RegistryStub([])
    with serve(stub.app()) as url:
        Api(client).deployment("tiny", "tiny-llama", [url], shape=SHAPE)
        token = CSRF.findall(client.get("/console/adapters").text)[0]
        made = client.post(
            "/console/adapters",
            data={"name": "a1", "deployment": "tiny", "csrf_token": token},
            files=[("files", (n, c, "application/octet-stream")) for n, c in loose(peft_dir)],
            headers={"accept": "application/json"},
        )
        assert made.status_code == 201, made.text
        stub.names[:] = [wire.adapter_name(adapter_row(client, "a1").id)]
        confirmed = {"confirm": "yes", "csrf_token": token}
        deleted = client.post("/console/adapters/a1/delete", data=confirmed, follow_redirects=False)
        assert deleted.status_code == 303
        wait_for(lambda: not stub.names, "the engine to be told by the console's delete")


def test_a_replica_that_refuses_for_now_is_asked_again_on_the_next_pass(
    api: Api, client: TestClient, peft_dir: Path
) -> None:
    with contextlib.ExitStack() as stack:
        busy, locked = RegistryStub([]), RegistryStub([], token="another-token")
        busy_url, locked_url = (stack.enter_context(serve(stub.app())) for stub in (busy, locked))
        api.deployment("tiny", "tiny-llama", [busy_url, locked_url], shape=SHAPE)
        _, headers = api.tenant_with_key("acme")
        name = wire.adapter_name(upload(client, headers, loose(peft_dir)).json()["id"])
        busy.names[:], busy.not_ready = [name], {name}
        locked.names[:] = [name]
        assert client.delete("/api/v1/adapters/a1", headers=headers).status_code == 204

        sync = engine_sync_of(client.app)
        assert sync is not None
        report = client.portal.call(sync.run_pass)  # type: ignore[union-attr]
        assert report.pending == {busy_url: [name]} and busy.names == [name]
        assert "401" in report.unreachable[locked_url]  # a control plane with the wrong token: said so
        busy.not_ready.clear()
        client.portal.call(sync.run_pass)  # type: ignore[union-attr]
        assert busy.names == [] and busy.deletes == [name] * len(busy.deletes) and len(busy.deletes) >= 2
        assert locked.names == [name] and locked.deletes == []  # it listed nothing to us: nothing sent


class SwitchableProxy:
    """A TCP port in front of an engine that can go down (connections refused) and come back on the same
    port, while the engine behind it keeps its state: a replica that is away for a while."""

    def __init__(self, target: str):
        host, port = target.removeprefix("http://").split(":")
        self.target = (host, int(port))
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._sock: socket.socket | None = None
        self._open: list[socket.socket] = []  # accepted connections: cut too when it goes down
        self.up()

    def up(self) -> None:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        sock.listen(64)
        self._sock = sock
        threading.Thread(target=self._accept, args=(sock,), daemon=True).start()

    def down(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        for client in self._open:  # kept-alive connections would still reach the engine
            with contextlib.suppress(OSError):
                client.shutdown(socket.SHUT_RDWR)
        self._open.clear()

    def _accept(self, sock: socket.socket) -> None:
        while True:
            try:
                client, _ = sock.accept()
            except OSError:
                return
            self._open.append(client)
            threading.Thread(target=forward, args=(client, self.target, 5), daemon=True).start()


@pytest.fixture(scope="module")
def engine_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The one artifact store directory the control planes write and the engine reads (as `loraplex up`)."""
    return tmp_path_factory.mktemp("lifecycle-store")


@pytest.fixture(scope="module")
def engine(engine_factory: Any, engine_store: Path) -> Iterator[Server]:
    with running_server(engine_factory, internal_token=TOKEN, adapter_store=str(engine_store)) as server:
        yield server


@pytest.fixture
def proxy(engine: Server) -> Iterator[SwitchableProxy]:
    replica = SwitchableProxy(engine.url)
    yield replica
    replica.down()


PlatformFactory = Callable[..., tuple[FastAPI, str, dict[str, str]]]


@pytest.fixture
def platform(
    pg_admin_url: str, pg_template: str, engine_store: Path, proxy: SwitchableProxy, tmp_path: Path
) -> Iterator[PlatformFactory]:
    """platform(**settings) -> (app, url, tenant headers): a control plane served on a port, on its own
    Postgres database, with deployment `smol` served by the engine behind `proxy`."""
    databases: list[str] = []
    with contextlib.ExitStack() as stack:

        def make(**overrides: Any) -> tuple[FastAPI, str, dict[str, str]]:
            name = f"lpx_life_{uuid.uuid4().hex[:8]}"
            _admin_sql(pg_admin_url, f'CREATE DATABASE "{name}" TEMPLATE "{pg_template}"')
            databases.append(name)
            settings = make_settings(
                _with_database(pg_admin_url, name), tmp_path, adapter_store=str(engine_store), **overrides
            )
            app = create_app(settings)
            url = stack.enter_context(serve(app))
            made = httpx.post(
                f"{url}/admin/v1/deployments",
                json={"name": "smol", "base_model": BASE_MODEL, "endpoints": [proxy.url]},
                headers=ADMIN,
            )
            assert made.status_code == 201, made.text
            tenant = httpx.post(f"{url}/admin/v1/tenants", json={"name": "acme"}, headers=ADMIN).json()
            key = httpx.post(f"{url}/admin/v1/tenants/{tenant['id']}/keys", json={"name": "k"}, headers=ADMIN)
            return app, url, {"Authorization": f"Bearer {key.json()['key']}"}

        yield make
    for name in databases:
        _admin_sql(pg_admin_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def upload_demo(url: str, headers: dict[str, str], name: str = "shout") -> dict[str, Any]:
    files = [("files", (n, (DEMO / n).read_bytes(), "application/octet-stream")) for n in FILES]
    response = httpx.post(
        f"{url}/api/v1/adapters", data={"name": name, "deployment": "smol"}, files=files, headers=headers
    )
    assert response.status_code == 201, response.text
    return dict(response.json())


def registered(engine: Server) -> dict[str, dict[str, Any]]:
    listed = httpx.get(f"{engine.url}{wire.ADAPTERS_PATH}", headers={wire.INTERNAL_TOKEN_HEADER: TOKEN})
    assert listed.status_code == 200, listed.text
    return {entry["name"]: entry for entry in listed.json()["data"]}


def adapter_pages(engine: Server) -> float:
    return engine.sample("loraplex_pool_pages", 'kind="adapter"')


def host_cache_bytes(engine: Server) -> float:
    return engine.sample("loraplex_adapter_host_cache_bytes")


def chat(url: str, headers: dict[str, str], model: str) -> str:
    client = OpenAI(base_url=f"{url}/v1", api_key=headers["Authorization"][7:], max_retries=0, timeout=120)
    answer = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=8, temperature=0)
    return answer.choices[0].message.content or ""


def serve_with_the_demo_adapter(engine: Server, url: str, headers: dict[str, str]) -> str:
    """Upload the demo adapter, serve a request with it (the engine registers and loads it); its name."""
    adapter = upload_demo(url, headers)
    assert chat(url, headers, "shout")
    name = wire.adapter_name(adapter["id"])
    engine.wait_idle()
    assert name in registered(engine) and registered(engine)[name]["resident"]
    assert adapter_pages(engine) > 0 and host_cache_bytes(engine) > 0
    return name


def forgotten(engine: Server, name: str) -> bool:
    return name not in registered(engine) and adapter_pages(engine) == 0 and host_cache_bytes(engine) == 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_deleted_adapter_is_forgotten_by_the_engine_and_refused_by_the_gateway(
    engine: Server, platform: PlatformFactory
) -> None:
    # An hour between passes: what the engine forgets here, it forgets because the delete woke the sync.
    _, url, headers = platform(engine_sync_interval_s=3600)
    name = serve_with_the_demo_adapter(engine, url, headers)

    assert httpx.delete(f"{url}/api/v1/adapters/shout", headers=headers).status_code == 204
    wait_for(lambda: forgotten(engine, name), "the engine to forget the deleted adapter")
    client = OpenAI(base_url=f"{url}/v1", api_key=headers["Authorization"][7:], max_retries=0)
    with pytest.raises(NotFoundError) as missing:
        client.chat.completions.create(model="shout", messages=QUESTION, max_tokens=4)
    assert "shout" in missing.value.message and missing.value.code == "model_not_found"

    # Uploaded again, it is a new adapter: served, and registered under its new id.
    again = upload_demo(url, headers)
    assert chat(url, headers, "shout")
    assert set(registered(engine)) == {wire.adapter_name(again["id"])}
    assert httpx.delete(f"{url}/api/v1/adapters/shout", headers=headers).status_code == 204
    wait_for(lambda: forgotten(engine, wire.adapter_name(again["id"])), "the engine to forget it again")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_request_running_when_its_adapter_is_deleted_finishes_then_the_engine_forgets_it(
    engine: Server, platform: PlatformFactory
) -> None:
    _, url, headers = platform(engine_sync_interval_s=3600)
    name = serve_with_the_demo_adapter(engine, url, headers)
    client = OpenAI(base_url=f"{url}/v1", api_key=headers["Authorization"][7:], max_retries=0, timeout=120)
    stream = client.chat.completions.create(
        model="shout", messages=QUESTION, max_tokens=48, temperature=0, stream=True
    )
    chunks = iter(stream)
    first = next(chunks)
    assert first.choices
    assert httpx.delete(f"{url}/api/v1/adapters/shout", headers=headers).status_code == 204
    rest = list(chunks)
    finished = [c.choices[0].finish_reason for c in rest if c.choices and c.choices[0].finish_reason]
    assert finished == ["length"], finished  # served to its end with the adapter it started with
    wait_for(lambda: forgotten(engine, name), "the engine to forget the adapter once its request ended")
    usage = wait_for(
        lambda: [r for r in httpx.get(f"{url}/api/v1/usage", headers=headers).json()["rows"]],
        "the usage of both requests",
    )
    assert sum(r["requests"] for r in usage if r["model"] == "shout") == 2


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_replica_down_during_the_delete_is_cleaned_by_the_sync_once_it_is_back(
    engine: Server, proxy: SwitchableProxy, platform: PlatformFactory
) -> None:
    app, url, headers = platform(engine_sync_interval_s=0.3)
    sync = engine_sync_of(app)
    assert sync is not None
    name = serve_with_the_demo_adapter(engine, url, headers)

    proxy.down()
    assert httpx.delete(f"{url}/api/v1/adapters/shout", headers=headers).status_code == 204
    # Passes run and cannot reach the replica; the engine (still up behind it) keeps the adapter.
    after_delete = sync.passes
    wait_for(
        lambda: sync.passes >= after_delete + 2 and sync.last and proxy.url in sync.last.unreachable,
        "two sync passes that cannot reach the replica",
    )
    assert name in registered(engine) and adapter_pages(engine) > 0

    proxy.up()
    wait_for(lambda: forgotten(engine, name), "the sync to clean the replica once it is back")
    assert sync.last is not None and proxy.url not in sync.last.unreachable


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_adapter_the_engine_refuses_is_failed_with_its_reason_until_uploaded_again(
    engine: Server, platform: PlatformFactory, engine_store: Path
) -> None:
    """The engine checks the digest of what it fetches: damaged bytes in the store are adapter_failed,
    which fails the adapter with the engine's reason; uploading it again stores good bytes and clears it."""
    app, url, headers = platform(engine_sync_interval_s=3600)
    adapter = upload_demo(url, headers)
    store = app.state.store
    assert isinstance(store, LocalArtifactStore)
    weights = store.path_of(store.uri_of(adapter["sha256"])) / FILES[1]
    damaged = bytearray(weights.read_bytes())
    damaged[-1] ^= 0xFF
    weights.write_bytes(bytes(damaged))

    with pytest.raises(UnprocessableEntityError) as refused:
        chat(url, headers, "shout")
    assert refused.value.code == wire.ADAPTER_FAILED
    row = httpx.get(f"{url}/api/v1/adapters/shout", headers=headers).json()
    assert row["status"] == "failed" and "digest" in row["error"], row
    assert row["error"] in refused.value.message
    with pytest.raises(UnprocessableEntityError) as not_served:  # not routed any more, and says why
        chat(url, headers, "shout")
    assert not_served.value.code == wire.ADAPTER_FAILED and row["error"] in not_served.value.message
    wait_for(lambda: forgotten(engine, wire.adapter_name(adapter["id"])), "the engine to drop it")

    replaced = upload_demo(url, headers)
    assert replaced["status"] == "ready" and replaced["error"] is None
    assert chat(url, headers, "shout")
    assert httpx.delete(f"{url}/api/v1/adapters/shout", headers=headers).status_code == 204
    wait_for(lambda: forgotten(engine, wire.adapter_name(replaced["id"])), "the engine to forget it")

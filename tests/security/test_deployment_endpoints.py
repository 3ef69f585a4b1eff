# ruff: noqa: F811  (the fixtures imported from tests/web/conftest come back as test parameters)
"""The internal token goes only to engines: never to a metadata service, a URL's userinfo, loopback on a
cluster, or a pod that merely carries the engine's labels.

Before (issue 29, item 8): a deployment endpoint could be `http://169.254.169.254`, its decimal or IPv6
spellings, `metadata.google.internal`, `http://user:pw@host` or the control plane's own loopback, and
engine sync then sent the global internal token there every pass; discovery routed tenants' requests,
token included, to any Ready pod labelled `app.kubernetes.io/name=loraplex-engine` in the namespace.
Now: web/services/endpoint_policy.py refuses such endpoints at the admin API and the console (loopback only
with LORAPLEX_ALLOW_LOOPBACK_ENDPOINTS, which `loraplex up` sets), engine sync skips rows written before,
and discovery counts a pod only when its owner chain ends at the InferenceDeployment
(web/services/pod_owners.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from loraplex.operator.resources import child_name
from loraplex.operator.spec import parse
from loraplex.web.db.models import Deployment
from loraplex.web.services.discovery import Discovery
from loraplex.web.services.routing import Router
from tests.operator.cluster import wait_for
from tests.operator.helpers import body as cr_body
from tests.web.conftest import (  # noqa: F401  (fixtures)
    ADMIN,
    SHAPE,
    app_factory,
    sqlite_template,
    sqlite_url,
)
from tests.web.servers import serve
from tests.web.test_discovery import NS, ApiServer, apiserver  # noqa: F401  (fixture)

TOKEN = "internal-test-token"  # make_settings' internal token
NEVER = [
    ("http://169.254.169.254", "link-local"),
    ("http://169.254.169.254:80/latest", "link-local"),
    ("http://2852039166", "link-local"),  # 169.254.169.254 as one number
    ("http://0xa9fea9fe", "link-local"),
    ("http://[::ffff:169.254.169.254]", "link-local"),
    ("http://[fe80::1]:8000", "link-local"),
    ("http://[fd00:ec2::254]", "metadata"),
    ("http://168.63.129.16", "metadata"),
    ("http://100.100.100.200", "metadata"),
    ("http://metadata.google.internal", "metadata"),
    ("http://METADATA.google.internal.", "metadata"),
    ("http://user:secret@engine.example.com:8000", "userinfo"),
    ("http://engine.example.com@169.254.169.254", "userinfo"),
]
LOOPBACK = ["http://127.0.0.1:8000", "http://127.1:8000", "http://localhost:8000", "http://[::1]:8000",
            "http://0.0.0.0:8000", "http://engine.localhost:8000"]  # fmt: skip


@pytest.fixture
def make_client(sqlite_url: str, app_factory: Callable[..., FastAPI]) -> Iterator[Callable[..., TestClient]]:
    clients: list[TestClient] = []

    def make(loopback: bool) -> TestClient:
        client = TestClient(app_factory(sqlite_url, allow_loopback_endpoints=loopback))
        clients.append(client.__enter__())
        return client

    yield make
    for client in clients:
        client.__exit__(None, None, None)


def create(client: TestClient, name: str, endpoint: str) -> Any:
    body = {"name": name, "base_model": "tiny", "endpoints": [endpoint], "shape": SHAPE}
    return client.post("/admin/v1/deployments", json=body, headers=ADMIN)


@pytest.mark.parametrize(("endpoint", "words"), NEVER, ids=[e for e, _ in NEVER])
def test_metadata_link_local_and_userinfo_endpoints_are_refused(
    make_client: Callable[..., TestClient], endpoint: str, words: str
) -> None:
    client = make_client(loopback=True)  # refused even where loopback is permitted
    refused = create(client, "d", endpoint)
    assert refused.status_code == 422, refused.text
    assert words in refused.text and refused.json()["detail"][0]["loc"] == ["body", "endpoints", 0]
    assert create(client, "d", "http://10.0.0.7:8000").status_code == 201
    moved = client.patch("/admin/v1/deployments/d", json={"endpoints": [endpoint]}, headers=ADMIN)
    assert moved.status_code == 422, moved.text
    assert client.get("/admin/v1/deployments/d", headers=ADMIN).json()["endpoints"] == [
        "http://10.0.0.7:8000"
    ]


@pytest.mark.parametrize("endpoint", LOOPBACK)
def test_loopback_is_for_one_machine_only(make_client: Callable[..., TestClient], endpoint: str) -> None:
    cluster = make_client(loopback=False)
    refused = create(cluster, "d", endpoint)
    assert refused.status_code == 422 and "LORAPLEX_ALLOW_LOOPBACK_ENDPOINTS" in refused.text, refused.text
    assert create(cluster, "d", "http://10.0.0.7:8000").status_code == 201
    moved = cluster.patch("/admin/v1/deployments/d", json={"endpoints": [endpoint]}, headers=ADMIN)
    assert moved.status_code == 422
    one_machine = make_client(loopback=True)  # `loraplex up`
    assert create(one_machine, "e", endpoint).status_code == 201


def test_the_console_form_refuses_them_too(make_client: Callable[..., TestClient]) -> None:
    from loraplex.web.db.models import UserRole
    from tests.web.console_client import make_user, post_form, sign_in

    client = make_client(loopback=False)
    make_user(client.app, "admin@example.com", UserRole.ADMIN)  # type: ignore[arg-type]
    assert sign_in(client, "admin@example.com").status_code == 303
    path = "/console/admin/deployments"
    for endpoint in ("http://169.254.169.254", "http://127.0.0.1:8000"):
        form = {"name": "d", "base_model": "smollm2-135m", "endpoints": endpoint}
        page = post_form(client, path, path, form)
        assert page.status_code == 422, page.text
    assert client.get("/admin/v1/deployments", headers=ADMIN).json() == []


def test_engine_sync_sends_the_token_only_where_it_may(make_client: Callable[..., TestClient]) -> None:
    """A row written before endpoints were checked (here: straight into the database) is skipped."""
    seen: list[str | None] = []
    listener = FastAPI()

    @listener.get("/internal/adapters")
    def adapters(request: Request) -> dict[str, list[Any]]:
        seen.append(request.headers.get("x-loraplex-internal-token"))
        return {"data": []}

    with serve(listener) as url:
        for loopback in (False, True):
            client = make_client(loopback=loopback)
            db = client.app.state.db  # type: ignore[attr-defined]
            with db.session() as session:
                if session.query(Deployment).count() == 0:
                    session.add(Deployment(name="old", base_model="tiny", endpoints=[url], **_shape()))
                    session.commit()
            sync = client.app.state.engine_sync  # type: ignore[attr-defined]
            report = client.portal.call(sync.run_pass)  # type: ignore[union-attr]
            if not loopback:
                assert seen == [] and report.reached == [], "the token went to a loopback endpoint"
        assert seen == [TOKEN]  # with loopback permitted (one machine) the same row is synced


def _shape() -> dict[str, int]:
    return {k: int(v) for k, v in SHAPE.items()}


# --- discovery: the InferenceDeployment's own pods only ----------------------------------------------------


def test_discovery_routes_only_to_the_inference_deployments_own_pods(apiserver: ApiServer) -> None:
    found = Discovery("on", watch_timeout_s=30.0, backoff_s=(0.05, 0.2))
    found.start()
    try:
        router = Router(cooldown_s=60.0, discovery=found)
        target = f"kubernetes://{NS}/smol"
        apiserver.pod("smol-owned", "10.0.0.1", ready=True)
        # Labelled as smol's engine, made by hand: no owner at all.
        apiserver.pod("smol-labelled", "10.0.0.66", ready=True, owned=False)
        # Labelled as smol's engine, made by another Deployment (one its author may create).
        rogue = apiserver.create(
            f"/apis/apps/v1/namespaces/{NS}/deployments",
            {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "rogue"}, "spec": {}},
        )
        rogue_rs = apiserver.create(
            f"/apis/apps/v1/namespaces/{NS}/replicasets",
            {"apiVersion": "apps/v1", "kind": "ReplicaSet",
             "metadata": {"name": "rogue-1", "ownerReferences": [_owner(rogue)]}, "spec": {}},
        )  # fmt: skip
        apiserver.pod("smol-rogue", "10.0.0.67", ready=True, ownerReferences=[_owner(rogue_rs)])
        wait_for(lambda: len(found.replicas(target) or []) == 3, timeout=10.0, interval=0.02, what="3 pods")
        assert router.order("adapter:x", [target]) == ["http://10.0.0.1:8000"]
        details = {r.pod: r.detail for r in found.replicas(target) or []}
        assert "no controller ownerReference" in details["smol-labelled"]
        assert "is not the Deployment smol-engine's" in details["smol-rogue"]
    finally:
        found.stop()


def test_a_deployment_of_the_right_name_needs_the_inference_deployment_as_owner(apiserver: ApiServer) -> None:
    found = Discovery("on", watch_timeout_s=30.0, backoff_s=(0.05, 0.2))
    found.start()
    try:
        target = f"kubernetes://{NS}/orphan"
        deployment = apiserver.create(
            f"/apis/apps/v1/namespaces/{NS}/deployments",
            {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "metadata": {"name": "orphan-engine"},
                "spec": {},
            },
        )
        replica_set = apiserver.create(
            f"/apis/apps/v1/namespaces/{NS}/replicasets",
            {"apiVersion": "apps/v1", "kind": "ReplicaSet",
             "metadata": {"name": "orphan-engine-1", "ownerReferences": [_owner(deployment)]}, "spec": {}},
        )  # fmt: skip
        labels = {"app.kubernetes.io/name": "loraplex-engine", "app.kubernetes.io/instance": "orphan"}
        apiserver.pod(
            "orphan-1", "10.0.0.9", ready=True, labels=labels, ownerReferences=[_owner(replica_set)]
        )
        wait_for(lambda: found.replicas(target), timeout=10.0, interval=0.02, what="the pod listed")
        (replica,) = found.replicas(target) or []
        assert not replica.ready and "not the InferenceDeployment orphan's" in replica.detail
    finally:
        found.stop()


def test_an_owner_check_the_api_server_cannot_answer_is_asked_again(
    apiserver: ApiServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fail closed, but not for good: a Ready pod may send no further event to wait for."""
    from loraplex.web.services.pod_owners import EngineOwners

    answering = threading.Event()
    read = EngineOwners._read
    refused: list[int] = []

    def busy_until_told(self: EngineOwners, *args: Any) -> Any:
        if not answering.is_set():
            refused.append(1)
            raise TimeoutError("the API server is busy")
        return read(self, *args)

    monkeypatch.setattr(EngineOwners, "_read", busy_until_told)
    target = f"kubernetes://{NS}/smol"
    apiserver.pod("smol-0", "10.0.0.1", ready=True)
    found = Discovery("on", watch_timeout_s=30.0, backoff_s=(0.05, 0.2))
    found.start([target])  # followed from the start, as the app does for its deployments
    try:
        wait_for(lambda: len(refused) >= 3, timeout=10.0, interval=0.02, what="three checks refused")
        (replica,) = found.replicas(target) or []
        assert not replica.ready and "cannot be checked now" in replica.detail
        answering.set()  # no new event for the pod: only the retry can let it in
        wait_for(lambda: found.expand([target]) == ["http://10.0.0.1:8000"], timeout=10.0, what="retried")
    finally:
        found.stop()


def test_the_deployment_name_discovery_expects_is_the_operators() -> None:
    from loraplex.web.services.pod_owners import DEPLOYMENT_SUFFIX

    idep = parse(cr_body())
    assert child_name(idep) == idep.name + DEPLOYMENT_SUFFIX


def _owner(obj: dict[str, Any]) -> dict[str, Any]:
    meta = obj["metadata"]
    return {"apiVersion": obj["apiVersion"], "kind": obj["kind"], "name": meta["name"], "uid": meta["uid"],
            "controller": True}  # fmt: skip

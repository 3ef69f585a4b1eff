"""Replica discovery against a real HTTP API server (the strict kmock emulator), and affinity routing.

Pods are created, turned ready and not ready, deleted (with and without a finalizer) through the API
server; the router's ready set must follow. The watch is broken mid-stream, expired with 410 Gone, and
ended by the server's timeout; the first two must re-LIST, the last must resume without one.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import attrs
import kmock
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from kmock._internal import rendering

from loraplex.web.db.models import UserRole
from loraplex.web.services.discovery import (
    Discovery,
    KubernetesUnavailable,
    PodWatch,
    parse_target,
    replica_of,
)
from loraplex.web.services.routing import Router, rendezvous_order
from tests.operator.apiserver import StrictApiServer
from tests.operator.cluster import wait_for

from .conftest import ADMIN
from .console_client import make_user, sign_in

T = TypeVar("T")
NS = "team-a"
LABELS = {"app.kubernetes.io/name": "loraplex-engine", "app.kubernetes.io/instance": "smol"}
TARGET = f"kubernetes://{NS}/smol"


@attrs.define(kw_only=True)
class FlakyApiServer(StrictApiServer):
    """The strict emulator, plus the two ways a real watch ends badly, on demand."""

    watches: int = attrs.field(default=0, init=False)
    gone_next: bool = attrs.field(default=False, init=False)
    break_next: bool = attrs.field(default=False, init=False)

    async def _serve_watch(self, request: rendering.Request) -> Any:
        self.watches += 1
        if self.gone_next:
            self.gone_next = False
            yield b""
            yield {
                "type": "ERROR",
                "object": {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 410,
                           "reason": "Expired", "message": "too old resource version"},
            }  # fmt: skip
            return
        async for item in super()._serve_watch(request):
            if self.break_next and item != b"":
                self.break_next = False
                # Cut the TCP connection mid-stream, as a dying API server or a proxy would.
                assert request._raw_request is not None
                transport = request._raw_request.transport
                assert transport is not None
                transport.abort()
                return
            yield item


class ApiServer:
    """The emulator on 127.0.0.1 in its own thread and loop; the test drives it with sync calls."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="apiserver", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self.run(self._start())

    async def _start(self) -> None:
        self.api = FlakyApiServer()
        self.api.declare("v1/pods", "Pod", ())
        # The owner chain discovery checks (web/services/pod_owners.py), as the operator and the
        # Deployment and ReplicaSet controllers make it.
        self.api.declare("apps/v1/replicasets", "ReplicaSet", ())
        self.api.declare("apps/v1/deployments", "Deployment", ())
        self.api.declare("loraplex.dev/v1alpha1/inferencedeployments", "InferenceDeployment", ())
        self._replica_sets: dict[str, dict[str, Any]] = {}
        await self.api.__aenter__()
        self.server = kmock.Server(self.api)
        await self.server.__aenter__()
        self.url = str(self.server.url).rstrip("/")
        self.http = aiohttp.ClientSession()

    def stop(self) -> None:
        try:
            self.run(self._stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)

    async def _stop(self) -> None:
        await self.http.close()
        # The control plane's pod WATCH may still be open: ended here, or the server's exit waits for it
        # (a teardown timed out at 20 s under load).
        self.api.close_watches()
        await self.server.__aexit__(None, None, None)
        await self.api.__aexit__(None, None, None)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 20) -> T:
        future: Future[T] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result(timeout=timeout)

    async def _request(self, method: str, path: str, body: Any = None) -> Any:
        headers = {
            "Content-Type": "application/merge-patch+json" if method == "PATCH" else "application/json"
        }
        data = None if body is None else json.dumps(body)
        async with self.http.request(method, self.url + path, data=data, headers=headers) as resp:
            payload = await resp.json(content_type=None)
            assert resp.status < 300, f"{method} {path}: {resp.status} {payload}"
            return payload

    def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return dict(self.run(self._request("POST", path, body)))

    def replica_set(self, instance: str = "smol") -> dict[str, Any]:
        """The ReplicaSet of InferenceDeployment `instance`'s Deployment, made with its owners on first use:
        the chain a real cluster has above every engine pod."""
        if instance not in self._replica_sets:
            idep = self.create(
                f"/apis/loraplex.dev/v1alpha1/namespaces/{NS}/inferencedeployments",
                {"apiVersion": "loraplex.dev/v1alpha1", "kind": "InferenceDeployment",
                 "metadata": {"name": instance}, "spec": {}},
            )  # fmt: skip
            deployment = self.create(
                f"/apis/apps/v1/namespaces/{NS}/deployments",
                {"apiVersion": "apps/v1", "kind": "Deployment",
                 "metadata": {"name": f"{instance}-engine", "ownerReferences": [owner_reference(idep)]},
                 "spec": {}},
            )  # fmt: skip
            self._replica_sets[instance] = self.create(
                f"/apis/apps/v1/namespaces/{NS}/replicasets",
                {"apiVersion": "apps/v1", "kind": "ReplicaSet",
                 "metadata": {"name": f"{instance}-engine-5d8f",
                              "ownerReferences": [owner_reference(deployment)]},
                 "spec": {}},
            )  # fmt: skip
        return self._replica_sets[instance]

    def pod(
        self,
        name: str,
        ip: str | None,
        ready: bool,
        labels: dict[str, str] = LABELS,
        port: int | None = None,
        owned: bool = True,
        **meta: Any,
    ) -> None:
        """An engine pod; `owned` (the default) gives it the ReplicaSet of its instance as a real one has."""
        if owned and "ownerReferences" not in meta:
            instance = labels["app.kubernetes.io/instance"]
            meta["ownerReferences"] = [owner_reference(self.replica_set(instance))]
        status: dict[str, Any] = {"conditions": [{"type": "Ready", "status": str(ready)}]}
        if ip:
            status["podIP"] = ip
        ports = [{"name": "metrics", "containerPort": 9090}]
        if port is not None:  # the operator names the engine's port "http"; without one it is 8000
            ports.append({"name": "http", "containerPort": port})
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "labels": labels, **meta},
            "spec": {"containers": [{"name": "engine", "image": "loraplex", "ports": ports}]},
            "status": status,
        }
        self.run(self._request("POST", f"/api/v1/namespaces/{NS}/pods", body))

    def set_ready(self, name: str, ready: bool) -> None:
        patch = {"status": {"conditions": [{"type": "Ready", "status": str(ready), "reason": "ProbeFailed"}]}}
        self.run(self._request("PATCH", f"/api/v1/namespaces/{NS}/pods/{name}", patch))

    def patch(self, name: str, patch: dict[str, Any]) -> None:
        self.run(self._request("PATCH", f"/api/v1/namespaces/{NS}/pods/{name}", patch))

    def delete(self, name: str) -> None:
        self.run(self._request("DELETE", f"/api/v1/namespaces/{NS}/pods/{name}"))

    def write_kubeconfig(self, path: Path) -> Path:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "tester", "user": {"token": "fake-token"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "tester"}}],
            "current-context": "fake",
        }
        path.write_text(json.dumps(config))
        return path


@pytest.fixture
def apiserver(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ApiServer]:
    server = ApiServer()
    server.start()
    monkeypatch.setenv("KUBECONFIG", str(server.write_kubeconfig(tmp_path / "kubeconfig")))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def discovery(apiserver: ApiServer) -> Iterator[Discovery]:
    found = Discovery("on", watch_timeout_s=30.0, backoff_s=(0.05, 0.2))
    found.start()
    try:
        yield found
    finally:
        found.stop()


def owner_reference(owner: dict[str, Any]) -> dict[str, Any]:
    meta = owner["metadata"]
    return {"apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": meta["name"],
            "uid": meta["uid"], "controller": True, "blockOwnerDeletion": True}  # fmt: skip


def ready_set(router: Router) -> Callable[[], set[str]]:
    return lambda: set(router.order("adapter:x", [TARGET]))


def settle(check: Callable[[], object], what: str) -> None:
    wait_for(check, timeout=10.0, interval=0.02, what=what)


# --- pure parts ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "endpoint",
    [
        "kubernetes://default/smol",
        "kubernetes://a/b",
        f"kubernetes://{'n' * 63}/{'d' * 63}",
        "kubernetes://team-1/smol-2",
    ],
)
def test_well_formed_targets_parse(endpoint: str) -> None:
    target = parse_target(endpoint)
    assert target.uri == endpoint
    assert target.selector.endswith(f"app.kubernetes.io/instance={target.name}")


@pytest.mark.parametrize(
    "endpoint",
    [
        "kubernetes://",
        "kubernetes://default",
        "kubernetes://default/",
        "kubernetes://default/smol/",
        "kubernetes://default/smol/extra",
        "kubernetes://Default/smol",
        "kubernetes://default/smol?x=1",
        "kubernetes://-a/smol",
        "kubernetes://default/smol-",
        f"kubernetes://default/{'d' * 64}",
        "kubernetes://default/sm\u00f6l",
        "kubernetes://default/smol\n",
        "kubernetes://" + "a" * 100_000,
    ],
)
def test_malformed_targets_are_refused(endpoint: str) -> None:
    with pytest.raises(ValueError, match="kubernetes://"):
        parse_target(endpoint)


def test_a_long_hostile_target_is_refused_in_linear_time() -> None:
    started = time.perf_counter()
    for _ in range(100):
        with pytest.raises(ValueError):
            parse_target("kubernetes://" + "a-" * 30 + "/" + "a-" * 5000 + "!")
    assert time.perf_counter() - started < 1.0


def test_readiness_needs_the_condition_an_ip_and_no_deletion() -> None:
    def pod(**status: Any) -> dict[str, Any]:
        meta = {"name": "p", **status.pop("meta", {})}
        return {"metadata": meta, "status": status}

    ready = [{"type": "Ready", "status": "True"}]
    assert replica_of(pod(podIP="10.0.0.1", conditions=ready)).endpoint == "http://10.0.0.1:8000"
    assert replica_of(pod(podIP="10.0.0.1", conditions=ready)).ready
    assert replica_of(pod(podIP="fd00::1", conditions=ready)).endpoint == "http://[fd00::1]:8000"
    assert not replica_of(pod(conditions=ready)).ready
    assert replica_of(pod(conditions=ready)).detail == "no pod IP yet"
    not_ready = replica_of(pod(podIP="10.0.0.1", conditions=[{"type": "Ready", "status": "False"}]))
    assert not not_ready.ready and "not ready" in not_ready.detail
    assert not replica_of(pod(podIP="10.0.0.1", conditions=[{"type": "Initialized", "status": "True"}])).ready
    assert not replica_of(pod(podIP="10.0.0.1")).ready
    going = replica_of(
        pod(podIP="10.0.0.1", conditions=ready, meta={"deletionTimestamp": "2026-01-01T00:00:00Z"})
    )
    assert not going.ready and going.detail == "terminating"
    assert going.leaving  # still serving through its preStop: it may hand its adapters over
    gone = replica_of(
        pod(
            podIP="10.0.0.1",
            conditions=[{"type": "Ready", "status": "False"}],
            meta={"deletionTimestamp": "2026-01-01T00:00:00Z"},
        )
    )
    assert not gone.ready and not gone.leaving


def test_when_a_replica_goes_only_its_adapters_move() -> None:
    replicas = [f"http://10.0.0.{i}:8000" for i in range(1, 6)]
    keys = [f"adapter:{i:064x}" for i in range(2000)]
    before = {k: rendezvous_order(k, replicas)[0] for k in keys}
    gone = replicas[2]
    after = {k: rendezvous_order(k, [r for r in replicas if r != gone])[0] for k in keys}
    moved = {k for k in keys if before[k] != after[k]}
    assert moved == {k for k in keys if before[k] == gone}
    assert 0.1 < len(moved) / len(keys) < 0.3  # about a fifth: the hash spreads the adapters
    # A new replica takes adapters only for itself, from every other one.
    grown = [*replicas, "http://10.0.0.9:8000"]
    for k in keys:
        first = rendezvous_order(k, grown)[0]
        assert first in (before[k], "http://10.0.0.9:8000")


def test_static_endpoints_route_without_discovery() -> None:
    router = Router(cooldown_s=60.0)
    static = ["http://a:8000", "http://b:8000"]
    assert router.order("adapter:1", [*static, TARGET]) == rendezvous_order("adapter:1", static)
    router.mark_down(rendezvous_order("adapter:1", static)[0])
    assert router.order("adapter:1", static) == rendezvous_order("adapter:1", static)[::-1]


def test_cooldown_table_stays_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    from loraplex.web.services import routing

    monkeypatch.setattr(routing, "MAX_COOLDOWN_ENTRIES", 10)
    router = Router(cooldown_s=0.0)
    for i in range(100):
        router.mark_down(f"http://10.0.{i}.1:8000")
    assert len(router._down_until) <= 11


# --- against the API server ------------------------------------------------------------------------------


def test_router_follows_pods_as_they_come_and_go(apiserver: ApiServer, discovery: Discovery) -> None:
    apiserver.pod("smol-0", "10.0.0.1", ready=True)
    apiserver.pod("smol-1", "10.0.0.2", ready=False)
    apiserver.pod("other-0", "10.0.9.9", ready=True, labels={**LABELS, "app.kubernetes.io/instance": "other"})
    router = Router(cooldown_s=60.0, discovery=discovery)
    current = ready_set(router)
    settle(lambda: current() == {"http://10.0.0.1:8000"}, "the one ready pod of smol (not other's)")

    apiserver.set_ready("smol-1", True)
    settle(lambda: current() == {"http://10.0.0.1:8000", "http://10.0.0.2:8000"}, "smol-1 turning ready")
    apiserver.pod("smol-2", None, ready=False)
    apiserver.patch(
        "smol-2", {"status": {"podIP": "10.0.0.3", "conditions": [{"type": "Ready", "status": "True"}]}}
    )
    settle(lambda: len(current()) == 3, "smol-2 scheduled and ready")

    key = "adapter:" + "ab" * 32
    holder = router.order(key, [TARGET])[0]
    holder_pod = {"http://10.0.0.1:8000": "smol-0", "http://10.0.0.2:8000": "smol-1"}.get(holder, "smol-2")
    apiserver.set_ready(holder_pod, False)
    settle(lambda: holder not in current(), "the adapter's pod leaving the ready set")
    assert router.order(key, [TARGET])[0] == rendezvous_order(key, sorted(current()))[0]
    apiserver.set_ready(holder_pod, True)
    settle(lambda: router.order(key, [TARGET])[0] == holder, "the adapter going back to its pod")

    apiserver.delete("smol-0")
    settle(lambda: "http://10.0.0.1:8000" not in current(), "a deleted pod leaving")
    # A pod with a finalizer lingers with a deletionTimestamp: it must stop getting requests at once.
    apiserver.pod("smol-3", "10.0.0.4", ready=True, finalizers=["test/keep"])
    settle(lambda: "http://10.0.0.4:8000" in current(), "smol-3 ready")
    apiserver.delete("smol-3")
    settle(lambda: "http://10.0.0.4:8000" not in current(), "a terminating pod leaving the ready set")
    pods = {r.pod: r for r in discovery.replicas(TARGET) or []}
    assert pods["smol-3"].detail == "terminating"
    assert "smol-0" not in pods


def test_a_broken_watch_lists_again(apiserver: ApiServer, discovery: Discovery) -> None:
    apiserver.pod("smol-0", "10.0.0.1", ready=True)
    router = Router(cooldown_s=60.0, discovery=discovery)
    settle(lambda: ready_set(router)() == {"http://10.0.0.1:8000"}, "the first pod")
    watch = discovery.follow(parse_target(TARGET))
    assert watch is not None and watch.lists == 1
    apiserver.api.break_next = True
    apiserver.pod("smol-1", "10.0.0.2", ready=True)  # the event that breaks the stream instead of arriving
    settle(lambda: watch.lists >= 2, "a second LIST after the broken watch")
    settle(lambda: len(ready_set(router)()) == 2, "the pod created while the watch broke")
    apiserver.delete("smol-0")
    settle(lambda: ready_set(router)() == {"http://10.0.0.2:8000"}, "watching again after the LIST")


def test_410_gone_lists_again(apiserver: ApiServer, discovery: Discovery) -> None:
    apiserver.api.gone_next = True
    apiserver.pod("smol-0", "10.0.0.1", ready=True)
    watch = discovery.follow(parse_target(TARGET))
    assert watch is not None
    settle(lambda: watch.lists >= 2, "a second LIST after 410 Gone")
    router = Router(cooldown_s=60.0, discovery=discovery)
    settle(lambda: ready_set(router)() == {"http://10.0.0.1:8000"}, "the pod")
    apiserver.pod("smol-1", "10.0.0.2", ready=True)
    settle(lambda: len(ready_set(router)()) == 2, "events after the relist")
    assert watch.last_error is None  # a 410 is routine, not a failure


def test_a_watch_the_server_ends_resumes_without_listing(apiserver: ApiServer) -> None:
    found = Discovery("on", watch_timeout_s=1.0, backoff_s=(0.05, 0.2))
    found.start([TARGET, "http://static:8000"])
    try:
        watch = found.follow(parse_target(TARGET))
        assert watch is not None
        settle(lambda: apiserver.api.watches >= 3, "the watch ended by the server twice and resumed")
        apiserver.pod("smol-0", "10.0.0.1", ready=True)
        settle(lambda: found.expand([TARGET]) == ["http://10.0.0.1:8000"], "a pod after the resumed watch")
        assert watch.lists == 1
    finally:
        found.stop()


def test_stop_is_prompt_while_a_watch_waits(apiserver: ApiServer) -> None:
    found = Discovery("on", watch_timeout_s=600.0)
    found.start([TARGET])
    settle(lambda: apiserver.api.watches >= 1, "the watch open")
    watch = found.follow(parse_target(TARGET))
    started = time.monotonic()
    found.stop()
    assert time.monotonic() - started < 3.0
    assert isinstance(watch, PodWatch) and not watch._thread.is_alive()
    assert found.expand([TARGET]) == []  # stopped: nothing followed, nothing started again


def test_an_unreachable_api_server_keeps_trying(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.web.conftest import free_port

    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "x", "cluster": {"server": f"http://127.0.0.1:{free_port()}"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "x", "context": {"cluster": "x", "user": "u"}}],
        "current-context": "x",
    }
    (tmp_path / "kubeconfig").write_text(json.dumps(config))
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "kubeconfig"))
    found = Discovery("on", backoff_s=(0.05, 0.1))
    found.start([TARGET])
    try:
        watch = found.follow(parse_target(TARGET))
        assert watch is not None
        settle(lambda: watch.last_error is not None, "the failure recorded")
        assert found.expand([TARGET]) == []
        assert "listing pods" in found.state(TARGET) and "Connection" in found.state(TARGET)
    finally:
        found.stop()


def test_modes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    monkeypatch.setenv("HOME", str(tmp_path))
    auto = Discovery("auto")
    auto.start([TARGET])
    assert not auto.enabled and auto.expand([TARGET, "http://a:1"]) == ["http://a:1"]
    with pytest.raises(KubernetesUnavailable, match="LORAPLEX_KUBERNETES_DISCOVERY=on"):
        Discovery("on").start()
    off = Discovery("off")
    off.start([TARGET])
    assert not off.enabled and "off" in off.state(TARGET)


# --- the control plane: admin API, gateway routing, console ----------------------------------------------


@pytest.fixture
def cp(apiserver: ApiServer, sqlite_url: str, app_factory: Callable[..., FastAPI]) -> Iterator[TestClient]:
    app = app_factory(sqlite_url, kubernetes_discovery="on", kubernetes_watch_timeout_s=30.0)
    with TestClient(app) as client:
        yield client


def test_admin_api_accepts_kubernetes_endpoints_and_shows_the_pods(
    apiserver: ApiServer, cp: TestClient
) -> None:
    apiserver.pod("smol-0", "10.0.0.1", ready=True)
    apiserver.pod("smol-1", "10.0.0.2", ready=False)
    body = {"name": "smol", "base_model": "HuggingFaceTB/SmolLM2-135M-Instruct", "endpoints": [TARGET]}
    made = cp.post("/admin/v1/deployments", json=body, headers=ADMIN)
    assert made.status_code == 201, made.text
    assert made.json()["endpoints"] == [TARGET]

    def pods() -> dict[str, Any]:
        shown = cp.get("/admin/v1/deployments/smol", headers=ADMIN).json()
        return {r["pod"]: r for r in shown["replicas"]}

    settle(lambda: set(pods()) == {"smol-0", "smol-1"}, "both pods listed")
    assert pods()["smol-0"] == {
        "endpoint": "http://10.0.0.1:8000",
        "pod": "smol-0",
        "ready": True,
        "detail": "ready",
    }
    assert pods()["smol-1"]["ready"] is False
    listed = cp.get("/admin/v1/deployments", headers=ADMIN).json()
    assert listed[0]["discovery"] == f"{TARGET}: 1 ready of 2 pods"
    # The gateway's router routes over the same ready set.
    router: Router = cp.app.state.router  # type: ignore[attr-defined]
    assert router.order("adapter:x", [TARGET]) == ["http://10.0.0.1:8000"]

    # The console's deployments page: the ready pod probed (nothing listens there), the other one not.
    make_user(cp.app, "root@platform.test", role=UserRole.ADMIN)  # type: ignore[arg-type]
    assert sign_in(cp, "root@platform.test").status_code == 303
    page = cp.get("/console/admin/deployments").text
    assert f"Discovery: {TARGET}: 1 ready of 2 pods" in page
    assert '<code>http://10.0.0.1:8000</code> <span class="hint">pod smol-0</span>' in page
    assert '<code>http://10.0.0.2:8000</code> <span class="hint">pod smol-1</span>' in page
    assert "not ready (ProbeFailed)" in page or "not ready (" in page

    moved = cp.patch("/admin/v1/deployments/smol", json={"endpoints": ["http://127.0.0.1:9/"]}, headers=ADMIN)
    assert moved.status_code == 200 and moved.json()["endpoints"] == ["http://127.0.0.1:9"]
    assert moved.json()["replicas"] == [
        {"endpoint": "http://127.0.0.1:9", "pod": None, "ready": None, "detail": "static"}
    ]
    assert cp.patch("/admin/v1/deployments/none", json={"endpoints": []}, headers=ADMIN).status_code == 404
    assert cp.get("/admin/v1/deployments/a%00b", headers=ADMIN).status_code == 422  # never reaches SQL


@pytest.mark.parametrize(
    "endpoint",
    [
        "kubernetes://default/",
        "kubernetes://Default/smol",
        "kubernetes://default/smol/x",
        "ftp://engine:8000",
        "http://engine:8000/?x=1",
        "engine:8000",
        "http://" + "a" * 3000,
    ],
)
def test_admin_api_refuses_malformed_endpoints(client: TestClient, endpoint: str) -> None:
    body = {"name": "smol", "base_model": "HuggingFaceTB/SmolLM2-135M-Instruct", "endpoints": [endpoint]}
    response = client.post("/admin/v1/deployments", json=body, headers=ADMIN)
    assert response.status_code == 422, response.text
    error = response.json()["detail"][0]
    assert error["loc"] == ["body", "endpoints", 0]
    assert "endpoint" in error["msg"] or "kubernetes://" in error["msg"]
    patched = client.patch("/admin/v1/deployments/smol", json={"endpoints": [endpoint]}, headers=ADMIN)
    assert patched.status_code == 422


def test_the_gateway_routes_to_discovered_pods_and_falls_over(apiserver: ApiServer, cp: TestClient) -> None:
    from .conftest import Api, free_port
    from .servers import StubEngine, serve

    first, second = StubEngine("first"), StubEngine("second")
    with serve(first.app()) as first_url, serve(second.app()) as second_url:
        refused = free_port()  # a pod Kubernetes calls ready whose engine refuses connections
        apiserver.pod("smol-0", "127.0.0.1", ready=True, port=int(first_url.rsplit(":", 1)[1]))
        apiserver.pod("smol-1", "127.0.0.1", ready=True, port=refused)
        apiserver.pod("smol-9", "127.0.0.1", ready=False, port=int(second_url.rsplit(":", 1)[1]))
        api = Api(cp)
        api.deployment("smol", "HuggingFaceTB/SmolLM2-135M-Instruct", [TARGET])
        _, headers = api.tenant_with_key("acme")
        router: Router = cp.app.state.router  # type: ignore[attr-defined]
        settle(lambda: len(router.order(None, [TARGET])) == 2, "two ready pods")
        body = {
            "model": "HuggingFaceTB/SmolLM2-135M-Instruct",
            "messages": [{"role": "user", "content": "hi"}],
        }

        def ask() -> Any:
            return cp.post("/v1/chat/completions", json=body, headers=headers)

        for _ in range(4):  # wherever the random pick starts, the refused pod falls over to the live one
            answer = ask()
            assert answer.status_code == 200, answer.text
            assert answer.json()["served_by"] == "first"
        assert second.received == []  # not ready: never asked

        apiserver.set_ready("smol-9", True)
        apiserver.delete("smol-0")
        settle(lambda: f"http://127.0.0.1:{refused}" in router.order(None, [TARGET]), "smol-1 still there")
        settle(lambda: second_url in router.order(None, [TARGET]), "smol-9 ready")
        settle(lambda: first_url not in router.order(None, [TARGET]), "smol-0 gone")
        assert ask().json()["served_by"] == "second"

        apiserver.delete("smol-1")
        apiserver.delete("smol-9")
        settle(lambda: router.order(None, [TARGET]) == [], "no pods")
        assert ask().status_code == 503

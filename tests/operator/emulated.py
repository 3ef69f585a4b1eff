"""reconcile() and autoscale_once() against the strict API emulator, through the real KubeClient.

The pretend cluster (tests/operator/cluster.py) runs the API server and the fake kubelet; kmock cannot route
cluster-scoped `/api/v1/namespaces/NAME`, which the Secret policy reads, so a small front server in the
same loop answers those paths (GET; the test sets labels directly) and hands every other request to the
emulator unchanged. The tests call the operator's coroutines directly, as kopf's handlers would.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import re
import uuid
from collections.abc import Iterator
from typing import Any

import aiohttp.test_utils
import aiohttp.web
import kubernetes

from loraplex.operator.kube import KubeClient
from tests.operator.cluster import NAMESPACE, Cluster
from tests.operator.helpers import example

_NAMESPACE_PATH = re.compile(r"^/api/v1/namespaces/([a-z0-9-]{1,63})/?$")


class NamespaceFront:
    """Namespaces with labels in front of the emulator; `default` exists from the start, unlabelled."""

    def __init__(self, api: Any) -> None:
        self.api = api
        self.namespaces: dict[str, dict[str, Any]] = {}
        self.add(NAMESPACE)

    def add(self, name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        meta = {"name": name, "uid": str(uuid.uuid4()), "creationTimestamp": now, "labels": labels or {}}
        self.namespaces[name] = {"apiVersion": "v1", "kind": "Namespace", "metadata": meta}
        return self.namespaces[name]

    async def __call__(self, request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        match = _NAMESPACE_PATH.match(request.path)
        if match is None:
            return await self.api(request)  # type: ignore[no-any-return]
        namespace = self.namespaces.get(match.group(1))
        if namespace is None:
            body = {"kind": "Status", "code": 404, "reason": "NotFound", "message": "namespace not found"}
            return aiohttp.web.json_response(body, status=404)
        if request.method != "GET":
            body = {"kind": "Status", "code": 405, "reason": "MethodNotAllowed", "message": "GET only"}
            return aiohttp.web.json_response(body, status=405)
        return aiohttp.web.json_response(namespace)


class Emulated:
    """One pretend cluster with namespaces, and a KubeClient for the operator's coroutines."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.front = NamespaceFront(cluster.api)
        self._server = aiohttp.test_utils.RawTestServer(self.front, host="127.0.0.1", port=0)
        cluster.run(self._server.start_server())
        configuration = kubernetes.client.Configuration()
        configuration.host = str(self._server.make_url("")).rstrip("/")
        configuration.api_key = {"BearerToken": "Bearer fake-token"}
        self.kube = KubeClient(kubernetes.client.ApiClient(configuration))

    def close(self) -> None:
        self.kube.close()
        self.cluster.run(self._server.close())

    def label_namespace(self, labels: dict[str, str], name: str = NAMESPACE) -> None:
        self.front.namespaces[name]["metadata"]["labels"].update(labels)

    def writes_to(self, name: str) -> list[str]:
        """Every write the emulator received for objects called `name`, but status writes (those are the
        fake kubelet's), as 'METHOD plural': what proves the operator left an object alone."""
        found = []
        for request in list(self.cluster.api):
            if request.resource is None or request.subresource == "status":
                continue
            data = request.data if isinstance(request.data, dict) else {}
            target = request.name or (data.get("metadata") or {}).get("name")  # a POST names it in the body
            if target == name and request.method.value in ("POST", "PUT", "PATCH", "DELETE"):
                found.append(f"{request.method.value} {request.resource.plural}")
        return found

    def events(self, involved: str) -> list[dict[str, Any]]:
        """The core/v1 Events about the InferenceDeployment `involved`, oldest first."""
        items = asyncio.run(self.kube.list("Event", NAMESPACE, ""))
        found = [e for e in items if (e.get("involvedObject") or {}).get("name") == involved]
        return sorted(found, key=lambda e: (e.get("firstTimestamp") or "", e["metadata"]["name"]))


def inference_deployment(name: str, **spec: Any) -> dict[str, Any]:
    """gpu.yaml (token Secret loraplex-secrets, store Secret loraplex-adapter-store) in the test namespace."""
    body = copy.deepcopy(example("gpu.yaml"))
    body["metadata"] = {"name": name, "namespace": NAMESPACE}
    body["spec"].update(spec)
    return body


@contextlib.contextmanager
def running_cluster(engines: int) -> Iterator[Cluster]:
    """The API emulator with `engines` fake engine pods' metrics, stopped on the way out."""
    cluster = Cluster(engines=engines)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@contextlib.contextmanager
def emulated_cluster(engines: int) -> Iterator[Emulated]:
    """A running cluster and the operator's KubeClient on it (for the module fixtures of the tests)."""
    with running_cluster(engines) as cluster:
        emulated = Emulated(cluster)
        try:
            yield emulated
        finally:
            emulated.close()

"""The API emulator of the cluster in a box: tests/operator's strict, Helm-capable emulator plus Namespaces
and graceful Pod deletion.

kmock parses `/api/v1/namespaces` as "namespace of nothing" and cannot serve it; kopf lists and watches
Namespaces and `helm install --create-namespace` creates one. This answers those paths itself: a Namespace
exists once created, or once any object lives in it (as namespaces are implicit in the emulator's store).

A Pod is deleted as a real API server deletes one: the DELETE only sets `deletionTimestamp` and
`deletionGracePeriodSeconds` (the pod keeps serving while its preStop hook runs, and the endpoints see it
terminating), and the object goes once the kubelet has stopped it. The emulator knows deletion-in-progress
only through finalizers, so the graceful DELETE adds the kubelet's own (`KUBELET_FINALIZER`), which the
kubelet removes when the pod's process is gone; a DELETE with `gracePeriodSeconds: 0` removes it at once.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import re
import uuid
from typing import Any

import aiohttp.web
import kmock
from kmock._internal import enums, rendering

from tests.operator.test_chart import HelmableApiServer

# Held by a pod being deleted until the kubelet has run its preStop hook and stopped its process.
KUBELET_FINALIZER = "harness.loraplex.dev/kubelet"
DEFAULT_GRACE_SECONDS = 30  # Kubernetes' terminationGracePeriodSeconds default

NAMESPACES = re.compile(r"^/api/v1/namespaces(?:/([a-z0-9-]{1,63}))?/?$")


class ClusterApiServer(HelmableApiServer):
    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._namespaces: dict[str, dict[str, Any]] = {}

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        match = NAMESPACES.match(raw_request.path)
        if match is None:
            return await super().__call__(raw_request)
        name = match.group(1)
        if raw_request.method == "POST" and name is None:
            body = json.loads(await raw_request.read() or b"{}")
            return self._create_namespace(body)
        if raw_request.method != "GET":
            return _status(405, "MethodNotAllowed", f"{raw_request.method} on namespaces is not emulated")
        namespaces = self._all_namespaces()
        if name is not None:
            if name not in namespaces:
                return _status(404, "NotFound", f'namespaces "{name}" not found')
            return aiohttp.web.json_response(namespaces[name])
        if raw_request.query.get("watch") in ("true", "1"):
            return await self._watch_namespaces(raw_request, namespaces)
        listing = {"kind": "NamespaceList", "apiVersion": "v1", "metadata": {"resourceVersion": "1"}}
        return aiohttp.web.json_response({**listing, "items": list(namespaces.values())})

    async def _handle(self, request: rendering.Request) -> Any:
        try:
            return await self._handle_request(request)
        finally:
            self._forget(request)

    def _forget(self, request: rendering.Request) -> None:
        """kmock keeps every request it served (the operator's tests read that history), and matching a
        request to a reaction scans all of it for the request (by identity, through each reaction's
        filters): each request cost more than the one before, and late in the walkthrough (pods' status
        writes, watches, leases) this API server answered in tens of seconds. Only requests still being
        handled can be matched, so the box's history keeps those alone (long watches included)."""
        history = self._requests
        for index in range(len(history) - 1, -1, -1):
            if history[index] is request:
                del history[index]
                return

    async def _handle_request(self, request: rendering.Request) -> Any:
        # Only server-side apply creates a missing object; a merge patch of a deleted Pod's status (the
        # kubelet racing a deletion) must be a 404, not a nameless Pod.
        if request.resource is not None and request.action == enums.action.UPDATE and request.name:
            key = (request.resource, request.namespace, request.name)
            missing = key not in self.objects or self.objects[key].deleted
            applying = "apply-patch" in request.headers.get("Content-Type", "")
            if missing and not applying:
                raise kmock.KubernetesError(404, "NotFound", f"{request.resource} {request.name} not found")
        if request.action == enums.action.DELETE and request.name and _is_pod(request.resource):
            self._delete_gracefully(request)
        return await super()._handle(request)

    def _delete_gracefully(self, request: rendering.Request) -> None:
        """Turn a Pod DELETE into a graceful one (see the module's doc), or a forced one with grace 0."""
        key = (request.resource, request.namespace, request.name)
        if key not in self.objects or self.objects[key].deleted:
            return  # the emulator answers 404
        stored = self.objects[key]
        meta = stored.raw.get("metadata") or {}
        finalizers = list(meta.get("finalizers") or [])
        grace = _grace_seconds(request, stored.raw)
        if grace == 0:
            if KUBELET_FINALIZER in finalizers:  # forced: the kubelet's hold goes, the object with it
                finalizers.remove(KUBELET_FINALIZER)
                stored.patch({"metadata": {"finalizers": finalizers}})
                if meta.get("deletionTimestamp") and not finalizers:
                    stored.patch({"metadata": {"deletionTimestamp": None}})  # kmock deletes it anew below
            return
        if meta.get("deletionTimestamp") or KUBELET_FINALIZER in finalizers:
            return  # already terminating: a second DELETE changes nothing
        stored.patch({"metadata": {"finalizers": [*finalizers, KUBELET_FINALIZER],
                                   "deletionGracePeriodSeconds": grace}})  # fmt: skip

    def _namespace(self, name: str) -> dict[str, Any]:
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        return {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {
                "name": name,
                "uid": str(uuid.uuid4()),
                "resourceVersion": "1",
                "creationTimestamp": now,
            },
            "status": {"phase": "Active"},
        }

    def _all_namespaces(self) -> dict[str, dict[str, Any]]:
        for key in list(self.objects):
            namespace = key[1]
            if namespace and namespace not in self._namespaces:
                self._namespaces[namespace] = self._namespace(namespace)
        self._namespaces.setdefault("default", self._namespace("default"))
        return dict(self._namespaces)

    def _create_namespace(self, body: dict[str, Any]) -> aiohttp.web.Response:
        name = str((body.get("metadata") or {}).get("name") or "")
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", name):
            return _status(422, "Invalid", "metadata.name must be a DNS label")
        if name in self._all_namespaces():
            return _status(409, "AlreadyExists", f'namespaces "{name}" already exists')
        self._namespaces[name] = self._namespace(name)
        return aiohttp.web.json_response(self._namespaces[name], status=201)

    async def _watch_namespaces(
        self, raw_request: aiohttp.web.BaseRequest, known: dict[str, dict[str, Any]]
    ) -> aiohttp.web.StreamResponse:
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(raw_request)
        sent: set[str] = set()
        deadline = asyncio.get_running_loop().time() + float(raw_request.query.get("timeoutSeconds") or 300)
        try:
            while asyncio.get_running_loop().time() < deadline:
                for name, namespace in self._all_namespaces().items():
                    if name not in sent:
                        sent.add(name)
                        line = json.dumps({"type": "ADDED", "object": namespace}) + "\n"
                        await response.write(line.encode())
                await asyncio.sleep(1.0)
        except (ConnectionError, asyncio.CancelledError):
            pass
        return response


def _is_pod(resource: Any) -> bool:
    return getattr(resource, "plural", "") == "pods" and not getattr(resource, "group", "")


def _grace_seconds(request: rendering.Request, pod: dict[str, Any]) -> int:
    """DeleteOptions' gracePeriodSeconds (body or query), else the pod's terminationGracePeriodSeconds."""
    options = request.data if isinstance(request.data, dict) else {}
    given = options.get("gracePeriodSeconds", request.params.get("gracePeriodSeconds"))
    if given is None:
        given = (pod.get("spec") or {}).get("terminationGracePeriodSeconds", DEFAULT_GRACE_SECONDS)
    return max(0, int(given))


def _status(code: int, reason: str, message: str) -> aiohttp.web.Response:
    body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code, "reason": reason,
            "message": message}  # fmt: skip
    return aiohttp.web.json_response(body, status=code)

"""kmock's KubernetesEmulator made strict enough for kopf and for the operator's optimistic writes.

What the plain emulator lacks, and a real API server does, added here:
- uid, creationTimestamp, generation (bumped when spec changes) and a cluster-wide resourceVersion on
  every write, a DELETE that only sets deletionTimestamp (finalizers pending) included; 409 Conflict when
  a PATCH carries a stale metadata.resourceVersion; 422 when a CREATE carries one at all;
- the status subresource: PATCH .../status changes only status, the main endpoint ignores status;
- LIST returns the current resourceVersion and filters by labelSelector; WATCH?resourceVersion=N replays
  every event after N from a log, then streams new ones, so nothing written between a LIST and its WATCH
  is lost (the plain emulator re-sends ADDED and would drop a DELETED);
- garbage collection of objects whose owners (by ownerReferences uid) are gone.

It also records every (apiGroup, resource[/subresource], verb) each client used, in `calls` by its bearer
token ("" for none): RBAC is not enforced here, so tests compare what the operator did against the rules
the chart grants it, and tell two operator processes apart.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import uuid
from collections.abc import AsyncIterator
from typing import Any

import attrs
import kmock
from kmock._internal import aiobus, dicts, enums, references, rendering

ALL_VERBS = ["get", "list", "watch", "create", "update", "patch", "delete"]
RBAC_VERBS = {
    enums.action.FETCH: "get",
    enums.action.LIST: "list",
    enums.action.WATCH: "watch",
    enums.action.CREATE: "create",
    enums.action.UPDATE: "patch",  # every client here sends PATCH, never PUT
    enums.action.DELETE: "delete",
}


class _LoggingBuses(dict):  # type: ignore[type-arg]
    """The emulator's per-resource event buses, with every event also appended to the server's log."""

    def __init__(self, record: Any) -> None:
        super().__init__()
        self._record = record

    def __missing__(self, resource: references.resource) -> aiobus.Bus[Any]:
        record = self._record

        class Bus(aiobus.Bus):  # type: ignore[type-arg]
            async def put(self, item: Any) -> None:
                record(resource, item)
                await super().put(item)

        bus = self[resource] = Bus()
        return bus


@attrs.define(kw_only=True)
class StrictApiServer(kmock.KubernetesEmulator):
    _version: int = attrs.field(default=0, init=False)
    _log: list[tuple[int, references.resource, dict[str, Any]]] = attrs.field(factory=list, init=False)
    _changed: asyncio.Event = attrs.field(factory=asyncio.Event, init=False)
    _writes: asyncio.Lock = attrs.field(factory=asyncio.Lock, init=False)
    calls: dict[str, set[tuple[str, str, str]]] = attrs.field(factory=dict, init=False)
    _closing: bool = attrs.field(default=False, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._buses = _LoggingBuses(self._record)

    def declare(
        self, key: str, kind: str, subresources: tuple[str, ...] = (), namespaced: bool = True
    ) -> None:
        self.resources[key] = kmock.ResourceInfo(
            kind=kind, namespaced=namespaced, verbs=ALL_VERBS, subresources=set(subresources)
        )

    def _next_version(self) -> str:
        self._version += 1
        return str(self._version)

    def _record(self, resource: references.resource, event: dict[str, Any]) -> None:
        event = copy.deepcopy(event)
        meta = event.setdefault("object", {}).setdefault("metadata", {})
        # Deletions, and the emulator's own writes (deletionTimestamp), get a fresh version like any write.
        last = self._log[-1][0] if self._log else 0
        if event.get("type") == "DELETED" or int(meta.get("resourceVersion") or 0) <= last:
            meta["resourceVersion"] = self._next_version()
        self._log.append((int(meta.get("resourceVersion") or self._version), resource, event))
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def close_watches(self) -> None:
        """End every open WATCH now. The server's shutdown waits for its handlers, and a watch whose client
        is gone notices only when it next writes: up to the client's timeoutSeconds (kopf asks 300)."""
        self._closing = True
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def _has_status(self, resource: references.resource | None) -> bool:
        return (
            resource is not None
            and resource in self.resources
            and "status" in self.resources[resource].subresources
        )

    def _record_call(self, request: rendering.Request) -> None:
        if request.resource is None or not request.resource.plural or request.action not in RBAC_VERBS:
            return  # API discovery (/apis/GROUP/VERSION) is a non-resource URL every account may read
        resource = str(request.resource.plural or "")
        if request.subresource:
            resource = f"{resource}/{request.subresource}"
        token = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        call = (str(request.resource.group or ""), resource, RBAC_VERBS[request.action])
        self.calls.setdefault(token, set()).add(call)

    async def _handle(self, request: rendering.Request) -> Any:
        self._record_call(request)
        if request.resource is None or request.action not in (
            enums.action.CREATE,
            enums.action.UPDATE,
            enums.action.DELETE,
        ):
            return await super()._handle(request)
        async with self._writes:
            if request.action == enums.action.CREATE:
                self._stamp_create(request)
            elif request.action == enums.action.UPDATE:
                self._stamp_update(request)
            else:
                self._stamp_delete(request)
            try:
                return await super()._handle(request)
            finally:
                await self._collect_garbage()

    def _stamp_create(self, request: rendering.Request) -> None:
        meta = request.data.setdefault("metadata", {})
        if meta.get("resourceVersion"):
            raise kmock.KubernetesError(422, "Invalid", "metadata.resourceVersion must not be set on create")
        if request.namespace:
            meta["namespace"] = request.namespace
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        meta.update(uid=str(uuid.uuid4()), generation=1, creationTimestamp=now)
        meta["resourceVersion"] = self._next_version()
        if self._has_status(request.resource):
            request.data.pop("status", None)

    def _stamp_delete(self, request: rendering.Request) -> None:
        """A DELETE of an object with finalizers is a write (kmock sets deletionTimestamp): new version.

        Without this the stored object kept its old resourceVersion while the MODIFIED event carried a new
        one, so a finalizer-removal JSON patch testing the event's version was refused with 422 and the
        object stayed until some unrelated write came along.
        """
        key = (request.resource, request.namespace, request.name)
        if request.name is None or key not in self.objects or self.objects[key].deleted:
            return
        meta = self.objects[key].raw.get("metadata") or {}
        if meta.get("finalizers") and not meta.get("deletionTimestamp"):
            self.objects[key].patch({"metadata": {"resourceVersion": self._next_version()}})

    def _stamp_update(self, request: rendering.Request) -> None:
        key = (request.resource, request.namespace, request.name)
        if key not in self.objects or self.objects[key].deleted:
            return  # the emulator answers 404
        stored = self.objects[key].raw
        if isinstance(request.data, list):  # JSON patch (kopf removes finalizers so): stale `test` is 422
            for op in request.data:
                tests_version = op.get("op") == "test" and op.get("path") == "/metadata/resourceVersion"
                if tests_version and str(op.get("value")) != stored["metadata"]["resourceVersion"]:
                    raise kmock.KubernetesError(422, "Invalid", "the object has been modified (test failed)")
            version = self._next_version()
            request.data.append({"op": "replace", "path": "/metadata/resourceVersion", "value": version})
            return
        patch = request.data if isinstance(request.data, dict) else {}
        meta = patch.setdefault("metadata", {}) or {}
        patch["metadata"] = meta
        stale = meta.get("resourceVersion")
        if stale is not None and str(stale) != stored["metadata"]["resourceVersion"]:
            raise kmock.KubernetesError(
                409, "Conflict", f"the object has been modified (resourceVersion {stale} is stale)"
            )
        if request.subresource == "status":
            for field in [k for k in patch if k not in ("status", "metadata")]:
                del patch[field]
            patch["metadata"] = {}
        elif self._has_status(request.resource):
            patch.pop("status", None)
        if "spec" in patch:
            new_spec = dicts.patch_dict(copy.deepcopy(stored.get("spec") or {}), patch["spec"] or {})
            if new_spec != stored.get("spec"):
                patch["metadata"]["generation"] = int(stored["metadata"].get("generation") or 1) + 1
        patch["metadata"]["resourceVersion"] = self._next_version()

    async def _collect_garbage(self) -> None:
        async with self._lock:
            live = {obj.raw["metadata"].get("uid") for obj in self.objects.values() if not obj.deleted}
            for (resource, _, _), obj in list(self.objects.items()):
                if obj.deleted:
                    continue
                owners = obj.raw["metadata"].get("ownerReferences") or []
                if owners and all(ref.get("uid") not in live for ref in owners):
                    raw = obj.raw
                    obj.delete()
                    await self._buses[resource].put({"type": "DELETED", "object": raw})

    def _matches(self, request: rendering.Request, obj: dict[str, Any]) -> bool:
        meta = obj.get("metadata") or {}
        if request.namespace is not None and meta.get("namespace") != request.namespace:
            return False
        selector = request.params.get("labelSelector") or ""
        labels = meta.get("labels") or {}
        for term in filter(None, selector.split(",")):
            name, _, value = term.partition("=")
            if labels.get(name) != value:
                return False
        return True

    async def _serve_list(self, request: rendering.Request) -> rendering.Payload:
        if request.resource not in self._get_resources():
            raise kmock.KubernetesResourceNotFoundError()
        async with self._lock:
            items = [
                obj.raw
                for (resource, _, _), obj in self.objects.items()
                if resource == request.resource and not obj.deleted and self._matches(request, obj.raw)
            ]
            version = str(self._version)
        return {"kind": "List", "apiVersion": "v1", "metadata": {"resourceVersion": version}, "items": items}

    async def _serve_watch(self, request: rendering.Request) -> AsyncIterator[rendering.Payload]:
        yield b""
        since = request.params.get("resourceVersion", "")
        timeout = float(request.params.get("timeoutSeconds") or 3600)
        deadline = asyncio.get_running_loop().time() + timeout
        if since.isdigit():
            position = next((i for i, (v, _, _) in enumerate(self._log) if v > int(since)), len(self._log))
        else:
            position = len(self._log)
            for (resource, _, _), obj in list(self.objects.items()):
                if resource == request.resource and not obj.deleted and self._matches(request, obj.raw):
                    yield {"type": "ADDED", "object": obj.raw}
        while not self._closing and (left := deadline - asyncio.get_running_loop().time()) > 0:
            changed = self._changed
            while position < len(self._log):
                _, resource, event = self._log[position]
                position += 1
                if resource == request.resource and self._matches(request, event["object"]):
                    yield event
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), timeout=min(left, 1.0))

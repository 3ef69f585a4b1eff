"""A small async Kubernetes client for the few kinds the operator owns.

It rides on the official client's ApiClient (so in-cluster tokens, kubeconfig, exec plugins and TLS all
work as kubectl's do) but speaks in plain dicts: no model classes to round-trip, and updates are JSON
merge patches that carry metadata.resourceVersion, so a concurrent writer makes the API server answer 409
instead of one write silently undoing the other. Calls run in a worker thread with a timeout.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import kubernetes

logger = logging.getLogger(__name__)

# kind -> (apiVersion, plural); the operator owns nothing else.
KINDS: dict[str, tuple[str, str]] = {
    "ConfigMap": ("v1", "configmaps"),
    "Service": ("v1", "services"),
    "Pod": ("v1", "pods"),
    "Deployment": ("apps/v1", "deployments"),
    "PodDisruptionBudget": ("policy/v1", "poddisruptionbudgets"),
    "HorizontalPodAutoscaler": ("autoscaling/v2", "horizontalpodautoscalers"),
    "InferencePool": ("inference.networking.k8s.io/v1", "inferencepools"),
    "Event": ("v1", "events"),
    "InferenceDeployment": ("loraplex.dev/v1alpha1", "inferencedeployments"),
}


class KubeError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"Kubernetes API answered {status}: {message}")
        self.status = status


@dataclass(frozen=True)
class KubeSettings:
    request_timeout_s: float = 10.0


def load_api_client() -> kubernetes.client.ApiClient:
    """In a pod use the service account; elsewhere the current kubeconfig context (KUBECONFIG honoured)."""
    configuration = kubernetes.client.Configuration()
    try:
        kubernetes.config.load_incluster_config(client_configuration=configuration)
    except kubernetes.config.ConfigException:
        # The client reads KUBECONFIG once at import; read it now so a later export is honoured too.
        kubernetes.config.load_kube_config(
            config_file=os.environ.get("KUBECONFIG"), client_configuration=configuration
        )
    return kubernetes.client.ApiClient(configuration)


def object_path(kind: str, namespace: str, name: str | None = None) -> str:
    api_version, plural = KINDS[kind]
    root = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{root}/namespaces/{namespace}/{plural}"
    return f"{path}/{name}" if name else path


class KubeClient:
    def __init__(self, api_client: kubernetes.client.ApiClient, settings: KubeSettings | None = None) -> None:
        self._api = api_client
        self._settings = settings or KubeSettings()

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self._call("GET", object_path(kind, namespace, name))
        except KubeError as error:
            if error.status == 404:
                return None
            raise

    async def get_namespace(self, name: str) -> dict[str, Any] | None:
        """A Namespace (cluster-scoped: the Secret policy reads its labels); None when it does not exist."""
        try:
            return await self._call("GET", f"/api/v1/namespaces/{name}")
        except KubeError as error:
            if error.status == 404:
                return None
            raise

    async def list(self, kind: str, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        query = urlencode({"labelSelector": label_selector})
        result = await self._call("GET", f"{object_path(kind, namespace)}?{query}")
        return list(result.get("items") or [])

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        return await self._call("POST", object_path(obj["kind"], meta["namespace"]), obj)

    async def patch(
        self, kind: str, namespace: str, name: str, patch: dict[str, Any], subresource: str | None = None
    ) -> dict[str, Any]:
        path = object_path(kind, namespace, name) + (f"/{subresource}" if subresource else "")
        return await self._call("PATCH", path, patch, content_type="application/merge-patch+json")

    async def delete(self, kind: str, namespace: str, name: str, uid: str | None = None) -> None:
        """Delete; with `uid`, only that incarnation (a same-named replacement answers 409, not deleted)."""
        options = None
        if uid:
            options = {"kind": "DeleteOptions", "apiVersion": "v1", "preconditions": {"uid": uid}}
        try:
            await self._call("DELETE", object_path(kind, namespace, name), options)
        except KubeError as error:
            if error.status != 404:
                raise

    def close(self) -> None:
        self._api.close()

    async def _call(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> dict[str, Any]:
        return await asyncio.to_thread(self._call_sync, method, path, body, content_type)

    def _call_sync(self, method: str, path: str, body: Any, content_type: str) -> dict[str, Any]:
        headers = {"Accept": "application/json", "Content-Type": content_type}
        serialized = self._api.param_serialize(
            method, path, header_params=headers, body=body, auth_settings=["BearerToken"]
        )
        response = self._api.call_api(*serialized[:4], _request_timeout=self._settings.request_timeout_s)
        response.read()
        text = (response.data or b"").decode()
        if not 200 <= response.status < 300:
            raise KubeError(response.status, _status_message(text))
        return json.loads(text) if text else {}


def _status_message(text: str) -> str:
    try:
        return str(json.loads(text).get("message") or text)
    except (ValueError, AttributeError):
        return text[:500]

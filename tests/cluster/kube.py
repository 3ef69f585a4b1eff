"""A small synchronous Kubernetes API client for the harness, the controllers and the kubectl/helm shims.

It speaks plain REST to the emulator (no discovery): kinds map to paths through `KINDS`, and custom
resources are added from their CRD with `register_crd`. Errors keep the API server's status and message.
"""

from __future__ import annotations

import base64
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml


@dataclass(frozen=True)
class Kind:
    api_version: str
    plural: str
    namespaced: bool = True
    subresources: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        """The emulator's resource key: group/version/plural (core: v1/plural)."""
        return f"{self.api_version}/{self.plural}"


KINDS: dict[str, Kind] = {
    "Namespace": Kind("v1", "namespaces", namespaced=False),
    "Pod": Kind("v1", "pods", subresources=("status",)),
    "Service": Kind("v1", "services", subresources=("status",)),
    "ConfigMap": Kind("v1", "configmaps"),
    "Secret": Kind("v1", "secrets"),
    "ServiceAccount": Kind("v1", "serviceaccounts"),
    "Event": Kind("v1", "events"),
    "Deployment": Kind("apps/v1", "deployments", subresources=("status", "scale")),
    "ReplicaSet": Kind("apps/v1", "replicasets", subresources=("status", "scale")),
    "StatefulSet": Kind("apps/v1", "statefulsets", subresources=("status", "scale")),
    "Job": Kind("batch/v1", "jobs", subresources=("status",)),
    "ClusterRole": Kind("rbac.authorization.k8s.io/v1", "clusterroles", namespaced=False),
    "ClusterRoleBinding": Kind("rbac.authorization.k8s.io/v1", "clusterrolebindings", namespaced=False),
    "Role": Kind("rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": Kind("rbac.authorization.k8s.io/v1", "rolebindings"),
    "NetworkPolicy": Kind("networking.k8s.io/v1", "networkpolicies"),
    "Ingress": Kind("networking.k8s.io/v1", "ingresses", subresources=("status",)),
    "PodDisruptionBudget": Kind("policy/v1", "poddisruptionbudgets", subresources=("status",)),
    "HorizontalPodAutoscaler": Kind("autoscaling/v2", "horizontalpodautoscalers", subresources=("status",)),
    "CustomResourceDefinition": Kind(
        "apiextensions.k8s.io/v1", "customresourcedefinitions", namespaced=False, subresources=("status",)
    ),
}


def crd_kind(crd: dict[str, Any]) -> tuple[str, Kind]:
    """The kind a CustomResourceDefinition declares (its first served version)."""
    spec = crd["spec"]
    version = next(v for v in spec["versions"] if v.get("served", True))
    subresources = tuple(sorted((version.get("subresources") or {}).keys()))
    kind = Kind(
        f"{spec['group']}/{version['name']}",
        spec["names"]["plural"],
        namespaced=spec.get("scope", "Namespaced") == "Namespaced",
        subresources=subresources,
    )
    return spec["names"]["kind"], kind


def load_kinds_from(crds: list[dict[str, Any]]) -> None:
    for crd in crds:
        name, kind = crd_kind(crd)
        KINDS.setdefault(name, kind)


class ApiError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status


def secret_data(secret: dict[str, Any]) -> dict[str, str]:
    """A Secret's values as text, from `data` (base64) and `stringData` (as an API server merges them)."""
    values = {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}
    values.update(secret.get("stringData") or {})
    return values


class Client:
    def __init__(self, server: str, namespace: str = "default") -> None:
        self.server = server.rstrip("/")
        self.namespace = namespace
        self.http = httpx.Client(timeout=30)

    @classmethod
    def from_kubeconfig(cls, path: str | Path | None = None) -> Client:
        config = yaml.safe_load(Path(path or os.environ["KUBECONFIG"]).read_text())
        context = next(c for c in config["contexts"] if c["name"] == config["current-context"])["context"]
        cluster = next(c for c in config["clusters"] if c["name"] == context["cluster"])["cluster"]
        return cls(cluster["server"], context.get("namespace", "default"))

    def close(self) -> None:
        self.http.close()

    def path(self, kind: str, namespace: str | None = None, name: str | None = None, sub: str = "") -> str:
        info = KINDS[kind]
        group = "api" if "/" not in info.api_version else "apis"
        path = f"/{group}/{info.api_version}"
        if info.namespaced and namespace is not None:
            path += f"/namespaces/{namespace}"
        path += f"/{info.plural}"
        if name:
            path += f"/{name}"
        if sub:
            path += f"/{sub}"
        return path

    def _request(self, method: str, path: str, body: Any = None, ctype: str = "application/json") -> Any:
        content = None if body is None else json.dumps(body)
        response = self.http.request(
            method, self.server + path, content=content, headers={"Content-Type": ctype}
        )
        if response.status_code >= 300:
            raise ApiError(response.status_code, f"{method} {path}: {response.text[:500]}")
        return response.json() if response.content else None

    def get(self, kind: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        try:
            return self._request("GET", self.path(kind, namespace or self.namespace, name))
        except ApiError as error:
            if error.status == 404:
                return None
            raise

    def list(
        self, kind: str, namespace: str | None = None, selector: dict[str, str] | None = None
    ) -> list[dict[str, Any]]:
        path = self.path(kind, namespace)
        if selector:
            path += "?labelSelector=" + ",".join(f"{k}={v}" for k, v in sorted(selector.items()))
        return list(self._request("GET", path)["items"])

    def create(self, obj: dict[str, Any], namespace: str | None = None) -> dict[str, Any]:
        ns = obj.get("metadata", {}).get("namespace") or namespace or self.namespace
        if KINDS[obj["kind"]].namespaced:
            obj.setdefault("metadata", {})["namespace"] = ns
        return self._request("POST", self.path(obj["kind"], ns), obj)

    def patch(
        self, kind: str, name: str, patch: dict[str, Any], namespace: str | None = None, sub: str = ""
    ) -> dict[str, Any]:
        path = self.path(kind, namespace or self.namespace, name, sub)
        return self._request("PATCH", path, patch, "application/merge-patch+json")

    def delete(
        self, kind: str, name: str, namespace: str | None = None, grace_seconds: int | None = None
    ) -> bool:
        """Delete; `grace_seconds` overrides a pod's terminationGracePeriodSeconds (0: at once)."""
        path = self.path(kind, namespace or self.namespace, name)
        if grace_seconds is not None:
            path += f"?gracePeriodSeconds={grace_seconds}"
        try:
            self._request("DELETE", path)
        except ApiError as error:
            if error.status == 404:
                return False
            raise
        return True

    def apply(self, obj: dict[str, Any], namespace: str | None = None) -> dict[str, Any]:
        """Create, or merge-patch the live object to the given one (what `kubectl apply` amounts to here)."""
        meta = obj.setdefault("metadata", {})
        ns = meta.get("namespace") or namespace or self.namespace
        if obj["kind"] == "CustomResourceDefinition":
            load_kinds_from([obj])
        current = self.get(obj["kind"], meta["name"], ns)
        if current is None:
            return self.create(obj, ns)
        return self.patch(obj["kind"], meta["name"], {k: v for k, v in obj.items() if k != "status"}, ns)

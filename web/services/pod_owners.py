"""Whether an engine pod is the InferenceDeployment's own, by the owner chain Kubernetes controllers write.

Labels say nothing about who made a pod: anyone who may create pods in the namespace can label one
`app.kubernetes.io/name=loraplex-engine`, and the gateway would send it tenants' requests with the internal
token. A pod the operator's Deployment made has a controller ownerReference to a ReplicaSet, whose own
controller reference names the Deployment `<name>-engine`, whose controller reference is the
InferenceDeployment `<name>` (operator/resources.py makes the Deployment so). Each link is checked against
the object the API server has, by uid: a reference written into a pod's metadata by hand names an object
that is not there, or one with another uid. A ReplicaSet found good is remembered by its uid (uids are
never reused, and a ReplicaSet's owner does not change while its pods live); a refusal is asked again on
the pod's next event. When the API server cannot answer, OwnersUnknown says so: the caller keeps the pod
out and asks again soon (a Ready pod may have no further event to wait for).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kubernetes.client import AppsV1Api

log = logging.getLogger("loraplex.web.discovery")

# The operator names an InferenceDeployment's Deployment `<name>-engine` (operator/resources.py child_name).
DEPLOYMENT_SUFFIX = "-engine"
OPERATOR_GROUP = "loraplex.dev"
OWNER_KIND = "InferenceDeployment"
MAX_REMEMBERED = 1024  # ReplicaSets of one InferenceDeployment: one per rollout, a handful live at once


def controller_of(obj: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The ownerReference marked `controller: true` (at most one, as the API server enforces)."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if isinstance(ref, Mapping) and ref.get("controller") is True:
            return ref
    return None


class OwnersUnknown(Exception):
    """The API server could not say who owns the pod now (unreachable, timed out, refused us)."""


class EngineOwners:
    """Answers, for one InferenceDeployment, whether a pod is its own (`problem` is None) or why not."""

    def __init__(self, apps: AppsV1Api, namespace: str, name: str):
        self.apps = apps
        self.namespace, self.name = namespace, name
        self._owned_replica_sets: set[str] = set()  # uids
        self._lock = threading.Lock()

    def problem(self, pod: Mapping[str, Any]) -> str | None:
        """None when the pod's owner chain ends at this InferenceDeployment; else what breaks it.
        OwnersUnknown when the API server cannot tell now."""
        ref = controller_of(pod)
        if ref is None or ref.get("kind") != "ReplicaSet" or ref.get("apiVersion") != "apps/v1":
            return "not made by a ReplicaSet (no controller ownerReference to one)"
        uid = str(ref.get("uid") or "")
        with self._lock:
            if uid in self._owned_replica_sets:
                return None
        try:
            why = self._replica_set_problem(str(ref.get("name") or ""), uid)
        except Exception as exc:  # the API server is down or refuses us: the caller keeps the pod out
            log.warning(
                "cannot check the owners of an engine pod of %s/%s: %s", self.namespace, self.name, exc
            )
            raise OwnersUnknown(f"{type(exc).__name__}: {exc}"[:200]) from exc
        if why is None:
            with self._lock:
                if len(self._owned_replica_sets) >= MAX_REMEMBERED:
                    self._owned_replica_sets.clear()
                self._owned_replica_sets.add(uid)
        return why

    def _replica_set_problem(self, name: str, uid: str) -> str | None:
        replica_set = self._read(self.apps.read_namespaced_replica_set, name)
        if replica_set is None or (replica_set.get("metadata") or {}).get("uid") != uid:
            return f"its ReplicaSet {name} is not there (ownerReference uid {uid[:36]})"
        ref = controller_of(replica_set)
        deployment_name = self.name + DEPLOYMENT_SUFFIX
        if (
            ref is None
            or ref.get("kind") != "Deployment"
            or ref.get("apiVersion") != "apps/v1"
            or ref.get("name") != deployment_name
        ):
            return f"its ReplicaSet {name} is not the Deployment {deployment_name}'s"
        deployment = self._read(self.apps.read_namespaced_deployment, deployment_name)
        if deployment is None or (deployment.get("metadata") or {}).get("uid") != ref.get("uid"):
            return f"its ReplicaSet {name} names a Deployment {deployment_name} that is not there"
        owner = controller_of(deployment)
        if (
            owner is None
            or owner.get("kind") != OWNER_KIND
            or str(owner.get("apiVersion") or "").partition("/")[0] != OPERATOR_GROUP
            or owner.get("name") != self.name
        ):
            return f"the Deployment {deployment_name} is not the InferenceDeployment {self.name}'s"
        return None

    def _read(self, read: Callable[..., Any], name: str) -> dict[str, Any] | None:
        """The object as JSON (as the pods are read), or None when it does not exist."""
        from kubernetes.client.exceptions import ApiException

        try:
            response = read(name, self.namespace, _preload_content=False, _request_timeout=(5.0, 30.0))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        found = json.loads(response.data)
        return found if isinstance(found, dict) else None

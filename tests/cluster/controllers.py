"""The controller-manager's part that the chart and the operator rely on, as one polling loop.

- Deployment -> ReplicaSet -> Pods: a ReplicaSet `<deployment>-<template hash>` per pod template, owned by
  the Deployment, and `spec.replicas` pods named `<deployment>-<template hash>-<suffix>` with the template's
  labels plus `pod-template-hash`, owned by that ReplicaSet: the owner chain a real cluster has, which the
  control plane's discovery checks (web/services/pod_owners.py). The ReplicaSet controller's part is done
  here too: a deleted or failed pod is replaced; scaling down removes not-ready pods first; a changed
  template rolls out one surge pod at a time, old pods going once the new ones are ready. Old ReplicaSets
  stay, as a Deployment keeps them for rollbacks. The status (replicas, updated/ready/availableReplicas,
  observedGeneration) is written back.
- Job -> Pod: one pod at a time, retried up to `backoffLimit`; status `succeeded`/`failed` and a
  Complete/Failed condition.
- Service -> endpoints: a virtual IP per ClusterIP Service (written to `spec.clusterIP`), its DNS names in
  every pod's hosts file, and the proxy forwarding each port to the ready pods its selector matches.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import secrets
from typing import Any

from tests.cluster.kube import ApiError, Client
from tests.cluster.network import Network
from tests.cluster.proxy import ServiceProxy

logger = logging.getLogger(__name__)


def template_hash(template: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]


def is_ready(pod: dict[str, Any]) -> bool:
    status = pod.get("status") or {}
    conditions = status.get("conditions") or []
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    return ready and bool(status.get("podIP")) and not pod["metadata"].get("deletionTimestamp")


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def owned_by(pod: dict[str, Any], owner: dict[str, Any]) -> bool:
    uid = owner["metadata"].get("uid")
    return any(ref.get("uid") == uid for ref in pod["metadata"].get("ownerReferences") or [])


def owner_reference(owner: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": owner["apiVersion"],
        "kind": owner["kind"],
        "name": owner["metadata"]["name"],
        "uid": owner["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


class Controllers:
    def __init__(self, client: Client, network: Network, proxy: ServiceProxy) -> None:
        self.client = client
        self.network = network
        self.proxy = proxy
        self._service_ports: dict[str, set[tuple[str, int]]] = {}
        # Each Deployment's ReplicaSets by template hash, under the Deployment's uid: this loop makes every
        # ReplicaSet, so it remembers them rather than listing them on every step.
        self._replica_sets: dict[str, dict[str, dict[str, Any]]] = {}

    def step(self) -> None:
        pods = self.client.list("Pod")
        deployments = self.client.list("Deployment")
        for deployment in deployments:
            with contextlib.suppress(ApiError):  # a conflicting write: the next step catches up
                self.reconcile_deployment(deployment, pods)
        live = {d["metadata"]["uid"] for d in deployments}
        self._replica_sets = {uid: sets for uid, sets in self._replica_sets.items() if uid in live}
        for job in self.client.list("Job"):
            with contextlib.suppress(ApiError):
                self.reconcile_job(job, pods)
        self.reconcile_services(self.client.list("Service"), pods)

    # --- Deployments ----------------------------------------------------------------------------------
    def reconcile_deployment(self, deployment: dict[str, Any], all_pods: list[dict[str, Any]]) -> None:
        meta, spec = deployment["metadata"], deployment["spec"]
        namespace = meta.get("namespace", "default")
        template = spec["template"]
        current_hash = template_hash(template)
        replicas = int(spec.get("replicas", 1))
        known = self._replica_sets.setdefault(meta["uid"], {})
        current = known.get(current_hash)
        if current is None:
            current = known[current_hash] = self._ensure_replica_set(deployment, current_hash, namespace)
        pods = [
            p
            for p in all_pods
            if any(owned_by(p, r) for r in known.values()) and not p["metadata"].get("deletionTimestamp")
        ]
        for pod in pods:
            if (pod.get("status") or {}).get("phase") in ("Failed", "Succeeded"):
                self.client.delete("Pod", pod["metadata"]["name"], namespace)
        pods = [p for p in pods if (p.get("status") or {}).get("phase") not in ("Failed", "Succeeded")]
        new = [p for p in pods if p["metadata"].get("labels", {}).get("pod-template-hash") == current_hash]
        old = [p for p in pods if p not in new]
        new_ready = [p for p in new if is_ready(p)]
        if len(new) < replicas and (not old or len(new) == len(new_ready)):
            # Surge one at a time while old pods still serve; all at once on a fresh Deployment.
            for _ in range(replicas - len(new) if not old else 1):
                self.client.create(self._pod(deployment, current_hash, owner=current), namespace)
        elif len(new) > replicas:
            # Not-ready pods go first, then the newest (what the ReplicaSet controller prefers too).
            order = sorted(new, key=lambda p: (is_ready(p), p["metadata"].get("creationTimestamp", "")))
            for pod in order[: len(new) - replicas]:
                self.client.delete("Pod", pod["metadata"]["name"], namespace)
        if old and len(new_ready) >= replicas:
            for pod in old:
                self.client.delete("Pod", pod["metadata"]["name"], namespace)
        ready = len([p for p in pods if is_ready(p)])
        status = {
            "observedGeneration": meta.get("generation", 1),
            "replicas": len(pods),
            "updatedReplicas": len(new),
            "readyReplicas": ready,
            "availableReplicas": ready,
        }
        if {k: (deployment.get("status") or {}).get(k) for k in status} != status:
            available = "True" if ready >= replicas else "False"
            status["conditions"] = [{"type": "Available", "status": available}]
            self.client.patch("Deployment", meta["name"], {"status": status}, namespace, sub="status")

    def _ensure_replica_set(
        self, deployment: dict[str, Any], template_id: str, namespace: str
    ) -> dict[str, Any]:
        wanted = self._replica_set(deployment, template_id)
        try:
            return self.client.create(wanted, namespace)
        except ApiError as error:  # made by an earlier step whose result was lost: read it back
            found = self.client.get("ReplicaSet", wanted["metadata"]["name"], namespace)
            if error.status != 409 or found is None or not owned_by(found, deployment):
                raise
            return found

    @staticmethod
    def _replica_set(deployment: dict[str, Any], template_id: str) -> dict[str, Any]:
        template = deployment["spec"]["template"]
        labels = {**(template.get("metadata") or {}).get("labels", {}), "pod-template-hash": template_id}
        return {
            "apiVersion": "apps/v1",
            "kind": "ReplicaSet",
            "metadata": {
                "name": f"{deployment['metadata']['name']}-{template_id}",
                "labels": labels,
                "ownerReferences": [owner_reference(deployment)],
            },
            "spec": {
                "replicas": int(deployment["spec"].get("replicas", 1)),
                "selector": {"matchLabels": labels},
                "template": {**template, "metadata": {**(template.get("metadata") or {}), "labels": labels}},
            },
        }

    def _pod(
        self,
        source: dict[str, Any],
        template_id: str,
        extra_labels: dict[str, str] | None = None,
        owner: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """A pod of `source`'s template (a Deployment's or a Job's), owned by `owner` (default: `source`)."""
        template = source["spec"]["template"]
        labels = {**(template.get("metadata") or {}).get("labels", {}), **(extra_labels or {})}
        if template_id:
            labels["pod-template-hash"] = template_id
        prefix = (
            f"{source['metadata']['name']}-{template_id}-"
            if template_id
            else f"{source['metadata']['name']}-"
        )
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": prefix + secrets.token_hex(3)[:5],
                "labels": labels,
                "annotations": dict((template.get("metadata") or {}).get("annotations") or {}),
                "ownerReferences": [owner_reference(owner or source)],
            },
            "spec": template["spec"],
        }

    # --- Jobs -----------------------------------------------------------------------------------------
    def reconcile_job(self, job: dict[str, Any], all_pods: list[dict[str, Any]]) -> None:
        meta = job["metadata"]
        namespace = meta.get("namespace", "default")
        status = job.get("status") or {}
        if status.get("succeeded") or any(
            c.get("type") in ("Complete", "Failed") and c.get("status") == "True"
            for c in status.get("conditions") or []
        ):
            return
        pods = [p for p in all_pods if owned_by(p, job)]
        phases = [(p.get("status") or {}).get("phase") for p in pods]
        failed = phases.count("Failed")
        if "Succeeded" in phases:
            new_status = {
                "succeeded": 1,
                "failed": failed,
                "conditions": [{"type": "Complete", "status": "True"}],
            }
        elif failed > int(job["spec"].get("backoffLimit", 6)):
            message = self._termination_message(pods)
            new_status = {
                "failed": failed,
                "conditions": [
                    {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded", "message": message}
                ],
            }
        else:
            running = [phase for phase in phases if phase not in ("Failed", "Succeeded")]
            if not running:
                labels = {"job-name": meta["name"], "controller-uid": meta["uid"]}
                self.client.create(self._pod(job, "", labels), namespace)
            new_status = {"active": max(len(running), 1), "failed": failed}
        if {k: status.get(k) for k in new_status} != new_status:
            self.client.patch("Job", meta["name"], {"status": new_status}, namespace, sub="status")

    @staticmethod
    def _termination_message(pods: list[dict[str, Any]]) -> str:
        for pod in reversed(pods):
            for container in (pod.get("status") or {}).get("containerStatuses") or []:
                message = ((container.get("state") or {}).get("terminated") or {}).get("message")
                if message:
                    return str(message)[-500:]
        return ""

    # --- Services -------------------------------------------------------------------------------------
    def reconcile_services(self, services: list[dict[str, Any]], pods: list[dict[str, Any]]) -> None:
        hosts: dict[str, str] = {}
        wanted: dict[str, set[tuple[str, int]]] = {}
        for service in services:
            meta, spec = service["metadata"], service["spec"]
            namespace = meta.get("namespace", "default")
            if spec.get("type", "ClusterIP") not in ("ClusterIP", "NodePort", "LoadBalancer"):
                continue
            key = f"{namespace}/{meta['name']}"
            address = self.network.service_address(key)
            if spec.get("clusterIP") != address:
                with contextlib.suppress(ApiError):
                    self.client.patch("Service", meta["name"], {"spec": {"clusterIP": address}}, namespace)
            for name in (
                f"{meta['name']}.{namespace}.svc.cluster.local",
                f"{meta['name']}.{namespace}.svc",
                f"{meta['name']}.{namespace}",
            ):
                hosts[name] = address
            selected = [
                p
                for p in pods
                if p["metadata"].get("namespace", "default") == namespace
                and spec.get("selector")
                and matches(spec["selector"], p["metadata"].get("labels") or {})
                and is_ready(p)
            ]
            for port in spec.get("ports") or []:
                endpoints = []
                for pod in selected:
                    target = _target_port(pod, port.get("targetPort", port["port"]))
                    if target is not None:
                        endpoints.append((pod["status"]["podIP"], target))
                self.proxy.set_endpoints(address, int(port["port"]), endpoints)
                wanted.setdefault(key, set()).add((address, int(port["port"])))
        # A short name resolves in its own namespace only; with one namespace in use, write it as well.
        for service in services:
            meta = service["metadata"]
            hosts.setdefault(
                meta["name"], hosts.get(f"{meta['name']}.{meta.get('namespace', 'default')}.svc", "")
            )
        self.network.set_hosts({k: v for k, v in hosts.items() if v})
        for key, ports in self._service_ports.items():
            for address, port in ports - wanted.get(key, set()):
                self.proxy.remove(address, port)
        self._service_ports = wanted


def _target_port(pod: dict[str, Any], target: int | str) -> int | None:
    if isinstance(target, int) or str(target).isdigit():
        return int(target)
    for container in pod["spec"].get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == target:
                return int(port["containerPort"])
    return None

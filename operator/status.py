"""Status of an InferenceDeployment, computed from the live Deployment: phase and three conditions.

Ready: enough replicas answer /ready (at least spec.replicas.min). Progressing: a rollout or scale is under
way. Degraded: the spec is invalid, the children cannot be applied, or engine pods fail to start (reason
EngineFailing, with the pod's termination message: `loraplex serve` writes why the model did not load).
Pure functions of plain dicts; `now` is passed in so tests pin time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def condition(kind: str, ok: bool, reason: str, message: str, generation: int) -> dict[str, Any]:
    return {
        "type": kind,
        "status": "True" if ok else "False",
        "reason": reason,
        "message": message,
        "observedGeneration": generation,
    }


def merge_conditions(
    old: list[Mapping[str, Any]] | None, new: list[dict[str, Any]], now: str
) -> list[dict[str, Any]]:
    """Stamp lastTransitionTime only when a condition's status flips, as kubectl readers expect."""
    previous = {c.get("type"): c for c in old or []}
    merged = []
    for cond in new:
        before = previous.get(cond["type"])
        if before is not None and before.get("status") == cond["status"] and before.get("lastTransitionTime"):
            merged.append({**cond, "lastTransitionTime": before["lastTransitionTime"]})
        else:
            merged.append({**cond, "lastTransitionTime": now})
    return merged


# Waiting reasons of a container that will not come up by itself; ContainerCreating and PodInitializing pass.
FAILING_WAITING_REASONS = frozenset(
    {
        "CrashLoopBackOff",
        "CreateContainerConfigError",
        "CreateContainerError",
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "RunContainerError",
    }
)
# A condition message is read by people in `kubectl describe`; the kubelet keeps up to 4096 bytes.
MAX_FAILURE_MESSAGE = 1024


def engine_failure(pods: Sequence[Mapping[str, Any]]) -> str | None:
    """Why engine pods fail to start, from the first failing container (termination message first); None if
    none fails. Pods being deleted are skipped: their exit is expected."""
    for pod in sorted(pods, key=lambda p: str((p.get("metadata") or {}).get("name", ""))):
        meta = pod.get("metadata") or {}
        if meta.get("deletionTimestamp"):
            continue
        for status in (pod.get("status") or {}).get("containerStatuses") or []:
            reason = _container_failure(status)
            if reason is not None:
                text = f"pod {meta.get('name')}: {reason}"
                return text if len(text) <= MAX_FAILURE_MESSAGE else text[: MAX_FAILURE_MESSAGE - 3] + "..."
    return None


def _container_failure(status: Mapping[str, Any]) -> str | None:
    state = status.get("state") or {}
    last = (status.get("lastState") or {}).get("terminated") or {}
    waiting = state.get("waiting") or {}
    terminated = state.get("terminated") or {}
    if waiting.get("reason") in FAILING_WAITING_REASONS:
        why = _message(last) or str(waiting.get("message") or "").strip()
        return f"{waiting['reason']}: {why}" if why else str(waiting["reason"])
    if terminated and terminated.get("exitCode", 0) != 0:
        why = _message(terminated)
        code = terminated.get("exitCode")
        return f"exited with code {code}: {why}" if why else f"exited with code {code}"
    return None


def _message(terminated: Mapping[str, Any]) -> str:
    """A termination message on one line (a log tail under FallbackToLogsOnError has several)."""
    lines = [line.strip() for line in str(terminated.get("message") or "").splitlines() if line.strip()]
    return " | ".join(lines[-5:])


def healthy_status(
    deployment: Mapping[str, Any] | None,
    min_replicas: int,
    generation: int,
    endpoint: str,
    selector: str,
    failure: str | None = None,
) -> dict[str, Any]:
    """Status fields (without timestamps) for a valid spec whose children were applied; `failure` is
    engine_failure() of its pods."""
    dep_spec = (deployment or {}).get("spec") or {}
    dep_status = (deployment or {}).get("status") or {}
    dep_meta = (deployment or {}).get("metadata") or {}
    wanted = int(dep_spec.get("replicas") or 0)
    ready = int(dep_status.get("readyReplicas") or 0)
    updated = int(dep_status.get("updatedReplicas") or 0)
    observed = int(dep_status.get("observedGeneration") or 0)
    rolling = observed < int(dep_meta.get("generation") or 0) or updated < wanted or ready < wanted
    is_ready = ready >= min_replicas
    counts = f"{ready} of {wanted} replicas ready (minimum {min_replicas})"
    if is_ready:
        ready_condition = condition("Ready", True, "MinimumReplicasReady", counts, generation)
    elif failure is not None:
        ready_condition = condition("Ready", False, "EngineFailing", f"{counts}; {failure}", generation)
    else:
        ready_condition = condition("Ready", False, "WaitingForReplicas", counts, generation)
    degraded = (
        condition("Degraded", True, "EngineFailing", failure, generation)
        if failure is not None
        else condition("Degraded", False, "AsExpected", "children applied", generation)
    )
    conditions = [
        ready_condition,
        condition(
            "Progressing",
            rolling,
            "RollingOut" if rolling else "RolloutComplete",
            f"{updated} of {wanted} replicas updated, {ready} ready" if rolling else "all replicas updated",
            generation,
        ),
        degraded,
    ]
    phase = "Running" if is_ready and not rolling else "Progressing" if is_ready or ready else "Pending"
    if failure is not None and not is_ready:
        phase = "Degraded"
    return {
        "phase": phase,
        "observedGeneration": generation,
        "replicas": wanted,
        "readyReplicas": ready,
        "endpoint": endpoint,
        "selector": selector,
        "conditions": conditions,
    }


def degraded_status(reason: str, message: str, generation: int) -> dict[str, Any]:
    """Status for a spec that cannot work (InvalidSpec) or children that cannot be applied (ApplyFailed)."""
    return {
        "phase": "Degraded",
        "observedGeneration": generation,
        "conditions": [
            condition("Ready", False, reason, message, generation),
            condition("Progressing", False, reason, message, generation),
            condition("Degraded", True, reason, message, generation),
        ],
    }


def with_problem(status: Mapping[str, Any], reason: str, message: str, generation: int) -> dict[str, Any]:
    """A healthy_status with a problem the operator will not fix by itself (a same-named object it does not
    own): Degraded True with that reason, phase Degraded, and a Ready that is False says the same (it is
    most likely why: the engine's own Deployment cannot be applied)."""
    conditions = []
    for c in status["conditions"]:
        if c["type"] == "Degraded" or (c["type"] == "Ready" and c["status"] == "False"):
            c = condition(c["type"], c["type"] == "Degraded", reason, message, generation)
        conditions.append(c)
    return {**status, "phase": "Degraded", "conditions": conditions}

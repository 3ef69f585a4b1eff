"""Status of an InferenceDeployment, computed from the live Deployment: phase and three conditions.

Ready: enough replicas answer /ready (at least spec.replicas.min). Progressing: a rollout or scale is under
way. Degraded: the spec is invalid or the children cannot be applied; its message says what to fix.
Pure functions of plain dicts; `now` is passed in so tests pin time.
"""

from __future__ import annotations

from collections.abc import Mapping
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


def healthy_status(
    deployment: Mapping[str, Any] | None,
    min_replicas: int,
    generation: int,
    endpoint: str,
    selector: str,
) -> dict[str, Any]:
    """Status fields (without timestamps) for a valid spec whose children were applied."""
    dep_spec = (deployment or {}).get("spec") or {}
    dep_status = (deployment or {}).get("status") or {}
    dep_meta = (deployment or {}).get("metadata") or {}
    wanted = int(dep_spec.get("replicas") or 0)
    ready = int(dep_status.get("readyReplicas") or 0)
    updated = int(dep_status.get("updatedReplicas") or 0)
    observed = int(dep_status.get("observedGeneration") or 0)
    rolling = observed < int(dep_meta.get("generation") or 0) or updated < wanted or ready < wanted
    is_ready = ready >= min_replicas
    conditions = [
        condition(
            "Ready",
            is_ready,
            "MinimumReplicasReady" if is_ready else "WaitingForReplicas",
            f"{ready} of {wanted} replicas ready (minimum {min_replicas})",
            generation,
        ),
        condition(
            "Progressing",
            rolling,
            "RollingOut" if rolling else "RolloutComplete",
            f"{updated} of {wanted} replicas updated, {ready} ready" if rolling else "all replicas updated",
            generation,
        ),
        condition("Degraded", False, "AsExpected", "children applied", generation),
    ]
    phase = "Running" if is_ready and not rolling else "Progressing" if is_ready or ready else "Pending"
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

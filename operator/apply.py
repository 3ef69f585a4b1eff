"""Apply desired children: create what is missing, patch what drifted, keep what the autoscaler owns.

`plan(desired, current, idep)` is pure (what to send, or nothing); `apply_objects` does the I/O.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from typing import Any

from loraplex.operator.kube import KubeClient
from loraplex.operator.resources import HASH_ANNOTATION, child_name
from loraplex.operator.spec import InferenceDeployment

logger = logging.getLogger(__name__)


def is_subset(want: Any, have: Any) -> bool:
    """Whether every field of `want` is present and equal in `have` (the server adds defaults, not us)."""
    if isinstance(want, Mapping):
        return isinstance(have, Mapping) and all(k in have and is_subset(v, have[k]) for k, v in want.items())
    if isinstance(want, list):
        return isinstance(have, list) and len(want) == len(have) and all(map(is_subset, want, have))
    return bool(want == have)


def needs_update(desired: Mapping[str, Any], current: Mapping[str, Any]) -> bool:
    annotations = (current.get("metadata") or {}).get("annotations") or {}
    if annotations.get(HASH_ANNOTATION) != desired["metadata"]["annotations"][HASH_ANNOTATION]:
        return True
    # Same hash but hand-edited: compare the fields we set, ignoring what the server fills in.
    return not is_subset({k: v for k, v in desired.items() if k != "status"}, current)


def with_live_replicas(
    desired: dict[str, Any], current: Mapping[str, Any] | None, idep: InferenceDeployment
) -> dict[str, Any]:
    """Keep the autoscaler's replica count (clamped to the new bounds) instead of resetting it to min."""
    if desired["kind"] != "Deployment" or current is None or idep.spec.autoscaling.mode == "off":
        return desired
    live = (current.get("spec") or {}).get("replicas")
    if not isinstance(live, int):
        return desired
    bounds = idep.spec.replicas
    result = copy.deepcopy(desired)
    result["spec"]["replicas"] = max(bounds.min, min(bounds.max, live))
    return result


def plan(
    desired: dict[str, Any], current: Mapping[str, Any] | None, idep: InferenceDeployment
) -> tuple[str, dict[str, Any]] | None:
    """("create", object) | ("patch", merge patch with resourceVersion) | None when nothing drifted."""
    target = with_live_replicas(desired, current, idep)
    if current is None:
        return "create", target
    if not needs_update(target, current):
        return None
    patch = copy.deepcopy(target)
    patch["metadata"]["resourceVersion"] = (current.get("metadata") or {}).get("resourceVersion")
    if desired["kind"] == "PodDisruptionBudget":
        # A merge patch only adds keys: drop the budget form we no longer use, or the PDB would hold both.
        for key in ("minAvailable", "maxUnavailable"):
            patch["spec"].setdefault(key, None)
    return "patch", patch


async def apply_objects(
    client: KubeClient, objects: list[dict[str, Any]], idep: InferenceDeployment
) -> dict[str, dict[str, Any]]:
    """Apply each object in order; returns the live objects by kind (for status)."""
    live: dict[str, dict[str, Any]] = {}
    for desired in objects:
        kind, meta = desired["kind"], desired["metadata"]
        current = await client.get(kind, meta["namespace"], meta["name"])
        step = plan(desired, current, idep)
        if step is None:
            assert current is not None  # no plan only when it exists and matches
            live[kind] = dict(current)
            continue
        action, body = step
        logger.info("%s %s %s/%s", action, kind, meta["namespace"], meta["name"])
        if action == "create":
            live[kind] = await client.create(body)
        else:
            live[kind] = await client.patch(kind, meta["namespace"], meta["name"], body)
    return live


async def delete_stale(client: KubeClient, idep: InferenceDeployment, kinds_wanted: set[str]) -> None:
    """Remove an HPA left from hpa mode once the spec moved to builtin or off (it would fight us)."""
    if "HorizontalPodAutoscaler" not in kinds_wanted:
        await client.delete("HorizontalPodAutoscaler", idep.namespace, child_name(idep))

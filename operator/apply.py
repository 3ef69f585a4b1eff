"""Apply desired children: create what is missing, patch what drifted, keep what the autoscaler owns.

`plan(desired, current, idep)` is pure (what to send, or nothing); `apply_objects` does the I/O. Nothing is
patched or deleted unless this CR is its controller (`is_controlled_by`): a same-named object someone else
made is reported (ApplyResult.foreign) and left exactly as it is.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from loraplex.operator.kube import KubeClient
from loraplex.operator.resources import HASH_ANNOTATION, child_name
from loraplex.operator.spec import GROUP, KIND, InferenceDeployment

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


def is_controlled_by(obj: Mapping[str, Any], idep: InferenceDeployment) -> bool:
    """Whether `obj`'s controller is this very InferenceDeployment: kind, name and uid (a CR deleted and
    re-created under the same name has a new uid, and a same-named object someone else made has none)."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if (
            ref.get("controller") is True
            and ref.get("kind") == KIND
            and str(ref.get("apiVersion", "")).split("/")[0] == GROUP
            and ref.get("name") == idep.name
            and ref.get("uid") == idep.uid
        ):
            return True
    return False


def describe_foreign(obj: Mapping[str, Any], idep: InferenceDeployment) -> str:
    meta = obj.get("metadata") or {}
    what = f"{obj.get('kind')} {meta.get('namespace')}/{meta.get('name')}"
    controller = next(
        (ref for ref in meta.get("ownerReferences") or [] if ref.get("controller") is True), None
    )
    advice = "the operator leaves it untouched: delete or rename it"
    if controller is None:
        return f"{what} already exists without a controller; {advice}"
    owner = f"{controller.get('kind')} {controller.get('name')} (uid {controller.get('uid')})"
    return f"{what} is controlled by {owner}, not this InferenceDeployment (uid {idep.uid}); {advice}"


@dataclass
class ApplyResult:
    live: dict[str, dict[str, Any]] = field(default_factory=dict)  # ours only, by kind (for status)
    foreign: list[str] = field(default_factory=list)  # same-named objects we do not control
    created: list[str] = field(default_factory=list)  # kinds created on this pass
    rolled_out: bool = False  # the Deployment's pod template changed: pods are being replaced


async def apply_objects(
    client: KubeClient, objects: list[dict[str, Any]], idep: InferenceDeployment
) -> ApplyResult:
    """Apply each object in order, never touching one this CR does not control."""
    result = ApplyResult()
    for desired in objects:
        kind, meta = desired["kind"], desired["metadata"]
        current = await client.get(kind, meta["namespace"], meta["name"])
        if current is not None and not is_controlled_by(current, idep):
            result.foreign.append(describe_foreign(current, idep))
            continue
        step = plan(desired, current, idep)
        if step is None:
            assert current is not None  # no plan only when it exists and matches
            result.live[kind] = dict(current)
            continue
        action, body = step
        logger.info("%s %s %s/%s", action, kind, meta["namespace"], meta["name"])
        if action == "create":
            result.live[kind] = await client.create(body)
            result.created.append(kind)
        else:
            # The patch carries the resourceVersion we checked ownership on: a swap in between is a 409.
            result.live[kind] = await client.patch(kind, meta["namespace"], meta["name"], body)
            if kind == "Deployment" and current is not None:
                template = (current.get("spec") or {}).get("template")
                result.rolled_out |= not is_subset(body["spec"]["template"], template)
    return result


async def delete_stale(
    client: KubeClient,
    idep: InferenceDeployment,
    kinds_wanted: set[str],
    optional_kinds: tuple[str, ...] = ("HorizontalPodAutoscaler",),
) -> list[str]:
    """Remove a child of an optional kind the spec no longer asks for: an HPA left from hpa mode (it would
    fight us), an InferencePool once spec.inferencePool is gone. Returns the description of each
    same-named one we do not control, which stays."""
    foreign = []
    for kind in optional_kinds:
        if kind in kinds_wanted:
            continue
        current = await client.get(kind, idep.namespace, child_name(idep))
        if current is None:
            continue
        if not is_controlled_by(current, idep):
            foreign.append(describe_foreign(current, idep))
            continue
        await client.delete(kind, idep.namespace, child_name(idep), uid=current["metadata"]["uid"])
    return foreign

"""kopf entry point: `kopf run -m loraplex.operator.main`.

Handlers stay thin: parse the body into a typed spec, compute `desired_objects`, apply, write status.
Three triggers reach the same `reconcile`: kopf's create/update/resume, any event on an owned Deployment
(a deleted or edited child is restored at once), and a per-object resync daemon that repairs drift in the
children kopf does not watch (Service, ConfigMap, PDB, HPA). The builtin autoscaler is a second daemon.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Mapping
from typing import Any

import aiohttp
import kopf

from loraplex.operator.apply import apply_objects, delete_stale
from loraplex.operator.autoscaler import Decision, ScalingPolicy, ScalingState, decide
from loraplex.operator.config import OperatorConfig
from loraplex.operator.kube import KubeClient, KubeError, KubeSettings, load_api_client
from loraplex.operator.metrics import ready_pod_targets, scrape
from loraplex.operator.resources import (
    MANAGED_BY,
    METRIC_NAMES,
    child_name,
    desired_objects,
    endpoint,
    selector_string,
)
from loraplex.operator.spec import GROUP, KIND, PLURAL, VERSION, InferenceDeployment, SpecError, parse
from loraplex.operator.status import degraded_status, engine_failure, healthy_status, merge_conditions

logger = logging.getLogger(__name__)


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    config = OperatorConfig.from_env()
    settings.persistence.finalizer = f"{GROUP}/operator"
    settings.posting.level = logging.WARNING  # Kubernetes Events only for what a user must act on
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    memo.config = config
    memo.kube = KubeClient(load_api_client(), KubeSettings(request_timeout_s=config.request_timeout_seconds))
    memo.http = aiohttp.ClientSession()


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    await memo.http.close()
    memo.kube.close()


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
async def reconcile_handler(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    await reconcile(memo.kube, body)


@kopf.on.event("apps", "v1", "deployments", labels={"app.kubernetes.io/managed-by": MANAGED_BY})
async def owned_deployment_changed(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    owner = next((ref for ref in body.metadata.get("ownerReferences", []) if ref.get("kind") == KIND), None)
    if owner is None:
        return
    parent = await memo.kube.get(KIND, body.metadata.namespace, owner["name"])
    if parent is None or parent["metadata"].get("deletionTimestamp"):
        return  # the owner is going away: garbage collection takes the children
    await reconcile_quietly(memo.kube, parent)


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=5.0)
async def resync(body: kopf.Body, memo: kopf.Memo, stopped: kopf.DaemonStopped, **_: Any) -> None:
    while not await stopped.wait(memo.config.resync_seconds):
        await reconcile_quietly(memo.kube, body)


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=5.0)
async def autoscale(body: kopf.Body, memo: kopf.Memo, stopped: kopf.DaemonStopped, **_: Any) -> None:
    state = ScalingState()
    last: tuple[int, int, str] | None = None
    while not await stopped.wait(memo.config.autoscale_seconds):
        try:
            idep = parse(body)
        except SpecError:
            continue  # reported as Degraded by reconcile
        if idep.spec.autoscaling.mode != "builtin":
            state, last = ScalingState(), None
            continue
        try:
            decision = await autoscale_once(memo, idep, state)
        except (KubeError, aiohttp.ClientError, TimeoutError) as error:
            logger.warning("autoscaling %s/%s skipped this period: %s", idep.namespace, idep.name, error)
            continue
        if decision is None:
            continue
        state = decision.state
        if (decision.current, decision.desired, decision.reason) != last:
            last = (decision.current, decision.desired, decision.reason)
            await write_status(memo.kube, body, {"autoscaling": decision_status(idep, decision)})


async def reconcile(kube: KubeClient, body: Mapping[str, Any]) -> dict[str, Any]:
    """Parse, compute, apply, report. PermanentError for a spec that can never work."""
    generation = int(body.get("metadata", {}).get("generation") or 0)
    try:
        idep = parse(body)
    except SpecError as error:
        await write_status(kube, body, degraded_status("InvalidSpec", str(error), generation))
        raise kopf.PermanentError(f"invalid InferenceDeployment spec: {error}") from error
    objects = desired_objects(idep)
    try:
        live = await apply_objects(kube, objects, idep)
        await delete_stale(kube, idep, {obj["kind"] for obj in objects})
    except KubeError as error:
        if error.status == 409:  # someone wrote in between: read again shortly
            raise kopf.TemporaryError(f"conflict while applying children: {error}", delay=1) from error
        await write_status(kube, body, degraded_status("ApplyFailed", str(error), generation))
        raise kopf.TemporaryError(f"cannot apply children, will retry: {error}", delay=15) from error
    pods = await kube.list("Pod", idep.namespace, selector_string(idep))
    status = healthy_status(
        live.get("Deployment"),
        idep.spec.replicas.min,
        generation,
        endpoint(idep),
        selector_string(idep),
        engine_failure(pods),
    )
    await write_status(kube, body, status)
    return status


async def reconcile_quietly(kube: KubeClient, body: Mapping[str, Any]) -> None:
    """For triggers outside kopf's retry machinery: failures are logged and retried on the next trigger."""
    try:
        await reconcile(kube, body)
    except (kopf.PermanentError, kopf.TemporaryError, KubeError) as error:
        logger.info("reconcile of %s deferred: %s", body.get("metadata", {}).get("name"), error)


async def write_status(kube: KubeClient, body: Mapping[str, Any], fields: dict[str, Any]) -> None:
    """Merge-patch the status subresource, skipping the write when nothing but timestamps would change."""
    meta = body.get("metadata") or {}
    old = dict(body.get("status") or {})
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    fields = dict(fields)
    if "conditions" in fields:
        fields["conditions"] = merge_conditions(old.get("conditions"), fields["conditions"], now)
    if all(_same(old.get(key), value) for key, value in fields.items()):
        return
    await kube.patch(KIND, meta["namespace"], meta["name"], {"status": fields}, subresource="status")


def _same(old: Any, new: Any) -> bool:
    def strip(value: Any) -> Any:
        if isinstance(value, Mapping):
            return {k: strip(v) for k, v in value.items() if k not in ("lastTransitionTime", "time")}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    return bool(strip(old) == strip(new))


async def autoscale_once(memo: kopf.Memo, idep: InferenceDeployment, state: ScalingState) -> Decision | None:
    """Scrape ready pods, decide, patch the Deployment's replicas. None when there is no Deployment yet."""
    kube: KubeClient = memo.kube
    deployment = await kube.get("Deployment", idep.namespace, child_name(idep))
    if deployment is None:
        return None
    current = int(deployment["spec"].get("replicas") or 0)
    pods = await kube.list("Pod", idep.namespace, selector_string(idep))
    metric = METRIC_NAMES[idep.spec.autoscaling.metric]
    samples = await scrape(memo.http, ready_pod_targets(pods), metric, memo.config.scrape_timeout_seconds)
    decision = decide(current, samples, policy_for(idep), state, time.monotonic())
    if decision.desired != current:
        logger.info(
            "scaling %s/%s from %d to %d (%s, %s=%s)",
            idep.namespace,
            idep.name,
            current,
            decision.desired,
            decision.reason,
            metric,
            decision.value,
        )
        version = deployment["metadata"].get("resourceVersion")
        patch = {"metadata": {"resourceVersion": version}, "spec": {"replicas": decision.desired}}
        await kube.patch("Deployment", idep.namespace, child_name(idep), patch)
    return decision


def policy_for(idep: InferenceDeployment) -> ScalingPolicy:
    scaling = idep.spec.autoscaling
    return ScalingPolicy(
        min_replicas=idep.spec.replicas.min,
        max_replicas=idep.spec.replicas.max,
        target=scaling.target,
        scale_up_window_s=scaling.scale_up_stabilization_seconds,
        scale_down_window_s=scaling.scale_down_stabilization_seconds,
    )


def decision_status(idep: InferenceDeployment, decision: Decision) -> dict[str, Any]:
    status: dict[str, Any] = {
        "time": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "metric": idep.spec.autoscaling.metric,
        "target": idep.spec.autoscaling.target,
        "currentReplicas": decision.current,
        "desiredReplicas": decision.desired,
        "reason": decision.reason,
    }
    if decision.value is not None:
        status["value"] = round(decision.value, 4)
    return status

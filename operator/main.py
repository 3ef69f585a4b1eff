"""kopf entry point: `kopf run -m loraplex.operator.main`.

Handlers stay thin: parse the body into a typed spec, compute `desired_objects`, apply, write status.
Three triggers reach the same `reconcile`: kopf's create/update/resume, any event on an owned Deployment
(a deleted or edited child is restored at once), and a per-object resync daemon that repairs drift in the
children kopf does not watch (Service, ConfigMap, PDB, HPA, InferencePool). The builtin autoscaler is a
second daemon: it scrapes the engines, reads its signals (signals.py), decides (autoscaler.py), and says
why in an Event and in status.autoscaling.

No finalizer: nothing has to happen before an InferenceDeployment goes (its children go by owner
references), so deleting one, or its namespace, never waits for the operator. kopf would put one on every
object for the daemons' sake; `_daemons_without_finalizer` opts them out, and each daemon ends itself once
its object is gone. Several replicas may run: kopf peering keeps one active (peering.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging
import math
import time
from collections.abc import Mapping
from typing import Any

import aiohttp
import kopf

from loraplex.operator import events, peering, policy
from loraplex.operator.apply import ApplyResult, apply_objects, delete_stale, is_controlled_by
from loraplex.operator.autoscaler import Decision, Reading, ScalingPolicy, ScalingState, decide
from loraplex.operator.config import OperatorConfig
from loraplex.operator.kube import KubeClient, KubeError, KubeSettings, load_api_client
from loraplex.operator.metrics import ready_pods, scrape_pods
from loraplex.operator.resources import (
    MANAGED_BY,
    child_name,
    desired_objects,
    endpoint,
    rollout_strategy,
    selector_string,
)
from loraplex.operator.signals import read_signals, unplaced_adapters
from loraplex.operator.spec import GROUP, KIND, PLURAL, VERSION, InferenceDeployment, SpecError, parse
from loraplex.operator.status import (
    degraded_status,
    engine_failure,
    healthy_status,
    merge_conditions,
    with_problem,
)

logger = logging.getLogger(__name__)


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    config = OperatorConfig.from_env()
    # No handler needs a finalizer; kopf removes this one (put there by earlier versions) when it sees it.
    settings.persistence.finalizer = f"{GROUP}/operator"
    settings.posting.level = logging.WARNING  # Kubernetes Events only for what a user must act on
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    if peering.configure(settings, config.peering_lifetime_seconds):
        # Retried by kopf (TemporaryError) until the peering CRD exists; before the sessions are made.
        api_client = load_api_client()
        try:
            await peering.ensure_peering_object(api_client, settings.peering.name)
        finally:
            api_client.close()
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
    await reconcile(memo.kube, body, memo.config)


@kopf.on.event("apps", "v1", "deployments", labels={"app.kubernetes.io/managed-by": MANAGED_BY})
async def owned_deployment_changed(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    owner = next((ref for ref in body.metadata.get("ownerReferences", []) if ref.get("kind") == KIND), None)
    if owner is None:
        return
    parent = await memo.kube.get(KIND, body.metadata.namespace, owner["name"])
    if parent is None or parent["metadata"].get("deletionTimestamp"):
        return  # the owner is going away: garbage collection takes the children
    await reconcile_quietly(memo.kube, parent, memo.config)


# Daemons are stopped on deletion, on a peering pause and at exit: they first get `stopped` (their loops
# wait on it, so they end within a request), and are cancelled only if still running after the backoff.
# Without a backoff kopf cancels at once and logs the escalation on every stop.
CANCELLATION_BACKOFF_S = 5.0
CANCELLATION_TIMEOUT_S = 5.0
STOP_POLL_S = 1.0  # how often a sleeping daemon looks at `stopped`; well inside the backoff
# Every daemon of ours: one per InferenceDeployment, stopped as above.
per_object_daemon = kopf.daemon(
    GROUP,
    VERSION,
    PLURAL,
    cancellation_backoff=CANCELLATION_BACKOFF_S,
    cancellation_timeout=CANCELLATION_TIMEOUT_S,
)


@per_object_daemon
async def resync(body: kopf.Body, memo: kopf.Memo, stopped: kopf.DaemonStopped, **_: Any) -> None:
    status: Mapping[str, Any] | None = body.get("status")
    while not await sleep_unless_stopped(stopped, resync_interval(status, memo.config)):
        if not await still_exists(memo.kube, body):
            return
        status = await reconcile_quietly(memo.kube, body, memo.config)


def resync_interval(status: Mapping[str, Any] | None, config: OperatorConfig) -> float:
    """`converging_resync_seconds` until the status says Ready (a rollout, a crashing engine, a spec not
    yet reconciled), `resync_seconds` after: a pod's crash shows as EngineFailing within seconds."""
    conditions = (status or {}).get("conditions") or []
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    return config.resync_seconds if ready else min(config.converging_resync_seconds, config.resync_seconds)


@per_object_daemon
async def autoscale(body: kopf.Body, memo: kopf.Memo, stopped: kopf.DaemonStopped, **_: Any) -> None:
    state = ScalingState()
    last: tuple[int, int, str, str | None] | None = None
    while not await sleep_unless_stopped(stopped, memo.config.autoscale_seconds):
        if not await still_exists(memo.kube, body):
            return
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
        # Written when the decision or the signal behind it changes, not every period.
        if (decision.current, decision.desired, decision.reason, decision.signal) != last:
            last = (decision.current, decision.desired, decision.reason, decision.signal)
            await write_status(memo.kube, body, {"autoscaling": decision_status(idep, decision)})


async def sleep_unless_stopped(stopped: kopf.DaemonStopped, seconds: float) -> bool:
    """Sleep `seconds`; True (at once, or within STOP_POLL_S) when the daemon is asked to stop.

    Not kopf's `stopped.wait(seconds)`: that waits in a helper task which outlives its daemon when the
    daemon is cancelled instead of stopped (as a daemon whose object is already forgotten is, at exit), and
    the helper's late TimeoutError then fails the operator's exit (kopf 1.45). A cancelled sleep leaves
    nothing behind."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while not stopped:
        left = deadline - loop.time()
        if left <= 0:
            return False
        await asyncio.sleep(min(left, STOP_POLL_S))
    return True


async def still_exists(kube: KubeClient, body: Mapping[str, Any]) -> bool:
    """False once this daemon's object is deleted (or replaced by a namesake): without a finalizer kopf
    forgets the object when its DELETED event arrives but does not stop its daemons, so they stop here.
    An API error counts as "still there": the next period asks again."""
    meta = body.get("metadata") or {}
    try:
        live = await kube.get(KIND, meta["namespace"], meta["name"])
    except KubeError:
        return True
    if live is None or live["metadata"].get("uid") != meta.get("uid"):
        logger.info("%s/%s is gone: its daemon stops", meta["namespace"], meta["name"])
        return False
    return not live["metadata"].get("deletionTimestamp")


def _daemons_without_finalizer(registry: kopf.OperatorRegistry) -> None:
    """kopf marks every daemon `requires_finalizer=True` and offers no option against it (kopf 1.45).
    Ours need no clean-up at deletion, and a finalizer would make deleting an InferenceDeployment or its
    namespace hang whenever the operator is not running; so the registered handlers are replaced by copies
    that do not ask for one. tests/operator/test_finalizer.py fails if a kopf release changes this."""
    spawning = registry._spawning
    ours = (resync, autoscale)
    spawning._handlers = [
        dataclasses.replace(handler, requires_finalizer=False) if handler.fn in ours else handler
        for handler in spawning._handlers
    ]


_daemons_without_finalizer(kopf.get_default_registry())


async def reconcile(kube: KubeClient, body: Mapping[str, Any], config: OperatorConfig) -> dict[str, Any]:
    """Parse, check the policy, compute, apply, report. PermanentError for a spec that can never work; a
    refused CR (policy) or a foreign child is reported in status and an Event, and re-checked next pass."""
    generation = int(body.get("metadata", {}).get("generation") or 0)
    try:
        idep = parse(body)
    except SpecError as error:
        await warn(kube, body, events.INVALID_SPEC, str(error))
        await write_status(kube, body, degraded_status("InvalidSpec", str(error), generation))
        raise kopf.PermanentError(f"invalid InferenceDeployment spec: {error}") from error
    objects = desired_objects(idep)
    problems = []
    if idep.spec.inference_pool is not None and not config.inference_pools:
        # Not granted (the chart gives the RBAC with this switch): the rest is applied, the pool reported.
        objects = [obj for obj in objects if obj["kind"] != "InferencePool"]
        problems.append(
            "spec.inferencePool is set but this operator does not manage InferencePools: an admin sets "
            "the chart value inferencePools.enabled=true (needs the InferencePool v1 CRD)"
        )
    # Optional kinds a spec change may remove; InferencePools only where the operator may touch them.
    optional = (
        ("HorizontalPodAutoscaler", "InferencePool")
        if config.inference_pools
        else ("HorizontalPodAutoscaler",)
    )
    try:
        refused = await policy.check(kube, idep, config)
        if refused:
            # Nothing is created or changed: existing children stay as they were until the CR is permitted.
            message = "; ".join(refused)
            await warn(kube, body, events.POLICY_VIOLATION, message)
            status = degraded_status("PolicyViolation", message, generation)
            await write_status(kube, body, status)
            return status
        result = await apply_objects(kube, objects, idep)
        foreign = result.foreign + await delete_stale(kube, idep, {obj["kind"] for obj in objects}, optional)
    except KubeError as error:
        if error.status == 409:  # someone wrote in between: read again shortly
            raise kopf.TemporaryError(f"conflict while applying children: {error}", delay=1) from error
        message = str(error)
        if error.status == 404 and "inferencepools" in message:
            message += "; is the InferencePool CRD (inference.networking.k8s.io/v1) installed?"
        await write_status(kube, body, degraded_status("ApplyFailed", message, generation))
        raise kopf.TemporaryError(f"cannot apply children, will retry: {error}", delay=15) from error
    await announce_changes(kube, body, idep, result)
    pods = await kube.list("Pod", idep.namespace, selector_string(idep))
    status = healthy_status(
        result.live.get("Deployment"),
        idep.spec.replicas.min,
        generation,
        endpoint(idep),
        selector_string(idep),
        engine_failure(pods),
    )
    if foreign:
        message = "; ".join(foreign)
        await warn(kube, body, events.FOREIGN_OBJECT, message)
        status = with_problem(status, "ForeignObject", message, generation)
    if problems:
        message = "; ".join(problems)
        await warn(kube, body, events.INFERENCE_POOL_DISABLED, message)
        status = with_problem(status, events.INFERENCE_POOL_DISABLED, message, generation)
    await write_status(kube, body, status)
    return status


async def announce_changes(
    kube: KubeClient, body: Mapping[str, Any], idep: InferenceDeployment, result: ApplyResult
) -> None:
    """Normal Events for children created (one per pass: a restored child is worth one line) and for
    rollouts (a changed pod template replaces the pods)."""
    if result.created:
        message = f"created {', '.join(result.created)} {child_name(idep)}"
        await events.post(kube, body, events.NORMAL, events.CREATED, message)
    if result.rolled_out:
        steps = rollout_strategy(idep)["rollingUpdate"]
        message = (
            f"pod template of Deployment {child_name(idep)} changed: replacing pods, "
            f"{idep.spec.rollout.strategy} rollout (maxSurge {steps['maxSurge']}, "
            f"maxUnavailable {steps['maxUnavailable']})"
        )
        await events.post(kube, body, events.NORMAL, events.ROLLING_OUT, message)


async def warn(kube: KubeClient, body: Mapping[str, Any], reason: str, message: str) -> None:
    """A Warning Event, unless the status already carries this very problem (then it was posted when it
    appeared; resyncs every few seconds would otherwise repeat it forever)."""
    degraded: Mapping[str, Any] = next(
        (c for c in (body.get("status") or {}).get("conditions") or [] if c.get("type") == "Degraded"), {}
    )
    if degraded.get("reason") == reason and degraded.get("message") == message:
        return
    await events.post(kube, body, events.WARNING, reason, message)


async def reconcile_quietly(
    kube: KubeClient, body: Mapping[str, Any], config: OperatorConfig
) -> dict[str, Any] | None:
    """For triggers outside kopf's retry machinery: failures are logged and retried on the next trigger.
    The status written, or None when the pass failed."""
    try:
        return await reconcile(kube, body, config)
    except (kopf.PermanentError, kopf.TemporaryError, KubeError) as error:
        logger.info("reconcile of %s deferred: %s", body.get("metadata", {}).get("name"), error)
        return None


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
    """Scrape ready pods, read the signals, decide, patch the Deployment's replicas; None when there is no
    Deployment yet. The decision's state carries the counters for the next period's rates."""
    kube: KubeClient = memo.kube
    deployment = await kube.get("Deployment", idep.namespace, child_name(idep))
    if deployment is None or not is_controlled_by(deployment, idep):
        return None  # not there yet, or someone else's (reconcile reports that): never scale it
    current = int(deployment["spec"].get("replicas") or 0)
    pods = await kube.list("Pod", idep.namespace, selector_string(idep))
    config: OperatorConfig = memo.config
    scraped = await scrape_pods(
        memo.http, ready_pods(pods), config.scrape_timeout_seconds, config.internal_token
    )
    subject = {"metadata": {"name": idep.name, "namespace": idep.namespace, "uid": idep.uid}}
    if scraped.refused:
        await events.post(kube, subject, events.WARNING, *refused_event(scraped.refused))
    policy = policy_for(idep)
    now = time.monotonic()
    samples, counters = read_signals(
        [name for name, _ in policy.targets], scraped.samples, state.counters, now
    )
    decision = decide(current, samples, policy, dataclasses.replace(state, counters=counters), now)
    if decision.desired != current:
        logger.info(
            "scaling %s/%s from %d to %d (%s, %s=%s)",
            idep.namespace,
            idep.name,
            current,
            decision.desired,
            decision.reason,
            decision.signal,
            decision.value,
        )
        version = deployment["metadata"].get("resourceVersion")
        patch = {"metadata": {"resourceVersion": version}, "spec": {"replicas": decision.desired}}
        await kube.patch("Deployment", idep.namespace, child_name(idep), patch)
        await events.post(kube, subject, events.NORMAL, *scale_event(idep, decision))
    unplaced = unplaced_adapters(scraped.samples)
    return decision if unplaced is None else dataclasses.replace(decision, unplaced_adapters=unplaced)


def refused_event(refused: tuple[str, ...]) -> tuple[str, str]:
    """(reason, message) of the Warning when engines refuse the operator's internal token on /metrics."""
    pods = ", ".join(refused[:5]) + (f" and {len(refused) - 5} more" if len(refused) > 5 else "")
    return events.METRICS_REFUSED, (
        f"engines refused the autoscaler's /metrics scrape (401/403) at {pods}: the Secret in "
        "spec.internalTokenSecretRef must hold the internal token the operator has "
        "(LORAPLEX_OPERATOR_INTERNAL_TOKEN; the chart passes its Secret's internal-token)"
    )


def scale_event(idep: InferenceDeployment, decision: Decision) -> tuple[str, str]:
    """(reason, message) of the Event for a replica change: direction, why, the signal behind it and the
    other signals' readings."""
    signal = decision.signal or idep.spec.autoscaling.metric
    target = dict(idep.spec.autoscaling.targets()).get(signal, idep.spec.autoscaling.target)
    value = "no samples" if decision.value is None else f"{decision.value:.4g} per ready pod"
    message = (
        f"scaled Deployment {child_name(idep)} from {decision.current} to {decision.desired} replicas "
        f"({decision.reason}; {signal} {value}, target {target:g})"
    )
    others = [r for r in decision.readings if r.signal != signal]
    if others:
        message += "; also " + ", ".join(
            f"{r.signal} {'no samples' if r.value is None else f'{r.value:.4g}'} (target {r.target:g})"
            for r in others
        )
    return (events.SCALED_UP if decision.desired > decision.current else events.SCALED_DOWN), message


def policy_for(idep: InferenceDeployment) -> ScalingPolicy:
    scaling = idep.spec.autoscaling
    return ScalingPolicy(
        min_replicas=idep.spec.replicas.min,
        max_replicas=idep.spec.replicas.max,
        targets=scaling.targets(),
        scale_up_window_s=scaling.scale_up_stabilization_seconds,
        scale_down_window_s=scaling.scale_down_stabilization_seconds,
    )


def decision_status(idep: InferenceDeployment, decision: Decision) -> dict[str, Any]:
    """status.autoscaling: the decision, the signal that drove it, and every signal's reading."""
    signal = decision.signal or idep.spec.autoscaling.metric
    status: dict[str, Any] = {
        "time": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "metric": signal,
        "target": dict(idep.spec.autoscaling.targets()).get(signal, idep.spec.autoscaling.target),
        "currentReplicas": decision.current,
        "desiredReplicas": decision.desired,
        "reason": decision.reason,
        "signals": [_reading_status(reading) for reading in decision.readings],
    }
    if decision.value is not None:
        status["value"] = round(decision.value, 4)
    if decision.unplaced_adapters is not None:
        status["unplacedAdapters"] = decision.unplaced_adapters
    return status


def _reading_status(reading: Reading) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "metric": reading.signal,
        "target": reading.target,
        "recommendation": reading.raw,
        "reason": reading.reason,
    }
    if reading.value is not None and math.isfinite(reading.value):
        entry["value"] = round(reading.value, 4)
    return entry

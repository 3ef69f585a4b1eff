"""Events against the API emulator: children created, rollouts with their strategy, scale decisions with the
metric behind them, refusals (invalid spec); repeated events aggregate into one Event with a count."""

from __future__ import annotations

import asyncio
import types
from collections.abc import Iterator
from typing import Any

import aiohttp
import kopf
import kubernetes_validate
import pytest

from loraplex.operator import events
from loraplex.operator.autoscaler import Decision, ScalingState
from loraplex.operator.config import OperatorConfig
from loraplex.operator.main import autoscale_once, reconcile
from loraplex.operator.spec import parse
from tests.operator.cluster import NAMESPACE, wait_for
from tests.operator.emulated import Emulated, emulated_cluster, inference_deployment
from tests.operator.helpers import KUBE_VERSION, body

pytestmark = pytest.mark.timeout(90)
# A generous scrape timeout: on a loaded machine a missed sample would change the decision under test.
CONFIG = OperatorConfig(allowed_secrets=(f"{NAMESPACE}/*",), scrape_timeout_seconds=10.0)
NAME = "story"
CHILD = f"{NAME}-engine"


@pytest.fixture(scope="module")
def emulated() -> Iterator[Emulated]:
    with emulated_cluster(engines=4) as emulated:
        yield emulated


def reconcile_live(emulated: Emulated, name: str = NAME) -> dict[str, Any]:
    """One reconcile of the live CR, retried as kopf retries a TemporaryError: a child written between the
    operator's read and its patch (the emulator's Deployment controller updating status) is a 409 the
    operator reports as temporary (seen in CI under load, 2026-11-28)."""
    for _ in range(4):
        live = emulated.cluster.get("InferenceDeployment", name)
        assert live is not None
        try:
            return asyncio.run(reconcile(emulated.kube, live, CONFIG))
        except kopf.TemporaryError as error:
            if "409" not in str(error):
                raise
    live = emulated.cluster.get("InferenceDeployment", name)
    assert live is not None
    return asyncio.run(reconcile(emulated.kube, live, CONFIG))


def reasons(emulated: Emulated, name: str = NAME) -> list[tuple[str, str]]:
    return [(e["type"], e["reason"]) for e in emulated.events(name)]


def latest(emulated: Emulated, reason: str) -> dict[str, Any]:
    found = [e for e in emulated.events(NAME) if e["reason"] == reason]
    assert found, f"no {reason} event in {reasons(emulated)}"
    return max(found, key=lambda e: int(e["metadata"]["resourceVersion"]))


def autoscale(emulated: Emulated) -> Decision | None:
    async def once() -> Decision | None:
        async with aiohttp.ClientSession() as http:
            memo = types.SimpleNamespace(kube=emulated.kube, http=http, config=CONFIG)
            live = emulated.cluster.get("InferenceDeployment", NAME)
            return await autoscale_once(memo, parse(live), ScalingState())  # type: ignore[arg-type]

    return asyncio.run(once())


def pods(emulated: Emulated) -> int:
    return len([p for p in emulated.cluster.list("Pod") if p["metadata"]["name"].startswith(CHILD)])


def test_creating_the_children_is_announced(emulated: Emulated) -> None:
    emulated.cluster.create(
        inference_deployment(
            NAME,
            replicas={"min": 1, "max": 4},
            autoscaling={"mode": "builtin", "target": 4, "scaleDownStabilizationSeconds": 0},
        )
    )
    reconcile_live(emulated)
    created = [e for e in emulated.events(NAME) if e["reason"] == events.CREATED]
    assert [e["message"] for e in created] == [
        f"created ConfigMap, Deployment, Service, PodDisruptionBudget {CHILD}"
    ]
    assert created[0]["type"] == events.NORMAL
    assert created[0]["involvedObject"]["kind"] == "InferenceDeployment"
    assert created[0]["source"] == {"component": "loraplex-operator"}
    # Nothing changed on the next pass: nothing announced. A deleted child restored: one line.
    before = emulated.events(NAME)
    reconcile_live(emulated)
    assert emulated.events(NAME) == before
    emulated.cluster.delete("Service", CHILD)
    reconcile_live(emulated)
    assert latest(emulated, events.CREATED)["message"] == f"created Service {CHILD}"


def test_scale_decisions_are_announced_with_their_metric(emulated: Emulated) -> None:
    cluster = emulated.cluster
    wait_for(lambda: pods(emulated) == 1, what="the first engine pod")
    cluster.set_load(20.0)
    decision = autoscale(emulated)
    assert decision is not None and (decision.current, decision.desired) == (1, 4)
    up = latest(emulated, events.SCALED_UP)
    assert up["type"] == events.NORMAL
    assert up["message"] == (
        f"scaled Deployment {CHILD} from 1 to 4 replicas "
        "(AtMaximum; waiting_requests 20 per ready pod, target 4)"
    )
    wait_for(lambda: pods(emulated) == 4, what="4 engine pods")
    cluster.set_load(0.0)
    decision = autoscale(emulated)
    assert decision is not None and (decision.current, decision.desired) == (4, 2)
    down = latest(emulated, events.SCALED_DOWN)
    assert down["message"] == (
        f"scaled Deployment {CHILD} from 4 to 2 replicas "
        "(RateLimited; waiting_requests 0 per ready pod, target 4)"
    )


def test_rollouts_are_announced_with_their_strategy(emulated: Emulated) -> None:
    cluster = emulated.cluster
    cluster.patch(
        "InferenceDeployment", NAME, {"spec": {"engine": {"image": "ghcr.io/loraplex/engine:0.2.0"}}}
    )
    reconcile_live(emulated)
    rolling = latest(emulated, events.ROLLING_OUT)
    assert rolling["message"] == (
        f"pod template of Deployment {CHILD} changed: replacing pods, "
        "Surge rollout (maxSurge 1, maxUnavailable 0)"
    )
    # The strategy alone replaces no pod: the Deployment changes, nothing is announced.
    count = len(emulated.events(NAME))
    cluster.patch("InferenceDeployment", NAME, {"spec": {"rollout": {"strategy": "Replace"}}})
    reconcile_live(emulated)
    strategy = cluster.get("Deployment", CHILD)["spec"]["strategy"]
    assert strategy == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    assert len(emulated.events(NAME)) == count
    cluster.patch(
        "InferenceDeployment", NAME, {"spec": {"engine": {"image": "ghcr.io/loraplex/engine:0.3.0"}}}
    )
    reconcile_live(emulated)
    assert latest(emulated, events.ROLLING_OUT)["message"].endswith(
        "Replace rollout (maxSurge 0, maxUnavailable 1)"
    )


def test_an_invalid_spec_is_a_warning(emulated: Emulated) -> None:
    emulated.cluster.patch("InferenceDeployment", NAME, {"spec": {"resources": {"gpusPerReplica": 2}}})
    with pytest.raises(kopf.PermanentError):
        reconcile_live(emulated)
    warning = latest(emulated, events.INVALID_SPEC)
    assert warning["type"] == events.WARNING
    assert "spec.resources.gpusPerReplica is 2; the engine uses one GPU per replica" in warning["message"]


def test_the_same_event_again_counts_up(emulated: Emulated) -> None:
    subject = emulated.cluster.get("InferenceDeployment", NAME)
    for _ in range(3):
        asyncio.run(events.post(emulated.kube, subject, events.WARNING, "Tested", "the same words"))
    tested = [e for e in emulated.events(NAME) if e["reason"] == "Tested"]
    assert len(tested) == 1 and tested[0]["count"] == 3
    assert tested[0]["firstTimestamp"] <= tested[0]["lastTimestamp"]


def test_the_event_is_a_valid_core_v1_event() -> None:
    subject = body(uid="3f6c1f0e-1111-4222-8333-444455556666")
    event = events.event_body(subject, events.WARNING, "Tested", "x" * 5000, "2026-11-23T17:00:00Z", "op-0")
    kubernetes_validate.validate(event, KUBE_VERSION, strict=True)
    assert len(event["message"]) == events.MAX_MESSAGE and event["message"].endswith("...")
    assert event["metadata"]["namespace"] == event["involvedObject"]["namespace"] == "loraplex"
    # The name is the same for the same event and differs for another message or another incarnation.
    again = events.event_body(subject, events.WARNING, "Tested", "x" * 5000, "2026-11-23T18:00:00Z", "op-1")
    assert again["metadata"]["name"] == event["metadata"]["name"]
    other = events.event_body(subject, events.WARNING, "Tested", "y", "2026-11-23T17:00:00Z", "op-0")
    assert other["metadata"]["name"] != event["metadata"]["name"]
    reborn = body(uid="another")
    renamed = events.event_body(reborn, events.WARNING, "Tested", "x" * 5000, "2026-11-23T17:00:00Z", "op-0")
    assert renamed["metadata"]["name"] != event["metadata"]["name"]

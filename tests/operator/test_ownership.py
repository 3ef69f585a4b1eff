"""Ownership: the operator patches and deletes only what this very CR controls (kind, name and uid, with
controller=true); a same-named object it does not own is reported (Degraded ForeignObject, a Warning Event)
and stays byte-identical."""

from __future__ import annotations

import asyncio
import copy
import types
from collections.abc import Iterator
from typing import Any

import pytest

from loraplex.operator import events
from loraplex.operator.apply import is_controlled_by
from loraplex.operator.autoscaler import ScalingState
from loraplex.operator.config import OperatorConfig
from loraplex.operator.main import autoscale_once, reconcile
from loraplex.operator.resources import desired_objects
from loraplex.operator.spec import parse
from tests.operator.cluster import NAMESPACE
from tests.operator.emulated import Emulated, emulated_cluster, inference_deployment
from tests.operator.helpers import body

pytestmark = pytest.mark.timeout(60)
CONFIG = OperatorConfig(allowed_secrets=(f"{NAMESPACE}/*",))


def test_control_needs_kind_group_name_uid_and_the_controller_flag() -> None:
    idep = parse(body(uid="uid-1"))
    ours = desired_objects(idep)[0]
    assert is_controlled_by(ours, idep)
    ref = ours["metadata"]["ownerReferences"][0]
    for field, value in [
        ("uid", "uid-2"),  # a previous CR of the same name
        ("name", "other"),
        ("kind", "Deployment"),
        ("apiVersion", "example.com/v1alpha1"),
        ("controller", False),
    ]:
        changed = copy.deepcopy(ours)
        changed["metadata"]["ownerReferences"] = [{**ref, field: value}]
        assert not is_controlled_by(changed, idep), field
    assert not is_controlled_by({"metadata": {"name": "llama3-8b-engine"}}, idep)


@pytest.fixture(scope="module")
def emulated() -> Iterator[Emulated]:
    with emulated_cluster(engines=1) as emulated:
        yield emulated


def foreign(
    kind: str, name: str, spec: dict[str, Any], owner: dict[str, Any] | None = None
) -> dict[str, Any]:
    api = {"Deployment": "apps/v1", "Service": "v1", "HorizontalPodAutoscaler": "autoscaling/v2"}[kind]
    meta: dict[str, Any] = {"name": name, "namespace": NAMESPACE, "labels": {"team": "someone-else"}}
    if owner is not None:
        meta["ownerReferences"] = [owner]
    return {"apiVersion": api, "kind": kind, "metadata": meta, "spec": spec}


def untouched(obj: dict[str, Any] | None) -> dict[str, Any]:
    """What only a writer of the object itself changes: all but status and the status write's version."""
    assert obj is not None
    meta = {k: v for k, v in obj["metadata"].items() if k != "resourceVersion"}
    return {**{k: v for k, v in obj.items() if k != "status"}, "metadata": meta}


def test_foreign_children_are_reported_and_left_byte_identical(emulated: Emulated) -> None:
    cluster = emulated.cluster
    name, child = "clash", "clash-engine"
    labels = {"app": "theirs"}
    cluster.create(
        foreign(
            "Deployment",
            child,
            {
                "replicas": 7,
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {"containers": [{"name": "x", "image": "x"}]},
                },
            },
        )
    )
    cluster.create(foreign("Service", child, {"ports": [{"port": 1}]}))
    cluster.create(
        foreign(
            "HorizontalPodAutoscaler",
            child,
            {"scaleTargetRef": {"kind": "Deployment", "name": child}, "minReplicas": 1, "maxReplicas": 3},
        )
    )
    before = {kind: cluster.get(kind, child) for kind in ("Deployment", "Service", "HorizontalPodAutoscaler")}
    created = emulated.writes_to(child)
    assert created == ["POST deployments", "POST services", "POST horizontalpodautoscalers"]
    cluster.create(inference_deployment(name, autoscaling={"mode": "builtin"}))
    live = cluster.get("InferenceDeployment", name)
    status = asyncio.run(reconcile(emulated.kube, live, CONFIG))

    # builtin mode would delete a stale HPA of ours: this one is not ours, so it stays too. Only the fake
    # kubelet writes (the Deployment's status); the operator sent nothing but its own ConfigMap and PDB.
    for kind, obj in before.items():
        assert untouched(cluster.get(kind, child)) == untouched(obj), kind
    assert emulated.writes_to(child) == [*created, "POST configmaps", "POST poddisruptionbudgets"]
    assert status["phase"] == "Degraded"
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "ForeignObject"
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"], ready["message"]) == (
        "False",
        "ForeignObject",
        degraded["message"],
    )
    for kind in before:
        assert f"{kind} {NAMESPACE}/{child} already exists without a controller" in degraded["message"], kind
    warnings = [e for e in emulated.events(name) if e["type"] == events.WARNING]
    assert [e["reason"] for e in warnings] == [events.FOREIGN_OBJECT]

    # The builtin autoscaler never scales a Deployment it does not control.
    cluster.set_load(100.0)
    memo = types.SimpleNamespace(kube=emulated.kube, http=None, config=CONFIG)
    decision = asyncio.run(autoscale_once(memo, parse(live), ScalingState()))  # type: ignore[arg-type]
    assert decision is None
    assert untouched(cluster.get("Deployment", child)) == untouched(before["Deployment"])
    assert emulated.writes_to(child)[-1] == "POST poddisruptionbudgets"

    # A child whose controller reference names this CR but another uid (an earlier incarnation the
    # garbage collector has not reached yet; here a live uid, so the emulator's collector keeps it).
    bystander = cluster.create(inference_deployment("bystander"))
    stale_owner = {
        "apiVersion": "loraplex.dev/v1alpha1",
        "kind": "InferenceDeployment",
        "name": name,
        "uid": bystander["metadata"]["uid"],
        "controller": True,
    }
    cluster.delete("Service", child)
    cluster.create(foreign("Service", child, {"ports": [{"port": 2}]}, owner=stale_owner))
    stale = cluster.get("Service", child)
    writes = emulated.writes_to(child)
    status = asyncio.run(reconcile(emulated.kube, cluster.get("InferenceDeployment", name), CONFIG))
    assert cluster.get("Service", child) == stale
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert (
        f"Service {NAMESPACE}/{child} is controlled by InferenceDeployment {name} "
        f"(uid {bystander['metadata']['uid']}), not this InferenceDeployment (uid {live['metadata']['uid']})"
    ) in degraded["message"]
    assert emulated.writes_to(child) == writes

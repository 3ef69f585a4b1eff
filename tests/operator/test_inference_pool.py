"""InferencePools for a team's own inference gateway: what the operator makes is a valid
inference.networking.k8s.io/v1 object (the vendored CRD schema, CEL rules included) over exactly the
engine pods; it is made, repaired and removed only where the chart allows it, with the RBAC for it."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from loraplex.operator import events
from loraplex.operator.config import OperatorConfig
from loraplex.operator.main import reconcile
from loraplex.operator.resources import ENGINE_PORT, desired_objects, inference_pool, selector_labels
from loraplex.operator.spec import parse
from tests.operator.crd_validation import errors_against
from tests.operator.emulated import Emulated, emulated_cluster, inference_deployment
from tests.operator.helpers import body
from tests.operator.rbac import grants, operator_rules
from tests.operator.test_chart import render

POOL_SCHEMA = yaml.safe_load((Path(__file__).parent / "fixtures" / "inferencepool-v1.yaml").read_text())
POOL = {"endpointPickerRef": {"name": "llama-epp"}}
CONFIG = OperatorConfig(
    allowed_secrets=("default/loraplex-secrets", "default/loraplex-adapter-store"), inference_pools=True
)


def pool_of(**spec: Any) -> dict[str, Any]:
    return inference_pool(parse(body(**{"inferencePool": POOL, **spec})))


def test_the_pool_is_a_valid_v1_inference_pool() -> None:
    pool = pool_of()
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1" and pool["kind"] == "InferencePool"
    assert errors_against(POOL_SCHEMA, pool) == []
    picker = pool_of(
        inferencePool={"endpointPickerRef": {"name": "epp", "port": 9443, "failureMode": "FailOpen"}}
    )
    assert errors_against(POOL_SCHEMA, picker) == []
    assert picker["spec"]["endpointPickerRef"] == {
        "kind": "Service",
        "name": "epp",
        "port": {"number": 9443},
        "failureMode": "FailOpen",
    }


def test_the_vendored_schema_refuses_what_the_protocol_refuses() -> None:
    """The check can fail: a Service reference without a port (a CEL rule), no selector labels, two
    target ports (v1.0.0 takes one), and a pool without an endpoint picker."""
    pool = pool_of()
    no_port = copy.deepcopy(pool)
    del no_port["spec"]["endpointPickerRef"]["port"]
    assert errors_against(POOL_SCHEMA, no_port) == [
        "port is required when kind is 'Service' or unspecified (defaults to 'Service')"
    ]
    broken = copy.deepcopy(pool)
    broken["spec"]["targetPorts"] = [{"number": 8000}, {"number": 8001}]
    del broken["spec"]["endpointPickerRef"]
    broken["spec"]["selector"]["matchLabels"]["bad"] = "not a label value!"
    assert len(errors_against(POOL_SCHEMA, broken)) == 3


def test_the_pool_selects_exactly_the_engine_pods_on_the_engine_port() -> None:
    idep = parse(body(inferencePool=POOL))
    objects = {obj["kind"]: obj for obj in desired_objects(idep)}
    pool = objects["InferencePool"]
    template = objects["Deployment"]["spec"]["template"]
    assert (
        pool["spec"]["selector"]["matchLabels"]
        == selector_labels(idep)
        == objects["Service"]["spec"]["selector"]
    )
    assert pool["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    (container,) = template["spec"]["containers"]
    assert pool["spec"]["targetPorts"] == [{"number": ENGINE_PORT}]
    assert {"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"} in container["ports"]
    owner = pool["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["controller"]) == ("InferenceDeployment", idep.name, True)
    assert pool["metadata"]["name"] == f"{idep.name}-engine"
    assert "InferencePool" not in {obj["kind"] for obj in desired_objects(parse(body()))}


@pytest.fixture(scope="module")
def emulated() -> Iterator[Emulated]:
    with emulated_cluster(engines=1) as emulated:
        yield emulated


def reconcile_live(emulated: Emulated, name: str, config: OperatorConfig) -> dict[str, Any]:
    live = emulated.cluster.get("InferenceDeployment", name)
    assert live is not None
    return asyncio.run(reconcile(emulated.kube, live, config))


def test_the_operator_makes_repairs_and_removes_the_pool(emulated: Emulated) -> None:
    cluster = emulated.cluster
    cluster.create(inference_deployment("pooled", inferencePool=POOL))
    reconcile_live(emulated, "pooled", CONFIG)
    pool = cluster.get("InferencePool", "pooled-engine")
    assert pool is not None and errors_against(POOL_SCHEMA, pool) == []
    cluster.patch("InferencePool", "pooled-engine", {"spec": {"targetPorts": [{"number": 9999}]}})
    reconcile_live(emulated, "pooled", CONFIG)
    assert cluster.get("InferencePool", "pooled-engine")["spec"]["targetPorts"] == [{"number": ENGINE_PORT}]
    cluster.patch("InferenceDeployment", "pooled", {"spec": {"inferencePool": None}})
    reconcile_live(emulated, "pooled", CONFIG)
    assert cluster.get("InferencePool", "pooled-engine") is None
    assert cluster.get("Deployment", "pooled-engine") is not None


def test_an_operator_without_the_switch_says_what_to_set(emulated: Emulated) -> None:
    cluster = emulated.cluster
    cluster.create(inference_deployment("unpooled", inferencePool=POOL))
    before = len(list(cluster.api))
    status = reconcile_live(emulated, "unpooled", dataclasses.replace(CONFIG, inference_pools=False))
    # Nothing an operator without the grant would be refused was asked of the API server, not even a read.
    asked = [r.resource.plural for r in list(cluster.api)[before:] if r.resource is not None]
    assert "deployments" in asked and "inferencepools" not in asked
    assert cluster.get("Deployment", "unpooled-engine") is not None  # the engines are made all the same
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == events.INFERENCE_POOL_DISABLED
    assert "inferencePools.enabled=true" in degraded["message"]
    assert events.INFERENCE_POOL_DISABLED in [e["reason"] for e in emulated.events("unpooled")]


def test_the_chart_grants_inference_pools_only_when_enabled() -> None:
    call = ("inference.networking.k8s.io", "inferencepools", "create")
    default = render(None)
    assert not grants(operator_rules(default)[0], call)
    assert operator_env(default)["LORAPLEX_OPERATOR_INFERENCE_POOLS"]["value"] == "false"
    for scope in ({}, {"operator": {"clusterScope": True}}):
        objects = render({"inferencePools": {"enabled": True}, **scope})
        namespaced, cluster_wide = operator_rules(objects)
        for verb in ("get", "create", "patch", "delete"):
            assert grants(namespaced, (*call[:2], verb))
        assert not grants(cluster_wide, call)
        assert operator_env(objects)["LORAPLEX_OPERATOR_INFERENCE_POOLS"]["value"] == "true"


def test_the_operator_gets_the_internal_token_for_metrics() -> None:
    env = operator_env(render(None))
    assert env["LORAPLEX_OPERATOR_INTERNAL_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "loraplex-secrets",
        "key": "internal-token",
    }
    assert OperatorConfig.from_env({"LORAPLEX_OPERATOR_INTERNAL_TOKEN": " t "}).internal_token == "t"
    assert "t0k" not in repr(OperatorConfig(internal_token="t0k"))


def operator_env(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    operator = next(
        o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("operator")
    )
    return {e["name"]: e for e in operator["spec"]["template"]["spec"]["containers"][0]["env"]}

"""desired_objects: the children an InferenceDeployment owns, and the apply plan against live objects."""

from __future__ import annotations

import copy

import kubernetes_validate
import pytest

from loraplex.operator.apply import is_subset, plan
from loraplex.operator.resources import HASH_ANNOTATION, desired_objects, engine_args
from loraplex.operator.spec import parse
from tests.operator.helpers import KUBE_VERSION, body


def by_kind(objects: list[dict]) -> dict[str, dict]:
    return {obj["kind"]: obj for obj in objects}


def test_gpu_example_children() -> None:
    objs = by_kind(desired_objects(parse(body())))
    assert set(objs) == {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget"}
    container = objs["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][:7] == [
        "serve",
        "--model",
        "hf://meta-llama/Meta-Llama-3-8B-Instruct",
        "--dtype",
        "bfloat16",
        "--port",
        "8000",
    ]
    assert container["args"][7:] == ["--log-level", "info"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    pod = objs["Deployment"]["spec"]["template"]["spec"]
    assert pod["volumes"] == [{"name": "model-cache", "emptyDir": {}}]
    assert pod["topologySpreadConstraints"][0]["topologyKey"] == "kubernetes.io/hostname"
    assert objs["ConfigMap"]["data"]["LORAPLEX_MAX_RESIDENT_ADAPTERS"] == "128"
    env = {e["name"] for e in container["env"]}
    assert {"LORAPLEX_INTERNAL_TOKEN", "AWS_ACCESS_KEY_ID"} <= env
    for obj in objs.values():
        owner = obj["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["uid"], owner["controller"]) == ("InferenceDeployment", "uid-1", True)


def test_cpu_example_has_no_gpu_and_a_pdb_that_allows_drains() -> None:
    objs = by_kind(desired_objects(parse(body("minimal-cpu.yaml"))))
    container = objs["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in container["resources"]["limits"]
    assert "tolerations" not in objs["Deployment"]["spec"]["template"]["spec"]
    assert objs["ConfigMap"]["data"]["LORAPLEX_DEVICE"] == "cpu"
    assert objs["PodDisruptionBudget"]["spec"] == {
        "maxUnavailable": 1,
        "selector": objs["Deployment"]["spec"]["selector"],
    }


def test_hpa_mode_adds_a_pods_metric_hpa() -> None:
    idep = parse(body(autoscaling={"mode": "hpa", "metric": "pool_utilization", "target": 0.75}))
    hpa = by_kind(desired_objects(idep))["HorizontalPodAutoscaler"]
    metric = hpa["spec"]["metrics"][0]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == "loraplex_pool_utilization"
    assert metric["pods"]["target"]["averageValue"] == "750m"
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 8)


def test_extra_args_change_changes_the_deployment_hash() -> None:
    before = by_kind(desired_objects(parse(body())))["Deployment"]
    after_idep = parse(body(engine={"image": "ghcr.io/loraplex/engine:0.2.0", "extraArgs": ["--x"]}))
    after = by_kind(desired_objects(after_idep))["Deployment"]
    assert engine_args(after_idep)[-1] == "--x"
    assert (
        before["metadata"]["annotations"][HASH_ANNOTATION]
        != after["metadata"]["annotations"][HASH_ANNOTATION]
    )


def test_config_change_rolls_the_pods() -> None:
    before = by_kind(desired_objects(parse(body())))["Deployment"]
    after = by_kind(desired_objects(parse(body(engine={"image": "i", "maxBatchTokens": 4096}))))["Deployment"]
    key = "loraplex.dev/config-hash"
    assert (
        before["spec"]["template"]["metadata"]["annotations"][key]
        != (after["spec"]["template"]["metadata"]["annotations"][key])
    )


@pytest.mark.parametrize("example", ["gpu.yaml", "minimal-cpu.yaml"])
@pytest.mark.parametrize("mode", ["builtin", "hpa", "off"])
def test_every_child_validates_strictly(example: str, mode: str) -> None:
    for obj in desired_objects(parse(body(example, autoscaling={"mode": mode}))):
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


def test_strict_validation_catches_a_typo() -> None:
    deployment = by_kind(desired_objects(parse(body())))["Deployment"]
    deployment["spec"]["replicaz"] = 2
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBE_VERSION, strict=True)


def test_plan_creates_then_leaves_alone_then_repairs() -> None:
    idep = parse(body())
    deployment = by_kind(desired_objects(idep))["Deployment"]
    assert plan(deployment, None, idep) == ("create", deployment)
    live = copy.deepcopy(deployment)
    live["metadata"]["resourceVersion"] = "7"
    live["status"] = {"readyReplicas": 1}
    live["spec"]["template"]["spec"]["containers"][0]["terminationMessagePath"] = "/dev/termination-log"
    assert plan(deployment, live, idep) is None  # server defaults are not drift
    live["spec"]["template"]["spec"]["containers"][0]["image"] = "evil:latest"
    action, patch = plan(deployment, live, idep)  # type: ignore[misc]
    assert action == "patch"
    assert patch["metadata"]["resourceVersion"] == "7"
    assert patch["spec"]["template"]["spec"]["containers"][0]["image"] == "ghcr.io/loraplex/engine:0.1.0"


def test_plan_keeps_the_autoscalers_replicas_within_bounds() -> None:
    idep = parse(body())  # replicas 1..8, builtin
    deployment = by_kind(desired_objects(idep))["Deployment"]
    live = copy.deepcopy(deployment)
    live["spec"]["replicas"] = 5
    assert plan(deployment, live, idep) is None
    live["spec"]["replicas"] = 12
    _, patch = plan(deployment, live, idep)  # type: ignore[misc]
    assert patch["spec"]["replicas"] == 8
    fixed = parse(body(autoscaling={"mode": "off"}, replicas={"min": 2, "max": 2}))
    live["spec"]["replicas"] = 5
    _, patch = plan(by_kind(desired_objects(fixed))["Deployment"], live, fixed)  # type: ignore[misc]
    assert patch["spec"]["replicas"] == 2


def test_pdb_patch_drops_the_other_budget_form() -> None:
    one = parse(body())
    three = parse(body(replicas={"min": 3, "max": 8}))
    live = by_kind(desired_objects(one))["PodDisruptionBudget"]
    _, patch = plan(by_kind(desired_objects(three))["PodDisruptionBudget"], live, three)  # type: ignore[misc]
    assert patch["spec"]["minAvailable"] == 2
    assert patch["spec"]["maxUnavailable"] is None


def test_is_subset() -> None:
    assert is_subset({"a": [{"b": 1}]}, {"a": [{"b": 1, "c": 2}], "d": 3})
    assert not is_subset({"a": [{"b": 1}]}, {"a": [{"b": 1}, {"b": 2}]})
    assert not is_subset({"a": 1}, {})

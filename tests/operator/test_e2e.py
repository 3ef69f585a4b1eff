"""kopf end to end: the real operator (loraplex.operator.main) against the strict API emulator.

One operator and one pretend cluster serve the whole module; the tests run in order, as a story:
create, change, repair, reject, autoscale, delete.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kopf
import pytest

from tests.operator.cluster import Cluster, wait_for
from tests.operator.helpers import example
from tests.operator.rbac import operator_rules, ungranted
from tests.operator.test_chart import render

pytestmark = pytest.mark.timeout(120)
NAME = "llama"
CHILD = f"{NAME}-engine"
CHILD_KINDS = ("Deployment", "Service", "ConfigMap", "PodDisruptionBudget")
OPERATOR_TOKEN = "fake-token"
# Granted and needed, but the story may not get there: an Event repeated within its aggregation is read
# and patched (timing decides whether the story repeats one), and the HPA never drifts between its creation
# and removal.
MAY_GO_UNUSED = {
    ("", "events", "get"),
    ("", "events", "patch"),
    ("autoscaling", "horizontalpodautoscalers", "patch"),
}


# The engines' /metrics is behind the internal token; the operator has it as the chart gives it.
ENGINE_TOKEN = "engine-internal-token"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    fake = Cluster(engines=6)
    fake.start()
    fake.require_token(ENGINE_TOKEN)
    try:
        yield fake
    finally:
        fake.stop()


@pytest.fixture(scope="module")
def operator(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    env = pytest.MonkeyPatch()
    env.setenv("KUBECONFIG", str(cluster.write_kubeconfig(tmp_path_factory.mktemp("kube") / "config")))
    env.setenv("LORAPLEX_OPERATOR_RESYNC_SECONDS", "1")
    env.setenv("LORAPLEX_OPERATOR_AUTOSCALE_SECONDS", "0.5")
    env.setenv("LORAPLEX_OPERATOR_INTERNAL_TOKEN", ENGINE_TOKEN)
    # The example's Secrets, as the chart's allow-list would name them (the image is the default's).
    env.setenv("LORAPLEX_OPERATOR_ALLOWED_SECRETS", "default/loraplex-secrets,default/loraplex-adapter-store")
    import loraplex.operator.main  # noqa: F401  (registers the handlers in kopf's default registry)

    # kopf's own kubeconfig login reads the file the client library found at import; point it here instead.
    @kopf.on.startup()
    def no_scanning(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.scanning.disabled = True  # one given namespace: no namespace or CRD discovery watches

    @kopf.on.login()
    def login(**_: Any) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=cluster.url, token=OPERATOR_TOKEN, default_namespace="default")

    stop, ready = threading.Event(), threading.Event()
    thread = threading.Thread(
        target=kopf.run,
        kwargs={
            "standalone": True,
            "clusterwide": False,
            "namespaces": ["default"],
            "stop_flag": stop,
            "ready_flag": ready,
        },
        name="kopf",
        daemon=True,
    )
    thread.start()
    try:
        assert ready.wait(30), "kopf did not start within 30 s"
        yield
    finally:
        stop.set()
        thread.join(timeout=30)
        env.undo()
    assert not thread.is_alive(), "kopf did not stop within 30 s"


def inference_deployment(name: str = NAME, **spec: Any) -> dict[str, Any]:
    body = copy.deepcopy(example("gpu.yaml"))
    body["metadata"] = {"name": name, "namespace": "default"}
    body["spec"]["replicas"] = {"min": 1, "max": 4}
    body["spec"]["autoscaling"] = {"mode": "builtin", "target": 4, "scaleDownStabilizationSeconds": 2}
    body["spec"].update(spec)
    return body


def condition(cluster: Cluster, name: str, kind: str) -> dict[str, Any]:
    obj = cluster.get("InferenceDeployment", name) or {}
    return next((c for c in obj.get("status", {}).get("conditions", []) if c["type"] == kind), {})


def container(cluster: Cluster) -> dict[str, Any]:
    deployment = cluster.get("Deployment", CHILD) or {"spec": {"template": {"spec": {"containers": [{}]}}}}
    return deployment["spec"]["template"]["spec"]["containers"][0]


def test_create_makes_children_and_reports_ready(cluster: Cluster, operator: None) -> None:
    cluster.set_load(4.0)  # exactly on target: the autoscaler holds
    created = cluster.create(inference_deployment())
    for kind in CHILD_KINDS:
        wait_for(lambda kind=kind: cluster.get(kind, CHILD), what=f"{kind} {CHILD}")
    deployment = cluster.get("Deployment", CHILD)
    assert deployment["metadata"]["ownerReferences"][0]["uid"] == created["metadata"]["uid"]
    assert container(cluster)["args"][:3] == ["serve", "--model", "hf://meta-llama/Meta-Llama-3-8B-Instruct"]
    wait_for(lambda: condition(cluster, NAME, "Ready").get("status") == "True", what="Ready=True")
    status = cluster.get("InferenceDeployment", NAME)["status"]
    assert status["phase"] == "Running"
    assert status["observedGeneration"] == 1
    assert status["readyReplicas"] == 1
    assert status["endpoint"] == "http://llama-engine.default.svc:8000"
    assert condition(cluster, NAME, "Progressing")["reason"] == "RolloutComplete"
    assert condition(cluster, NAME, "Degraded")["status"] == "False"


def test_spec_change_rolls_out(cluster: Cluster, operator: None) -> None:
    engine = {"image": "ghcr.io/loraplex/engine:0.2.0", "extraArgs": ["--max-queue", "64"]}
    cluster.patch("InferenceDeployment", NAME, {"spec": {"engine": engine}})
    wait_for(lambda: container(cluster).get("image") == engine["image"], what="new image")
    assert container(cluster)["args"][-2:] == ["--max-queue", "64"]
    wait_for(
        lambda: cluster.get("InferenceDeployment", NAME)["status"].get("observedGeneration") == 2,
        what="observedGeneration 2",
    )
    # hpa mode adds an HPA on the Pods metric; leaving it removes the HPA again.
    cluster.patch("InferenceDeployment", NAME, {"spec": {"autoscaling": {"mode": "hpa"}}})
    hpa = wait_for(lambda: cluster.get("HorizontalPodAutoscaler", CHILD), what="HPA")
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "loraplex_requests_waiting"
    cluster.patch("InferenceDeployment", NAME, {"spec": {"autoscaling": {"mode": "builtin"}}})
    wait_for(lambda: cluster.get("HorizontalPodAutoscaler", CHILD) is None, what="HPA removed")


def test_deleted_and_edited_children_are_restored(cluster: Cluster, operator: None) -> None:
    cluster.delete("Service", CHILD)
    cluster.delete("Deployment", CHILD)
    wait_for(lambda: cluster.get("Service", CHILD), what="Service restored")
    wait_for(lambda: cluster.get("Deployment", CHILD), what="Deployment restored")
    cluster.patch("ConfigMap", CHILD, {"data": {"LORAPLEX_MAX_BATCH_TOKENS": "1"}})
    wait_for(
        lambda: cluster.get("ConfigMap", CHILD)["data"]["LORAPLEX_MAX_BATCH_TOKENS"] == "16384",
        what="ConfigMap repaired",
    )
    cluster.patch("Deployment", CHILD, {"spec": {"template": {"spec": {"containers": [{"name": "x"}]}}}})
    wait_for(lambda: container(cluster).get("name") == "engine", what="Deployment repaired")
    cluster.patch("Service", CHILD, {"spec": {"ports": [{"name": "http", "port": 9999}]}})
    wait_for(
        lambda: cluster.get("Service", CHILD)["spec"]["ports"][0]["port"] == 8000, what="Service repaired"
    )
    cluster.patch("PodDisruptionBudget", CHILD, {"spec": {"maxUnavailable": 7}})
    wait_for(
        lambda: cluster.get("PodDisruptionBudget", CHILD)["spec"].get("maxUnavailable") == 1,
        what="PodDisruptionBudget repaired",
    )


def test_invalid_spec_is_degraded_with_the_reason(cluster: Cluster, operator: None) -> None:
    cluster.create(inference_deployment("broken", replicas={"min": 5, "max": 2}))
    degraded = wait_for(
        lambda: (
            condition(cluster, "broken", "Degraded").get("status") == "True"
            and condition(cluster, "broken", "Degraded")
        ),
        what="Degraded=True",
    )
    assert degraded["reason"] == "InvalidSpec"
    assert "spec.replicas.min (5) exceeds spec.replicas.max (2)" in degraded["message"]
    assert cluster.get("InferenceDeployment", "broken")["status"]["phase"] == "Degraded"
    assert cluster.get("Deployment", "broken-engine") is None
    # Fixing the spec heals it.
    cluster.patch("InferenceDeployment", "broken", {"spec": {"replicas": {"min": 1, "max": 2}}})
    wait_for(lambda: condition(cluster, "broken", "Degraded").get("status") == "False", what="healed")
    assert cluster.get("Deployment", "broken-engine") is not None
    cluster.delete("InferenceDeployment", "broken")


def test_builtin_autoscaler_follows_engine_metrics(cluster: Cluster, operator: None) -> None:
    def replicas() -> int:
        return int((cluster.get("Deployment", CHILD) or {}).get("spec", {}).get("replicas") or 0)

    cluster.set_load(16.0)  # 4x the target per pod
    wait_for(lambda: replicas() == 4, timeout=60, what="scale up to max (4)")
    decision = wait_for(
        lambda: (
            cluster.get("InferenceDeployment", NAME)["status"].get("autoscaling", {}).get("desiredReplicas")
            == 4
            and cluster.get("InferenceDeployment", NAME)["status"]["autoscaling"]
        ),
        what="decision in status",
    )
    assert decision["metric"] == "waiting_requests"
    # The fake kubelet makes the pods a moment after the Deployment's replicas change: wait for them.
    wait_for(lambda: len(cluster.list("Pod")) >= 4, what="4 engine pods")
    cluster.set_load(0.0)
    # After the 2 s stabilization window, down by at most 50% per minute: 4 -> 2.
    wait_for(lambda: replicas() == 2, timeout=60, what="scale down to 2")
    # The decision reaches the status just after the Deployment's patch: wait for it, then check why.
    decision = wait_for(
        lambda: (
            cluster.get("InferenceDeployment", NAME)["status"].get("autoscaling", {}).get("desiredReplicas")
            == 2
            and cluster.get("InferenceDeployment", NAME)["status"]["autoscaling"]
        ),
        what="the scale-down decision in status",
    )
    assert decision["reason"] == "RateLimited"


def test_builtin_autoscaler_scales_on_adapter_demand(cluster: Cluster, operator: None) -> None:
    """The queue on target, but each pod asked for twice the adapters it has slots for: the adapter_demand
    signal scales up, and the Event and status say so."""

    def replicas() -> int:
        return int((cluster.get("Deployment", CHILD) or {}).get("spec", {}).get("replicas") or 0)

    start = replicas()
    cluster.set_load(4.0)
    cluster.set_adapters(8)  # max_lora 4
    cluster.patch(
        "InferenceDeployment",
        NAME,
        {"spec": {"autoscaling": {"signals": [{"metric": "adapter_demand", "target": 1}]}}},
    )
    wait_for(lambda: replicas() == 4, timeout=60, what=f"scale up from {start} to max (4) on adapter demand")
    decision = wait_for(
        lambda: (
            cluster.get("InferenceDeployment", NAME)["status"].get("autoscaling", {}).get("metric")
            == "adapter_demand"
            and cluster.get("InferenceDeployment", NAME)["status"]["autoscaling"]
        ),
        what="the adapter_demand decision in status",
    )
    assert decision["target"] == 1 and decision["value"] == 2.0
    assert decision["unplacedAdapters"] >= 8  # 8 in flight per pod, 4 slots each
    assert [s["metric"] for s in decision["signals"]] == ["waiting_requests", "adapter_demand"]
    scaled = [
        e
        for e in cluster.list("Event")
        if e["reason"] == "ScaledUp" and "adapter_demand 2 per ready pod, target 1" in e["message"]
    ]
    assert scaled, [e["message"] for e in cluster.list("Event")]
    cluster.set_adapters(0)


def test_delete_garbage_collects_children(cluster: Cluster, operator: None) -> None:
    cluster.delete("InferenceDeployment", NAME)
    wait_for(lambda: cluster.get("InferenceDeployment", NAME) is None, what="CR gone")
    for kind in CHILD_KINDS:
        wait_for(lambda kind=kind: cluster.get(kind, CHILD) is None, what=f"{kind} collected")
    wait_for(lambda: cluster.get("InferenceDeployment", "broken") is None, what="second CR gone")


def test_every_call_the_operator_made_is_one_the_chart_grants(cluster: Cluster, operator: None) -> None:
    """The emulator does not enforce RBAC, so compare: everything the story above made the operator do
    against the chart's rules for a namespaced install, and every namespaced verb granted was used."""
    calls = cluster.api.calls[OPERATOR_TOKEN]
    objects = render(None)
    missing = ungranted(calls, objects, peering="loraplex-operator")
    assert not missing, f"not granted: {missing}; all calls: {sorted(calls)}"
    namespaced, _ = operator_rules(objects)
    granted = {
        (group, resource, verb)
        for rule in namespaced
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    unused = granted - calls
    assert unused <= MAY_GO_UNUSED, f"granted but never used: {sorted(unused - MAY_GO_UNUSED)}"


def test_kubeconfig_is_written(tmp_path: Path) -> None:
    fake = Cluster(engines=0)
    fake.url = "http://127.0.0.1:1"
    assert "127.0.0.1:1" in fake.write_kubeconfig(tmp_path / "c").read_text()

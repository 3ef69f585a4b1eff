"""desired_objects: the children an InferenceDeployment owns, and the apply plan against live objects."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import kopf
import kubernetes_validate
import pytest

from loraplex.operator import main as operator_main
from loraplex.operator.apply import is_subset, plan
from loraplex.operator.config import OperatorConfig
from loraplex.operator.main import reconcile, resync_interval
from loraplex.operator.resources import HASH_ANNOTATION, desired_objects, engine_args
from loraplex.operator.spec import parse
from loraplex.operator.status import MAX_FAILURE_MESSAGE, condition, engine_failure, healthy_status
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
    assert container["args"][7:] == ["--max-num-seqs", "128"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    pod = objs["Deployment"]["spec"]["template"]["spec"]
    assert pod["volumes"] == [
        {"name": "model-cache", "emptyDir": {"sizeLimit": "40Gi"}},
        {"name": "tmp", "emptyDir": {}},
    ]
    assert {m["mountPath"] for m in container["volumeMounts"]} == {"/var/cache/loraplex", "/tmp"}
    assert pod["topologySpreadConstraints"][0]["topologyKey"] == "kubernetes.io/hostname"
    assert pod["automountServiceAccountToken"] is False
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
    data = objs["ConfigMap"]["data"]
    assert data["LORAPLEX_MAX_RESIDENT_ADAPTERS"] == "128"
    assert data["LORAPLEX_ADAPTER_STORE"] == "s3://loraplex-adapters/prod"
    assert data["LORAPLEX_MODEL_CACHE"] == "/var/cache/loraplex"
    assert data["AWS_REGION"] == "us-east-1"
    assert "LORAPLEX_S3_ENDPOINT_URL" not in data
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"]}
    assert env == {
        "LORAPLEX_INTERNAL_TOKEN": {"name": "loraplex-secrets", "key": "internal-token"},
        "AWS_ACCESS_KEY_ID": {"name": "loraplex-adapter-store", "key": "AWS_ACCESS_KEY_ID"},
        "AWS_SECRET_ACCESS_KEY": {"name": "loraplex-adapter-store", "key": "AWS_SECRET_ACCESS_KEY"},
    }
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


def test_a_deleted_engine_pod_serves_through_its_handover_before_sigterm() -> None:
    """The preStop keeps a leaving pod serving while the gateway warms its adapters' new pods; it ends well
    inside the grace period, which must still hold the drain after SIGTERM."""
    pod = by_kind(desired_objects(parse(body("minimal-cpu.yaml"))))["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep" and 0 < int(command[1]) <= pod["terminationGracePeriodSeconds"] // 2


def test_store_endpoint_and_a_model_cache_claim() -> None:
    store = {"uri": "s3://adapters", "endpointUrl": "http://minio.storage.svc:9000"}
    objs = by_kind(desired_objects(parse(body(adapterStore=store, modelCache={"claimName": "models"}))))
    assert objs["ConfigMap"]["data"]["LORAPLEX_S3_ENDPOINT_URL"] == "http://minio.storage.svc:9000"
    assert "AWS_REGION" not in objs["ConfigMap"]["data"]
    pod = objs["Deployment"]["spec"]["template"]["spec"]
    assert pod["volumes"][0] == {"name": "model-cache", "persistentVolumeClaim": {"claimName": "models"}}
    names = [e["name"] for e in pod["containers"][0]["env"]]
    assert names == ["LORAPLEX_INTERNAL_TOKEN"]  # no secretRef: no credentials (workload identity)


def test_hpa_mode_adds_a_pods_metric_hpa() -> None:
    idep = parse(body(autoscaling={"mode": "hpa", "metric": "pool_utilization", "target": 0.75}))
    hpa = by_kind(desired_objects(idep))["HorizontalPodAutoscaler"]
    metric = hpa["spec"]["metrics"][0]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == "loraplex_pool_utilization"
    assert metric["pods"]["target"]["averageValue"] == "750m"
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 8)


def test_quantization_travels_as_a_serve_flag_only_when_set() -> None:
    # Unset, the args stay as they were, so an operator upgrade does not roll existing deployments.
    assert "--quantization" not in engine_args(parse(body()))
    quantized = parse(body(model={"uri": "/models/m.gguf", "quantization": "int4"}))
    args = engine_args(quantized)
    assert args[args.index("--quantization") + 1] == "int4"
    assert args.index("--quantization") < len(args) - len(quantized.spec.engine.extra_args)
    before = by_kind(desired_objects(parse(body(model={"uri": "/models/m.gguf"}))))["Deployment"]
    after = by_kind(desired_objects(quantized))["Deployment"]
    assert (
        before["metadata"]["annotations"][HASH_ANNOTATION]
        != after["metadata"]["annotations"][HASH_ANNOTATION]
    )


def test_extra_args_change_changes_the_deployment_hash() -> None:
    before = by_kind(desired_objects(parse(body())))["Deployment"]
    extra = ["--max-queue", "64"]
    after_idep = parse(body(engine={"image": "ghcr.io/loraplex/engine:0.2.0", "extraArgs": extra}))
    after = by_kind(desired_objects(after_idep))["Deployment"]
    assert engine_args(after_idep)[-2:] == extra
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


# --- status: engine pods that fail to start ------------------------------------------------------------


def pod(name: str, **container_status: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "status": {"containerStatuses": [{"name": "engine", **container_status}]},
    }


MODEL_MISSING = "loraplex serve: model s3://models/llama: NoSuchKey: the object does not exist\n"


def test_engine_failure_reads_the_termination_message() -> None:
    crashing = pod(
        "m-engine-1",
        state={"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 5m0s restarting"}},
        lastState={"terminated": {"exitCode": 2, "message": MODEL_MISSING}},
    )
    running = pod("m-engine-0", state={"running": {}})
    assert engine_failure([running]) is None
    assert engine_failure([running, crashing]) == (
        "pod m-engine-1: CrashLoopBackOff: loraplex serve: model s3://models/llama: "
        "NoSuchKey: the object does not exist"
    )
    exited = pod("m-engine-2", state={"terminated": {"exitCode": 1, "message": "a\nb\n\nc"}})
    assert engine_failure([exited]) == "pod m-engine-2: exited with code 1: a | b | c"
    pulling = pod("m-engine-3", state={"waiting": {"reason": "ImagePullBackOff", "message": "no such image"}})
    assert engine_failure([pulling]) == "pod m-engine-3: ImagePullBackOff: no such image"
    starting = pod("m-engine-4", state={"waiting": {"reason": "ContainerCreating"}})
    assert engine_failure([starting]) is None
    going = {**crashing, "metadata": {"name": "x", "deletionTimestamp": "2026-11-23T13:00:00Z"}}
    assert engine_failure([going]) is None
    huge = pod("m", state={"terminated": {"exitCode": 1, "message": "x" * 5000}})
    assert len(engine_failure([huge]) or "") == MAX_FAILURE_MESSAGE


def test_failing_engines_make_the_status_degraded_with_the_reason() -> None:
    deployment = {"metadata": {"generation": 1}, "spec": {"replicas": 1}, "status": {"observedGeneration": 1}}
    status = healthy_status(deployment, 1, 3, "http://e", "sel", failure="pod p: CrashLoopBackOff: no model")
    conditions = {c["type"]: c for c in status["conditions"]}
    assert status["phase"] == "Degraded"
    assert (conditions["Ready"]["status"], conditions["Ready"]["reason"]) == ("False", "EngineFailing")
    assert "no model" in conditions["Ready"]["message"]
    assert conditions["Degraded"] == condition(
        "Degraded", True, "EngineFailing", "pod p: CrashLoopBackOff: no model", 3
    )
    # Enough replicas still serve (a bad rollout): Ready stays True, Degraded says why.
    ready = {**deployment, "status": {"observedGeneration": 1, "readyReplicas": 1, "updatedReplicas": 1}}
    status = healthy_status(ready, 1, 3, "http://e", "sel", failure="pod q: exited with code 2")
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Ready"]["status"] == "True" and conditions["Degraded"]["reason"] == "EngineFailing"
    assert status["phase"] == "Running"
    healthy = {c["type"]: c for c in healthy_status(ready, 1, 3, "http://e", "sel")["conditions"]}
    assert healthy["Degraded"]["status"] == "False"


# The examples' namespace may use its Secrets (the policy itself is tested in test_policy.py).
PERMISSIVE = OperatorConfig(allowed_secrets=("loraplex/*",))


class FakeKube:
    """The few KubeClient calls reconcile makes, over a dict of objects: enough to test the wiring."""

    def __init__(self, pods: list[dict[str, Any]]) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.pods = pods
        self.status_patches: list[dict[str, Any]] = []

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self.objects.get((kind, name))

    async def get_namespace(self, name: str) -> dict[str, Any] | None:
        return None

    async def list(self, kind: str, namespace: str, selector: str) -> list[dict[str, Any]]:
        assert (kind, selector) == (
            "Pod",
            "app.kubernetes.io/instance=llama3-8b,app.kubernetes.io/name=loraplex-engine",
        )
        return self.pods

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.objects[(obj["kind"], obj["metadata"]["name"])] = obj
        return obj

    async def patch(
        self, kind: str, namespace: str, name: str, patch: dict[str, Any], subresource: str | None = None
    ) -> dict[str, Any]:
        if kind == "Event":
            return patch
        assert (kind, subresource) == ("InferenceDeployment", "status")
        self.status_patches.append(patch["status"])
        return patch

    async def delete(self, kind: str, namespace: str, name: str) -> None:
        self.objects.pop((kind, name), None)


def test_reconcile_reports_a_model_that_does_not_load() -> None:
    crashing = pod(
        "llama3-8b-engine-abc",
        state={"waiting": {"reason": "CrashLoopBackOff"}},
        lastState={"terminated": {"exitCode": 2, "message": MODEL_MISSING}},
    )
    kube = FakeKube([crashing])
    status = asyncio.run(reconcile(kube, body(), PERMISSIVE))  # type: ignore[arg-type]
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["reason"] == "EngineFailing" and "NoSuchKey" in ready["message"]
    assert kube.status_patches[-1]["phase"] == "Degraded"


def ready_status(ready: bool) -> dict[str, Any]:
    conditions = [condition("Ready", ready, "R", "", 1), condition("Degraded", not ready, "D", "", 1)]
    return {"conditions": conditions}


def test_the_resync_interval_is_short_until_the_status_says_ready() -> None:
    config = OperatorConfig(resync_seconds=30, converging_resync_seconds=5)
    assert resync_interval(None, config) == 5  # never reconciled yet
    assert resync_interval({}, config) == 5
    assert resync_interval(ready_status(False), config) == 5  # rolling out, or EngineFailing
    assert resync_interval(ready_status(True), config) == 30
    assert resync_interval(None, OperatorConfig(resync_seconds=2, converging_resync_seconds=5)) == 2
    env = {"LORAPLEX_OPERATOR_CONVERGING_RESYNC_SECONDS": "0.5"}
    assert OperatorConfig.from_env(env).converging_resync_seconds == 0.5
    with pytest.raises(ValueError, match="CONVERGING_RESYNC_SECONDS"):
        OperatorConfig(converging_resync_seconds=0)


class Stopped:
    """kopf.DaemonStopped as the daemon reads it: truthy once stopped."""

    def __init__(self) -> None:
        self.flag = False

    def __bool__(self) -> bool:
        return self.flag


def test_the_resync_daemon_repeats_quickly_while_not_ready_then_waits_the_long_period(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A crashing engine changes no Deployment field the operator watches: only the daemon sees it."""
    statuses = [ready_status(False), ready_status(False), ready_status(True)]
    passes: list[int] = []

    async def fake_reconcile(kube: Any, body: Any, config: OperatorConfig) -> dict[str, Any]:
        passes.append(len(passes))
        return statuses[min(len(passes), len(statuses)) - 1]

    monkeypatch.setattr(operator_main, "reconcile", fake_reconcile)
    live = body()
    kube = FakeKube([])
    kube.objects[("InferenceDeployment", live["metadata"]["name"])] = live
    memo = kopf.Memo(kube=kube, config=OperatorConfig(resync_seconds=3600, converging_resync_seconds=0.01))

    async def run() -> None:
        stopped = Stopped()
        daemon = asyncio.create_task(operator_main.resync(body=live, memo=memo, stopped=stopped))
        for _ in range(500):
            if len(passes) >= 3:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)  # 30 short periods: a fourth pass now would be a bug
        stopped.flag = True
        await asyncio.wait_for(daemon, timeout=5)

    asyncio.run(run())
    assert len(passes) == 3  # two not Ready, 10 ms apart; Ready, then the hour-long period


def test_reconcile_rejects_an_unsupported_model_uri_for_good() -> None:
    kube = FakeKube([])
    with pytest.raises(kopf.PermanentError, match="scheme 'gs' is not supported"):
        asyncio.run(reconcile(kube, body(model={"uri": "gs://bucket/model"}), PERMISSIVE))  # type: ignore[arg-type]
    degraded = next(c for c in kube.status_patches[-1]["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "InvalidSpec")
    assert "use an absolute path, file://, s3://, hf://" in degraded["message"]
    assert {kind for kind, _ in kube.objects} == {"Event"}  # nothing applied, the refusal announced

"""The pure half of reconciliation: a validated InferenceDeployment in, the children it owns out.

`desired_objects(idep)` returns plain dicts (Deployment, Service, ConfigMap, PodDisruptionBudget, in hpa
mode a HorizontalPodAutoscaler, and with spec.inferencePool an InferencePool) with owner references, so
deleting the CR garbage-collects them.
Nothing here talks to a cluster; the handlers in main.py apply what this returns.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from loraplex.operator.overlay import apply_overlay
from loraplex.operator.signals import SIGNALS
from loraplex.operator.spec import GROUP, KIND, VERSION, InferenceDeployment

ENGINE_PORT = 8000
MODEL_CACHE_DIR = "/var/cache/loraplex"
# Engine pods run as this uid whatever USER the image names, so runAsNonRoot is checkable by the kubelet.
ENGINE_UID = 65532
# Seconds an engine pod being deleted keeps serving (its preStop) while its adapters are prewarmed
# elsewhere; within terminationGracePeriodSeconds with room for the drain after SIGTERM.
HANDOVER_SECONDS = 10
MANAGED_BY = "loraplex-operator"
# Holds the hash of the desired child: a child whose annotation differs (or is missing) is re-applied.
HASH_ANNOTATION = "loraplex.dev/desired-hash"
# On the pod template: a changed ConfigMap rolls the pods, since envFrom is read only at start.
CONFIG_HASH_ANNOTATION = "loraplex.dev/config-hash"
# The per-pod metric an HPA reads for each signal it can scale on: the engine's own gauges, or a
# Prometheus adapter's rule over the engine's series (docs/operator.md gives the rules).
METRIC_NAMES = {name: signal.hpa_metric for name, signal in SIGNALS.items() if signal.hpa_metric}
# The InferencePool API (Gateway API Inference Extension) whose pools the operator may make.
INFERENCE_POOL_API = "inference.networking.k8s.io/v1"


def child_name(idep: InferenceDeployment) -> str:
    return f"{idep.name}-engine"


def selector_labels(idep: InferenceDeployment) -> dict[str, str]:
    return {"app.kubernetes.io/name": "loraplex-engine", "app.kubernetes.io/instance": idep.name}


def labels(idep: InferenceDeployment) -> dict[str, str]:
    return {
        **selector_labels(idep),
        "app.kubernetes.io/component": "engine",
        "app.kubernetes.io/part-of": "loraplex",
        "app.kubernetes.io/managed-by": MANAGED_BY,
    }


def selector_string(idep: InferenceDeployment) -> str:
    return ",".join(f"{key}={value}" for key, value in sorted(selector_labels(idep).items()))


def endpoint(idep: InferenceDeployment) -> str:
    return f"http://{child_name(idep)}.{idep.namespace}.svc:{ENGINE_PORT}"


def desired_objects(idep: InferenceDeployment) -> list[dict[str, Any]]:
    """Every child object, in apply order (the ConfigMap before the pods that read it)."""
    config = config_map(idep)
    engine = deployment(idep, content_hash(config["data"]))
    objects = [config, engine, service(idep), pod_disruption_budget(idep)]
    if idep.spec.autoscaling.mode == "hpa":
        objects.append(horizontal_pod_autoscaler(idep))
    if idep.spec.inference_pool is not None:
        objects.append(inference_pool(idep))
    for obj in objects:
        obj["metadata"].setdefault("annotations", {})[HASH_ANNOTATION] = content_hash(obj)
    return objects


def content_hash(value: Any) -> str:
    """A short stable digest of a JSON-able value (sorted keys)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def engine_args(idep: InferenceDeployment) -> list[str]:
    """The engine command line: the contract with `loraplex serve`; tuning knobs travel in the ConfigMap."""
    model = idep.spec.model
    args = ["serve", "--model", model.uri, "--dtype", model.dtype, "--port", str(ENGINE_PORT)]
    if model.quantization != "none":  # absent when unset, so existing deployments keep their pod template
        args += ["--quantization", model.quantization]
    return [*args, *idep.spec.engine.extra_args]


def config_map(idep: InferenceDeployment) -> dict[str, Any]:
    spec = idep.spec
    # Every key is a field of engine/server/settings.py (tests/operator/test_contract.py checks it).
    data = {
        "LORAPLEX_DEVICE": "cuda" if spec.resources.gpus_per_replica > 0 else "cpu",
        "LORAPLEX_POOL_FRACTION": str(spec.engine.pool_fraction),
        "LORAPLEX_MAX_RESIDENT_ADAPTERS": str(spec.engine.max_resident_adapters),
        "LORAPLEX_MAX_BATCH_TOKENS": str(spec.engine.max_batch_tokens),
        "LORAPLEX_MODEL_CACHE": MODEL_CACHE_DIR,
    }
    store = spec.adapter_store
    if store is not None:
        data["LORAPLEX_ADAPTER_STORE"] = store.uri
        if store.endpoint_url:
            data["LORAPLEX_S3_ENDPOINT_URL"] = store.endpoint_url
        if store.region:
            data["AWS_REGION"] = store.region
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(idep),
        "data": data,
    }


def deployment(idep: InferenceDeployment, config_hash: str) -> dict[str, Any]:
    spec = idep.spec
    template = {
        "metadata": {
            "labels": labels(idep),
            "annotations": {
                CONFIG_HASH_ANNOTATION: config_hash,
                "prometheus.io/scrape": "true",
                "prometheus.io/port": str(ENGINE_PORT),
                "prometheus.io/path": "/metrics",
            },
        },
        "spec": _pod_spec(idep),
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(idep),
        "spec": {
            # The autoscaler owns this number between min and max; apply keeps the live value (see apply.py).
            "replicas": spec.replicas.min,
            "selector": {"matchLabels": selector_labels(idep)},
            "strategy": rollout_strategy(idep),
            "template": apply_overlay(template, spec.pod_template),
        },
    }


def rollout_strategy(idep: InferenceDeployment) -> dict[str, Any]:
    """Surge: new pods start before old ones stop (a spare GPU per surge pod, no capacity lost); Replace:
    old pods stop first (no spare GPU needed, capacity dips), for clusters without a free GPU."""
    rollout = idep.spec.rollout
    if rollout.strategy == "Replace":
        steps = {"maxSurge": 0, "maxUnavailable": rollout.max_unavailable}
    else:
        steps = {"maxSurge": rollout.max_surge, "maxUnavailable": 0}
    return {"type": "RollingUpdate", "rollingUpdate": steps}


def _pod_spec(idep: InferenceDeployment) -> dict[str, Any]:
    spec = idep.spec
    limits: dict[str, Any] = {"cpu": spec.resources.cpu, "memory": spec.resources.memory}
    if spec.resources.gpus_per_replica > 0:
        # A string, as the API server returns quantities: an int would look like drift on every resync.
        limits["nvidia.com/gpu"] = str(spec.resources.gpus_per_replica)
    pod: dict[str, Any] = {
        "containers": [
            {
                "name": "engine",
                "image": spec.engine.image,
                "command": ["loraplex"],
                "args": engine_args(idep),
                "ports": [{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}],
                "envFrom": [{"configMapRef": {"name": child_name(idep)}}],
                "env": _secret_env(idep),
                # A model that cannot load ends `loraplex serve` with one line in /dev/termination-log; an
                # image that crashes before that still explains itself through the last lines of its log.
                "terminationMessagePolicy": "FallbackToLogsOnError",
                "securityContext": {
                    "allowPrivilegeEscalation": False,
                    "readOnlyRootFilesystem": True,
                    "runAsNonRoot": True,
                    "capabilities": {"drop": ["ALL"]},
                    "seccompProfile": {"type": "RuntimeDefault"},
                },
                "resources": {"requests": dict(limits), "limits": limits},
                # Loading a large model takes minutes: readiness gates traffic, liveness only restarts a
                # process that stopped answering at all, and the startup probe covers the load.
                "startupProbe": _probe("/health", period=10, failures=90),
                "readinessProbe": _probe("/ready", period=5, failures=3),
                # A pod being deleted keeps serving this long before SIGTERM: the gateway sees it leaving,
                # warms its adapters' new pods and sends their traffic there first (docs/placement.md).
                "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(HANDOVER_SECONDS)]}}},
                "livenessProbe": _probe("/health", period=15, failures=4),
                "volumeMounts": [
                    {"name": "model-cache", "mountPath": MODEL_CACHE_DIR},
                    # The root filesystem is read-only: Triton's and torch's caches and scratch go here.
                    {"name": "tmp", "mountPath": "/tmp"},
                ],
            }
        ],
        "volumes": [_model_cache_volume(idep), {"name": "tmp", "emptyDir": {}}],
        # Pod Security "restricted"; the engine needs no Kubernetes API access at all.
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": ENGINE_UID,
            "runAsGroup": ENGINE_UID,
            "fsGroup": ENGINE_UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "automountServiceAccountToken": False,
        # Replicas on different nodes (and zones when there are several): one node loss costs one replica.
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": key,
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": selector_labels(idep)},
            }
            for key in ("kubernetes.io/hostname", "topology.kubernetes.io/zone")
        ],
        "terminationGracePeriodSeconds": 60,
    }
    if spec.resources.gpus_per_replica > 0:
        pod["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    return pod


def _model_cache_volume(idep: InferenceDeployment) -> dict[str, Any]:
    cache = idep.spec.model_cache
    if cache.claim_name is not None:
        return {"name": "model-cache", "persistentVolumeClaim": {"claimName": cache.claim_name}}
    return {"name": "model-cache", "emptyDir": {"sizeLimit": cache.size_limit} if cache.size_limit else {}}


def _secret_env(idep: InferenceDeployment) -> list[dict[str, Any]]:
    token = idep.spec.internal_token
    ref = {"name": token.name, "key": token.key}
    env: list[dict[str, Any]] = [{"name": "LORAPLEX_INTERNAL_TOKEN", "valueFrom": {"secretKeyRef": ref}}]
    store = idep.spec.adapter_store
    if store is not None and store.secret_name:
        # The S3-API credentials under boto3's own names, keyed the same in the Secret (as in the chart).
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            env.append(
                {"name": name, "valueFrom": {"secretKeyRef": {"name": store.secret_name, "key": name}}}
            )
    return env


def _probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "timeoutSeconds": 3,
        "failureThreshold": failures,
    }


def service(idep: InferenceDeployment) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(idep),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(idep),
            "ports": [{"name": "http", "port": ENGINE_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def pod_disruption_budget(idep: InferenceDeployment) -> dict[str, Any]:
    # With one replica a PDB of minAvailable 1 would block node drains forever; allow one pod down instead.
    budget: dict[str, Any] = {"maxUnavailable": 1}
    if idep.spec.replicas.min > 1:
        budget = {"minAvailable": idep.spec.replicas.min - 1}
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(idep),
        "spec": {**budget, "selector": {"matchLabels": selector_labels(idep)}},
    }


def horizontal_pod_autoscaler(idep: InferenceDeployment) -> dict[str, Any]:
    scaling = idep.spec.autoscaling
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": _metadata(idep),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": child_name(idep)},
            "minReplicas": idep.spec.replicas.min,
            "maxReplicas": idep.spec.replicas.max,
            # Several metrics: the HPA takes the largest recommendation, as the builtin autoscaler does.
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": METRIC_NAMES[metric]},
                        "target": {"type": "AverageValue", "averageValue": _quantity(target)},
                    },
                }
                for metric, target in scaling.targets()
            ],
            "behavior": {
                "scaleUp": {"stabilizationWindowSeconds": scaling.scale_up_stabilization_seconds},
                "scaleDown": {"stabilizationWindowSeconds": scaling.scale_down_stabilization_seconds},
            },
        },
    }


def inference_pool(idep: InferenceDeployment) -> dict[str, Any]:
    """The engine pods as an InferencePool: selected by the same labels as the Service, on the engine's
    port, with the team's endpoint picker. The pods speak the model-server protocol on that port
    (OpenAI completions and chat, /metrics with the vllm:* series)."""
    pool = idep.spec.inference_pool
    assert pool is not None
    return {
        "apiVersion": INFERENCE_POOL_API,
        "kind": "InferencePool",
        "metadata": _metadata(idep),
        "spec": {
            "selector": {"matchLabels": selector_labels(idep)},
            "targetPorts": [{"number": ENGINE_PORT}],
            "endpointPickerRef": {
                "kind": "Service",
                "name": pool.endpoint_picker,
                "port": {"number": pool.endpoint_picker_port},
                "failureMode": pool.failure_mode,
            },
        },
    }


def _quantity(value: float) -> str:
    """A Kubernetes quantity for a metric target: milli-units keep fractions such as 0.75 exact."""
    milli = round(value * 1000)
    return str(milli // 1000) if milli % 1000 == 0 else f"{milli}m"


def _metadata(idep: InferenceDeployment) -> dict[str, Any]:
    return {
        "name": child_name(idep),
        "namespace": idep.namespace,
        "labels": labels(idep),
        "ownerReferences": [
            {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": KIND,
                "name": idep.name,
                "uid": idep.uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ],
    }

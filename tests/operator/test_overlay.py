"""spec.podTemplate: merged into the engine pod with strategic-merge semantics; what the operator owns, and
anything below Pod Security "restricted", is refused with the field named. spec.rollout in the Deployment."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest

from loraplex.engine.server.settings import ALL_OPTIONS
from loraplex.operator.engine_args import OPERATOR_OPTIONS, serve_parser
from loraplex.operator.overlay import OPERATOR_ENV, OPERATOR_LABELS, OPERATOR_MOUNT_PATHS, OPERATOR_VOLUMES
from loraplex.operator.resources import MODEL_CACHE_DIR, config_map, deployment, labels
from loraplex.operator.spec import SpecError, parse
from tests.operator.helpers import KUBE_VERSION, body
from tests.operator.test_contract import restricted_violations

FULL_OVERLAY: dict[str, Any] = {
    "metadata": {"labels": {"team": "ml"}, "annotations": {"example.com/cost-center": "42"}},
    "spec": {
        "nodeSelector": {"node.example.com/pool": "a100"},
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["a100", "h100"]}]}
                    ]
                }
            }
        },
        "tolerations": [
            {"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"},
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoExecute"},
        ],
        "imagePullSecrets": [{"name": "registry"}],
        "serviceAccountName": "engine",
        "securityContext": {
            "runAsUser": 1000,
            "fsGroupChangePolicy": "OnRootMismatch",
            "supplementalGroups": [5],
        },
        "priorityClassName": "inference-high",
        "runtimeClassName": "nvidia",
        "containers": [
            {
                "name": "engine",
                "env": [
                    {"name": "HF_HUB_OFFLINE", "value": "1"},
                    {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
                ],
                "envFrom": [{"prefix": "APP_", "configMapRef": {"name": "app-settings"}}],
                "volumeMounts": [{"name": "certs", "mountPath": "/mnt/certs", "readOnly": True}],
            }
        ],
        "volumes": [{"name": "certs", "configMap": {"name": "ca-bundle"}}],
    },
}


def engine_deployment(**spec: Any) -> dict[str, Any]:
    idep = parse(body(**spec))
    return deployment(idep, "hash")


def pod_spec(**spec: Any) -> dict[str, Any]:
    return engine_deployment(**spec)["spec"]["template"]["spec"]


def test_the_overlay_is_merged_into_the_engine_pod() -> None:
    plain = engine_deployment()
    merged = engine_deployment(podTemplate=FULL_OVERLAY)
    template = merged["spec"]["template"]
    pod = template["spec"]
    # Maps merge: the operator's labels and annotations stay, the overlay's are added.
    assert template["metadata"]["labels"] == {**plain["spec"]["template"]["metadata"]["labels"], "team": "ml"}
    assert template["metadata"]["annotations"]["example.com/cost-center"] == "42"
    assert template["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert pod["securityContext"] == {
        **plain["spec"]["template"]["spec"]["securityContext"],
        **FULL_OVERLAY["spec"]["securityContext"],
    }
    # Scalars and whole objects are set.
    assert pod["nodeSelector"] == {"node.example.com/pool": "a100"}
    assert pod["affinity"] == FULL_OVERLAY["spec"]["affinity"]
    assert (pod["serviceAccountName"], pod["priorityClassName"], pod["runtimeClassName"]) == (
        "engine",
        "inference-high",
        "nvidia",
    )
    assert pod["automountServiceAccountToken"] is False  # a service account does not bring its token
    # Lists merge by key: the GPU toleration is overridden by key, the new one appended.
    assert pod["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoExecute"},
        {"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"},
    ]
    assert pod["imagePullSecrets"] == [{"name": "registry"}]
    assert [v["name"] for v in pod["volumes"]] == ["model-cache", "tmp", "certs"]
    (engine,) = pod["containers"]
    before = plain["spec"]["template"]["spec"]["containers"][0]
    for owned in ("command", "args", "image", "ports", "resources", "readinessProbe", "securityContext"):
        assert engine[owned] == before[owned], owned
    assert [e["name"] for e in engine["env"]] == [
        *(e["name"] for e in before["env"]),
        "HF_HUB_OFFLINE",
        "HF_TOKEN",
    ]
    # The user's envFrom goes first: the operator's ConfigMap is the last source, so it wins a duplicate key.
    assert engine["envFrom"] == [
        {"prefix": "APP_", "configMapRef": {"name": "app-settings"}},
        *before["envFrom"],
    ]
    assert engine["volumeMounts"][-1] == {"name": "certs", "mountPath": "/mnt/certs", "readOnly": True}
    kubernetes_validate.validate(merged, KUBE_VERSION, strict=True)
    assert restricted_violations(pod) == []


def test_the_overlay_changes_the_pods_hash_so_they_roll() -> None:
    from loraplex.operator.resources import HASH_ANNOTATION, desired_objects

    def digest(**spec: Any) -> str:
        found = next(o for o in desired_objects(parse(body(**spec))) if o["kind"] == "Deployment")
        return str(found["metadata"]["annotations"][HASH_ANNOTATION])

    assert digest() != digest(podTemplate={"spec": {"nodeSelector": {"pool": "b"}}})


@pytest.mark.parametrize(
    ("overlay", "words"),
    [
        ({"spec": {"hostNetwork": True}}, "spec.podTemplate.spec.hostNetwork is not supported here"),
        ({"spec": {"securityContext": {"runAsNonRoot": False}}}, "runAsNonRoot must stay true"),
        ({"spec": {"securityContext": {"runAsUser": 0}}}, "runAsUser is 0"),
        ({"spec": {"securityContext": {"sysctls": []}}}, "securityContext.sysctls is not supported"),
        (
            {"spec": {"securityContext": {"seccompProfile": {"type": "Unconfined"}}}},
            "seccompProfile.type must be RuntimeDefault or Localhost",
        ),
        ({"spec": {"containers": [{"name": "sidecar"}]}}, "only the engine container can be extended"),
        (
            {"spec": {"containers": [{"name": "engine", "command": ["sh"]}]}},
            "containers[0].command is not supported",
        ),
        (
            {"spec": {"containers": [{"name": "engine", "image": "x"}]}},
            "containers[0].image is not supported",
        ),
        (
            {
                "spec": {
                    "containers": [
                        {"name": "engine", "env": [{"name": "LORAPLEX_INTERNAL_TOKEN", "value": "x"}]}
                    ]
                }
            },
            "LORAPLEX_INTERNAL_TOKEN is set by the operator",
        ),
        (
            {
                "spec": {
                    "containers": [
                        {"name": "engine", "volumeMounts": [{"name": "tmp", "mountPath": "/tmp/x"}]}
                    ]
                }
            },
            "inside a volume the operator mounts",
        ),
        (
            {
                "spec": {
                    "containers": [
                        {"name": "engine", "volumeMounts": [{"name": "nope", "mountPath": "/mnt/x"}]}
                    ]
                }
            },
            "names no volume",
        ),
        ({"spec": {"volumes": [{"name": "tmp", "emptyDir": {}}]}}, "tmp is a volume the operator defines"),
        ({"spec": {"volumes": [{"name": "host", "hostPath": {"path": "/"}}]}}, "got hostPath"),
        (
            {
                "spec": {
                    "volumes": [
                        {"name": "t", "projected": {"sources": [{"serviceAccountToken": {"path": "t"}}]}}
                    ]
                }
            },
            "sources[0].serviceAccountToken is not supported",
        ),
        ({"metadata": {"labels": {"app.kubernetes.io/instance": "x"}}}, "set by the operator (selectors"),
        (
            {"metadata": {"annotations": {"loraplex.dev/config-hash": "x"}}},
            "loraplex.dev/* is the operator's",
        ),
        ({"metadata": {"labels": {"team": "not a value!"}}}, "is not a valid label value"),
        ({"spec": {"tolerations": [{"key": "a", "operator": "Maybe"}]}}, "operator must be Equal or Exists"),
        ({"spec": {"imagePullSecrets": [{"name": "Not_A_Name"}]}}, "is not a Kubernetes object name"),
    ],
)
def test_what_the_operator_owns_is_refused_by_name(overlay: dict[str, Any], words: str) -> None:
    with pytest.raises(SpecError) as refused:
        parse(body(podTemplate=overlay))
    assert words in str(refused.value)


def test_the_refusal_lists_match_what_resources_makes() -> None:
    idep = parse(body())
    made = deployment(idep, "hash")["spec"]["template"]["spec"]
    engine = made["containers"][0]
    env = {e["name"] for e in engine["env"]} | set(config_map(idep)["data"])
    assert env <= OPERATOR_ENV
    assert {v["name"] for v in made["volumes"]} == OPERATOR_VOLUMES
    assert {m["mountPath"] for m in engine["volumeMounts"]} == OPERATOR_MOUNT_PATHS
    assert MODEL_CACHE_DIR in OPERATOR_MOUNT_PATHS
    assert set(labels(idep)) == OPERATOR_LABELS


def test_the_options_the_operator_owns_are_those_it_sets() -> None:
    """OPERATOR_OPTIONS (refused in extraArgs and as variables) is every option the engine's command line
    and ConfigMap carry, plus --host, whose default the Service and probes rely on."""
    # Every optional flag and ConfigMap key present, no extraArgs.
    model = {"uri": "hf://org/model", "quantization": "int8"}
    store = {"uri": "s3://bucket/prefix", "endpointUrl": "http://minio:9000", "region": "us-east-1"}
    idep = parse(body(model=model, adapterStore=store, engine={"image": "ghcr.io/loraplex/engine:0.2.0"}))
    args = deployment(idep, "hash")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[0] == "serve"
    given = serve_parser().parse_args(args[1:])
    from_args = {name for name, value in vars(given).items() if value is not None}
    by_variable = {v: o.name for o in ALL_OPTIONS for v in o.variables}
    from_config = {by_variable[key] for key in config_map(idep)["data"] if key in by_variable}
    assert from_args | from_config | {"host"} == OPERATOR_OPTIONS


def test_rollout_strategies_in_the_deployment() -> None:
    assert engine_deployment()["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    assert engine_deployment(rollout={"strategy": "Surge", "maxSurge": 2})["spec"]["strategy"][
        "rollingUpdate"
    ] == {
        "maxSurge": 2,
        "maxUnavailable": 0,
    }
    replace = engine_deployment(rollout={"strategy": "Replace"})
    assert replace["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    kubernetes_validate.validate(replace, KUBE_VERSION, strict=True)
    with pytest.raises(SpecError, match="maxSurge applies to strategy Surge"):
        parse(body(rollout={"strategy": "Replace", "maxSurge": 1}))
    with pytest.raises(SpecError, match="strategy is 'Recreate'; use one of Surge, Replace"):
        parse(body(rollout={"strategy": "Recreate"}))

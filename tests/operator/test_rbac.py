"""The chart's RBAC, rendered in both scopes, rule by rule; the calls the operator makes are checked against
these rules by test_e2e.py (one operator) and test_ha.py (peering)."""

from __future__ import annotations

from typing import Any

import helm_python as helm
import pytest

from tests.operator.rbac import grants, operator_rules, role_rules
from tests.operator.test_chart import CHART, render

# What the operator may do where it works: exactly the calls of operator/*.py and of kopf.
NAMESPACED_RULES = [
    {
        "apiGroups": ["loraplex.dev"],
        "resources": ["inferencedeployments"],
        "verbs": ["get", "list", "watch", "patch"],
    },
    {"apiGroups": ["loraplex.dev"], "resources": ["inferencedeployments/status"], "verbs": ["patch"]},
    {
        "apiGroups": ["apps"],
        "resources": ["deployments"],
        "verbs": ["get", "list", "watch", "create", "patch"],
    },
    {"apiGroups": [""], "resources": ["services", "configmaps"], "verbs": ["get", "create", "patch"]},
    {"apiGroups": ["policy"], "resources": ["poddisruptionbudgets"], "verbs": ["get", "create", "patch"]},
    {
        "apiGroups": ["autoscaling"],
        "resources": ["horizontalpodautoscalers"],
        "verbs": ["get", "create", "patch", "delete"],
    },
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
    {"apiGroups": [""], "resources": ["events"], "verbs": ["get", "create", "patch"]},
]
# Cluster-wide, in every mode: reads for kopf and the Secret policy, and the peering object.
CLUSTER_RULES = [
    {
        "apiGroups": ["apiextensions.k8s.io"],
        "resources": ["customresourcedefinitions"],
        "verbs": ["list", "watch"],
    },
    {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": ["kopf.dev"], "resources": ["clusterkopfpeerings"], "verbs": ["list", "watch", "create"]},
    {
        "apiGroups": ["kopf.dev"],
        "resources": ["clusterkopfpeerings"],
        "resourceNames": ["loraplex-operator"],
        "verbs": ["patch"],
    },
]
WORKLOADS = {
    "deployments",
    "services",
    "configmaps",
    "poddisruptionbudgets",
    "horizontalpodautoscalers",
    "pods",
}


def rbac(objects: list[dict[str, Any]]) -> dict[tuple[str, str, str | None], dict[str, Any]]:
    kinds = ("Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding")
    return {
        (o["kind"], o["metadata"]["name"], o["metadata"].get("namespace")): o
        for o in objects
        if o["kind"] in kinds
    }


def operator_subject() -> list[dict[str, str]]:
    return [{"kind": "ServiceAccount", "name": "loraplex-operator", "namespace": "loraplex"}]


def test_by_default_the_operator_is_granted_the_release_namespace_only() -> None:
    objects = render(None)
    found = rbac(objects)
    assert set(found) == {
        ("ClusterRole", "loraplex-operator-cluster", None),
        ("ClusterRoleBinding", "loraplex-operator-cluster", None),
        ("Role", "loraplex-operator", "loraplex"),
        ("RoleBinding", "loraplex-operator", "loraplex"),
        ("Role", "loraplex-web-discovery", "loraplex"),
        ("RoleBinding", "loraplex-web-discovery", "loraplex"),
    }
    assert found["Role", "loraplex-operator", "loraplex"]["rules"] == NAMESPACED_RULES
    assert found["ClusterRole", "loraplex-operator-cluster", None]["rules"] == CLUSTER_RULES
    binding = found["RoleBinding", "loraplex-operator", "loraplex"]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "loraplex-operator",
    }
    assert binding["subjects"] == operator_subject()
    cluster_binding = found["ClusterRoleBinding", "loraplex-operator-cluster", None]
    assert cluster_binding["roleRef"]["name"] == "loraplex-operator-cluster"
    assert cluster_binding["subjects"] == operator_subject()
    args = operator_container(objects)["args"]
    assert args == ["--peering=loraplex-operator", "--namespace=loraplex"]


def test_watched_namespaces_get_one_role_each_and_the_operator_watches_exactly_those() -> None:
    objects = render({"operator": {"watchNamespaces": ["team-a", "team-b"]}})
    found = rbac(objects)
    roles = sorted(str(ns) for kind, name, ns in found if kind == "Role" and name == "loraplex-operator")
    bindings = sorted(
        str(ns) for kind, name, ns in found if kind == "RoleBinding" and name == "loraplex-operator"
    )
    assert roles == bindings == ["team-a", "team-b"]
    assert role_rules(objects, "Role", "loraplex-operator") == NAMESPACED_RULES
    assert ("ClusterRole", "loraplex-operator", None) not in found
    assert operator_container(objects)["args"] == [
        "--peering=loraplex-operator",
        "--namespace=team-a",
        "--namespace=team-b",
    ]


def test_cluster_scope_is_a_cluster_role_with_the_same_rules_and_all_namespaces() -> None:
    objects = render({"operator": {"clusterScope": True}})
    found = rbac(objects)
    assert found["ClusterRole", "loraplex-operator", None]["rules"] == NAMESPACED_RULES
    binding = found["ClusterRoleBinding", "loraplex-operator", None]
    assert binding["roleRef"]["kind"] == "ClusterRole" and binding["subjects"] == operator_subject()
    assert not [key for key in found if key[0] == "Role" and key[1] == "loraplex-operator"]
    assert found["ClusterRole", "loraplex-operator-cluster", None]["rules"] == CLUSTER_RULES
    assert operator_container(objects)["args"] == ["--peering=loraplex-operator", "--all-namespaces"]


def test_cluster_scope_with_watched_namespaces_is_refused() -> None:
    with pytest.raises(helm.HelmError, match=r"leave operator\.watchNamespaces empty"):
        render({"operator": {"clusterScope": True, "watchNamespaces": ["team-a"]}})


@pytest.mark.parametrize("values", [None, {"operator": {"clusterScope": True}}])
def test_no_rule_touches_secrets_or_uses_wildcards_and_cluster_rules_write_no_workload(
    values: dict[str, Any] | None,
) -> None:
    objects = render(values)
    for obj in rbac(objects).values():
        for rule in obj.get("rules", []):
            assert "secrets" not in rule["resources"], obj["metadata"]["name"]
            assert "*" not in rule["resources"] + rule["verbs"] + rule["apiGroups"], obj["metadata"]["name"]
    _, cluster = operator_rules(objects)
    for resource in WORKLOADS:
        for verb in ("create", "patch", "update", "delete"):
            assert not grants(cluster, ("", resource, verb)) and not grants(cluster, ("apps", resource, verb))
    # The peering object is patched by name only; creating it cannot be narrowed so.
    assert grants(cluster, ("kopf.dev", "clusterkopfpeerings", "patch"), name="loraplex-operator")
    assert not grants(cluster, ("kopf.dev", "clusterkopfpeerings", "patch"), name="someone-elses")


WEB_DISCOVERY_RULES = [
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]},
    {"apiGroups": ["apps"], "resources": ["replicasets", "deployments"], "verbs": ["get"]},
]


def test_the_web_service_account_only_reads_engine_pods_and_their_owners_where_it_discovers() -> None:
    objects = render({"web": {"discovery": {"namespaces": ["team-a", "team-b"]}}})
    roles = [o for o in objects if o["kind"] == "Role" and o["metadata"]["name"] == "loraplex-web-discovery"]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    for role in roles:
        assert role["rules"] == WEB_DISCOVERY_RULES
    assert not [o for o in objects if o["kind"] == "ClusterRoleBinding" and "web" in o["metadata"]["name"]]


def test_the_web_discovery_calls_are_exactly_what_its_role_grants() -> None:
    """The web role above matches what web/services/discovery.py and pod_owners.py use of the API clients
    (`self.api`, `self.apps`): list_namespaced_pod, plain and with watch=True, and a get of a ReplicaSet
    and of a Deployment; nothing else of the Kubernetes API."""
    import ast

    from tests.operator.helpers import ROOT

    api_calls = set()
    for module in ("discovery.py", "pod_owners.py"):
        tree = ast.parse((ROOT / "web" / "services" / module).read_text())
        api_calls |= {
            node.attr
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr in ("api", "apps")
            and node.attr != "api_client"
        }
    assert api_calls == {"list_namespaced_pod", "read_namespaced_replica_set", "read_namespaced_deployment"}


def test_policy_values_reach_the_operator_with_the_charts_own_secrets_allowed() -> None:
    env = operator_env(render(None))
    assert (
        env["LORAPLEX_OPERATOR_ALLOWED_IMAGES"]
        == "ghcr.io/loraplex/engine:*,ghcr.io/loraplex/engine@sha256:*"
    )
    assert env["LORAPLEX_OPERATOR_ALLOW_ANY_IMAGE"] == "false"
    assert env["LORAPLEX_OPERATOR_ALLOWED_SECRETS"] == "loraplex/loraplex-secrets"
    # No CSI driver and no runtime class unless the admin lists them (an empty value keeps the default).
    assert env["LORAPLEX_OPERATOR_ALLOWED_CSI_DRIVERS"] == ""
    assert env["LORAPLEX_OPERATOR_ALLOWED_RUNTIME_CLASSES"] == ""
    env = operator_env(
        render(
            {
                "web": {"discovery": {"namespaces": ["loraplex", "team-a"]}},
                "adapterStore": {"existingSecret": "adapter-store"},
                "operator": {
                    "policy": {
                        "allowedImages": ["registry.example.com/engine:*"],
                        "allowAnyImage": True,
                        "allowedSecrets": ["team-b/hf-*", "loraplex/loraplex-secrets"],
                        "allowedCsiDrivers": ["ebs.csi.aws.com", "secrets-store.csi.k8s.io"],
                        "allowedRuntimeClasses": ["nvidia"],
                    }
                },
            }
        )
    )
    assert env["LORAPLEX_OPERATOR_ALLOWED_IMAGES"] == "registry.example.com/engine:*"
    assert env["LORAPLEX_OPERATOR_ALLOW_ANY_IMAGE"] == "true"
    assert env["LORAPLEX_OPERATOR_ALLOWED_SECRETS"] == (
        "loraplex/loraplex-secrets,team-a/loraplex-secrets,loraplex/adapter-store,team-b/hf-*"
    )
    assert env["LORAPLEX_OPERATOR_ALLOWED_CSI_DRIVERS"] == "ebs.csi.aws.com,secrets-store.csi.k8s.io"
    assert env["LORAPLEX_OPERATOR_ALLOWED_RUNTIME_CLASSES"] == "nvidia"


@pytest.mark.parametrize(
    "policy",
    [
        {"allowedSecrets": ["no-namespace"]},
        {"allowedSecrets": ["a/b,c/d"]},
        {"allowedImages": ["a, b"]},
        {"allowedCsiDrivers": ["a,b"]},
        {"allowedRuntimeClasses": ["Not A Name"]},
    ],
)
def test_policy_values_that_would_not_survive_the_comma_join_are_refused(policy: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmError):
        helm.Chart.load(CHART).validate_schema({"operator": {"policy": policy}})


def test_the_operator_runs_two_peered_replicas_named_by_their_pods() -> None:
    objects = render(None)
    deployment = next(
        o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "loraplex-operator"
    )
    assert deployment["spec"]["replicas"] == 2
    assert "strategy" not in deployment["spec"]  # a rolling update is safe with peering
    env = operator_env(objects)
    assert env["LORAPLEX_OPERATOR_PEERING_LIFETIME_SECONDS"] == "60"
    pod_id = next(e for e in operator_container(objects)["env"] if e["name"] == "POD_ID")
    assert pod_id["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert "--standalone" not in operator_container(objects)["command"]
    crd = next(
        o for o in objects if o["kind"] == "CustomResourceDefinition" and "kopf" in o["metadata"]["name"]
    )
    assert crd["spec"]["scope"] == "Cluster" and crd["spec"]["names"]["kind"] == "ClusterKopfPeering"
    assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    unpeered = render({"crds": {"kopfPeering": False}})
    assert not [
        o for o in unpeered if o["kind"] == "CustomResourceDefinition" and "kopf" in o["metadata"]["name"]
    ]


def operator_container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    deployment = next(
        o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "loraplex-operator"
    )
    return dict(deployment["spec"]["template"]["spec"]["containers"][0])


def operator_env(objects: list[dict[str, Any]]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in operator_container(objects)["env"]}

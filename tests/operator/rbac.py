"""The chart's RBAC rules as data, and the question a real API server's authorizer asks of them.

The emulators do not enforce RBAC; instead they record every (apiGroup, resource, verb) a client used
(`StrictApiServer.calls`), and the tests check each against the rules the chart renders.
"""

from __future__ import annotations

from typing import Any

Call = tuple[str, str, str]  # (apiGroup, resource[/subresource], verb)

# Resources that live outside namespaces: only a ClusterRole can grant them.
CLUSTER_SCOPED = {
    ("", "namespaces"),
    ("apiextensions.k8s.io", "customresourcedefinitions"),
    ("kopf.dev", "clusterkopfpeerings"),
}


def grants(rules: list[dict[str, Any]], call: Call, name: str | None = None) -> bool:
    """Whether some rule allows the call (resourceNames narrow a rule to those object names)."""
    group, resource, verb = call
    for rule in rules:
        names = rule.get("resourceNames")
        if (
            group in rule["apiGroups"]
            and resource in rule["resources"]
            and verb in rule["verbs"]
            and (not names or (name is not None and name in names))
        ):
            return True
    return False


def role_rules(objects: list[dict[str, Any]], kind: str, name: str) -> list[dict[str, Any]]:
    """The rules of every `kind` (Role or ClusterRole) object called `name`, all equal; fails if none."""
    found = [o["rules"] for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert found, f"no {kind} {name} rendered"
    assert all(rules == found[0] for rules in found), f"{kind}s {name} differ between namespaces"
    return list(found[0])


def operator_rules(objects: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(rules for the watched namespaces, cluster-wide rules) the chart grants the operator."""
    namespaced_kind = (
        "ClusterRole"
        if any(o["kind"] == "ClusterRole" and o["metadata"]["name"] == "loraplex-operator" for o in objects)
        else "Role"
    )
    return (
        role_rules(objects, namespaced_kind, "loraplex-operator"),
        role_rules(objects, "ClusterRole", "loraplex-operator-cluster"),
    )


def ungranted(calls: set[Call], objects: list[dict[str, Any]], peering: str = "") -> list[Call]:
    """The calls that the operator's rendered rules do not allow, with the rule set each belongs to."""
    namespaced, cluster = operator_rules(objects)
    missing = []
    for call in sorted(calls):
        group, resource, _ = call
        scoped = (group, resource.split("/")[0]) in CLUSTER_SCOPED
        if not grants(cluster if scoped else namespaced, call, name=peering or None):
            missing.append(call)
    return missing

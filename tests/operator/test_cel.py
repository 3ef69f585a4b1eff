"""The CRD's CEL rules, evaluated by a real CEL interpreter: each rejects its bad body with its message, the
examples pass, every rule is exercised, and spec.py refuses the same bodies with the same limits."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jsonschema
import pytest

from loraplex.operator import spec as spec_module
from loraplex.operator.overlay import MAX_ITEMS, OPERATOR_ENV, OPERATOR_LABELS
from loraplex.operator.spec import SpecError, parse
from tests.operator.crd_validation import admission_errors, cel_failures, rules, schema_errors
from tests.operator.helpers import EXAMPLES, body, crd_schema, load_yaml

Mutation = Callable[[dict[str, Any]], None]


def _set(path: str, value: Any) -> Mutation:
    def mutate(obj: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node = obj
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value

    return mutate


def _pod_template(**spec: Any) -> Mutation:
    return _set("spec.podTemplate", {"spec": spec})


# (case id, mutation, a fragment of the CEL rule's message); each also fails spec.parse.
CEL_CASES: list[tuple[str, Mutation, str]] = [
    ("name-too-long", _set("metadata.name", "a" * 57), "at most 56 characters"),
    ("name-starts-with-digit", _set("metadata.name", "7llama"), "DNS label starting with a letter"),
    ("min-above-max", _set("spec.replicas", {"min": 3, "max": 2}), "replicas.min must not exceed"),
    (
        "pool-utilization-above-1",
        _set("spec.autoscaling", {"metric": "pool_utilization", "target": 2}),
        "fraction 0..1",
    ),
    ("hpa-target-below-1m", _set("spec.autoscaling", {"mode": "hpa", "target": 0.0001}), "1m is the least"),
    (
        "pool-pressure-signal-above-1",
        _set("spec.autoscaling", {"signals": [{"metric": "pool_pressure", "target": 1.5}]}),
        "signals target is a fraction 0..1",
    ),
    (
        "hpa-adapter-demand",
        _set("spec.autoscaling", {"mode": "hpa", "signals": [{"metric": "adapter_demand"}]}),
        "adapter_demand is computed by the builtin autoscaler only",
    ),
    (
        "hpa-signal-target-below-1m",
        _set(
            "spec.autoscaling",
            {"mode": "hpa", "signals": [{"metric": "running_requests", "target": 0.0001}]},
        ),
        "signals target below 0.001",
    ),
    (
        "signal-repeats-metric",
        _set("spec.autoscaling", {"metric": "running_requests", "signals": [{"metric": "running_requests"}]}),
        "must not repeat autoscaling.metric",
    ),
    ("extra-arg-port", _set("spec.engine.extraArgs", ["--port=9000"]), "must not set --model, --port"),
    ("extra-arg-model", _set("spec.engine.extraArgs", ["--model", "/x"]), "must not set --model, --port"),
    (
        "cache-claim-and-size",
        _set("spec.modelCache", {"claimName": "models", "sizeLimit": "1Gi"}),
        "sizeLimit applies to the emptyDir",
    ),
    (
        "surge-with-max-unavailable",
        _set("spec.rollout", {"strategy": "Surge", "maxUnavailable": 1}),
        "maxUnavailable applies to strategy Replace",
    ),
    (
        "replace-with-max-surge",
        _set("spec.rollout", {"strategy": "Replace", "maxSurge": 1}),
        "maxSurge applies to strategy Surge",
    ),
    (
        "selector-label",
        _set("spec.podTemplate", {"metadata": {"labels": {"app.kubernetes.io/instance": "x"}}}),
        "must not set the operator's app.kubernetes.io/* labels",
    ),
    (
        "operator-annotation",
        _set("spec.podTemplate", {"metadata": {"annotations": {"loraplex.dev/config-hash": "x"}}}),
        "under loraplex.dev/ are the operator's",
    ),
    ("run-as-root-allowed", _pod_template(securityContext={"runAsNonRoot": False}), "runAsNonRoot must stay"),
    ("run-as-uid-0", _pod_template(securityContext={"runAsUser": 0}), "runAsUser must not be 0"),
    (
        "seccomp-unconfined",
        _pod_template(securityContext={"seccompProfile": {"type": "Unconfined"}}),
        "RuntimeDefault or",
    ),
    ("sidecar", _pod_template(containers=[{"name": "proxy"}]), "only the engine container"),
    (
        "token-env",
        _pod_template(
            containers=[{"name": "engine", "env": [{"name": "LORAPLEX_INTERNAL_TOKEN", "value": "x"}]}]
        ),
        "must not set the variables the operator sets",
    ),
    (
        "mount-over-tmp",
        _pod_template(
            containers=[{"name": "engine", "volumeMounts": [{"name": "extra", "mountPath": "/tmp/x"}]}],
            volumes=[{"name": "extra", "emptyDir": {}}],
        ),
        "must not mount over /tmp",
    ),
    (
        "operator-volume",
        _pod_template(volumes=[{"name": "tmp", "emptyDir": {}}]),
        "volumes model-cache and tmp",
    ),
]

# Limits the schema alone enforces (no CEL): the same numbers as spec.py.
SCHEMA_CASES: list[tuple[str, Mutation, str]] = [
    ("two-gpus", _set("spec.resources.gpusPerReplica", 2), "is greater than the maximum of 1"),
    ("image-with-space", _set("spec.engine.image", "ghcr.io/x y"), "does not match"),
    ("unknown-strategy", _set("spec.rollout", {"strategy": "BlueGreen"}), "is not one of"),
    ("surge-of-0", _set("spec.rollout", {"maxSurge": 0}), "is less than the minimum of 1"),
    ("token-secret-name", _set("spec.internalTokenSecretRef", {"name": "Bad_Name"}), "does not match"),
]


def _mutated(mutation: Mutation) -> dict[str, Any]:
    result = body()
    mutation(result)
    return result


def test_examples_pass_admission() -> None:
    for path in EXAMPLES:
        assert admission_errors(load_yaml(path)) == [], path.name


def test_a_full_pod_template_passes_admission_and_parses() -> None:
    good = _mutated(
        _set(
            "spec.podTemplate",
            {
                "metadata": {"labels": {"team": "ml"}, "annotations": {"example.com/cost": "gpu"}},
                "spec": {
                    "nodeSelector": {"pool": "a100"},
                    "tolerations": [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}],
                    "securityContext": {"runAsUser": 1000, "seccompProfile": {"type": "RuntimeDefault"}},
                    "containers": [
                        {
                            "name": "engine",
                            "env": [{"name": "HF_HUB_OFFLINE", "value": "1"}],
                            "volumeMounts": [{"name": "certs", "mountPath": "/mnt/certs"}],
                        }
                    ],
                    "volumes": [{"name": "certs", "configMap": {"name": "ca"}}],
                },
            },
        )
    )
    assert admission_errors(good) == []
    parse(good)


@pytest.mark.parametrize(("mutation", "message"), [c[1:] for c in CEL_CASES], ids=[c[0] for c in CEL_CASES])
def test_each_cel_rule_rejects_its_bad_case(mutation: Mutation, message: str) -> None:
    bad = _mutated(mutation)
    assert schema_errors(bad) == [], "the case must pass the schema and fail only the CEL rule"
    messages = [failure.rule.message for failure in cel_failures(bad)]
    assert len(messages) == 1 and message in messages[0], messages
    with pytest.raises(SpecError):
        parse(bad)


@pytest.mark.parametrize(
    ("mutation", "message"), [c[1:] for c in SCHEMA_CASES], ids=[c[0] for c in SCHEMA_CASES]
)
def test_schema_limits_reject_their_bad_case(mutation: Mutation, message: str) -> None:
    bad = _mutated(mutation)
    assert any(message in error for error in schema_errors(bad)), schema_errors(bad)
    with pytest.raises(SpecError):
        parse(bad)


def test_every_rule_is_exercised_by_a_bad_case() -> None:
    hit = {failure.rule.rule for _, mutation, _ in CEL_CASES for failure in cel_failures(_mutated(mutation))}
    every = {rule.rule for rule in rules()}
    assert every - hit == set()
    assert all(rule.message for rule in rules())


def test_the_crd_and_spec_py_share_their_limits() -> None:
    spec = crd_schema()["properties"]["spec"]["properties"]
    assert spec["resources"]["properties"]["gpusPerReplica"]["maximum"] == spec_module.MAX_GPUS_PER_REPLICA
    assert spec["replicas"]["properties"]["max"]["maximum"] == spec_module.MAX_REPLICAS
    assert spec["rollout"]["properties"]["maxSurge"]["maximum"] == spec_module.MAX_ROLLOUT_STEP
    assert spec["rollout"]["properties"]["strategy"]["enum"] == list(spec_module.ROLLOUT_STRATEGIES)
    assert spec["autoscaling"]["properties"]["target"]["maximum"] == spec_module.MAX_TARGET
    window = spec["autoscaling"]["properties"]["scaleDownStabilizationSeconds"]["maximum"]
    assert window == spec_module.MAX_STABILIZATION_SECONDS
    assert spec["engine"]["properties"]["image"]["maxLength"] == spec_module.MAX_IMAGE_LENGTH
    assert spec["engine"]["properties"]["image"]["pattern"] == spec_module._IMAGE.pattern
    all_rules = " ".join(rule.rule for rule in rules())
    assert f"size(self.metadata.name) <= {spec_module.MAX_NAME_LENGTH}" in all_rules
    assert f"self.target >= {spec_module.MIN_HPA_TARGET}" in all_rules
    env_rule = next(rule.rule for rule in rules() if "LORAPLEX_INTERNAL_TOKEN" in rule.rule)
    assert set(re.findall(r"'([A-Z0-9_]+)'", env_rule)) == OPERATOR_ENV
    label_rule = next(rule.rule for rule in rules() if "app.kubernetes.io/name" in rule.rule)
    assert set(re.findall(r"'(app\.kubernetes\.io/[a-z-]+)'", label_rule)) == OPERATOR_LABELS


def test_the_longest_name_fits_every_child() -> None:
    longest = _mutated(_set("metadata.name", "a" * spec_module.MAX_NAME_LENGTH))
    assert admission_errors(longest) == []
    assert len(f"{parse(longest).name}-engine") == 63


def _nodes(schema: dict[str, Any], path: str = "") -> Any:
    yield path or "<root>", schema
    for key, sub in (schema.get("properties") or {}).items():
        yield from _nodes(sub, f"{path}.{key}")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _nodes(schema["additionalProperties"], f"{path}.*")
    if isinstance(schema.get("items"), dict):
        yield from _nodes(schema["items"], f"{path}[]")


def test_the_schema_is_structural_and_its_rules_are_bounded() -> None:
    """What the API server checks when the CRD is created: a type on every node, defaults valid where they
    sit, and (for the CEL cost budget) a size limit on every list or map a rule iterates."""
    problems = []
    for path, node in _nodes(crd_schema()):
        if "type" not in node and not node.get("x-kubernetes-preserve-unknown-fields"):
            problems.append(f"{path}: no type")
        if "properties" in node and isinstance(node.get("additionalProperties"), dict):
            problems.append(f"{path}: properties and additionalProperties")
        if "default" in node and schema_errors_at(node, node["default"]):
            problems.append(f"{path}: default {node['default']!r} is invalid")
        for rule in node.get("x-kubernetes-validations") or []:
            # What a rule iterates: the node itself, or `self.<child>.all(...)`, a child of it.
            for child in re.findall(r"(self(?:\.\w+)?)\.(?:all|exists|exists_one)\(", rule["rule"]):
                iterated = node if child == "self" else (node.get("properties") or {}).get(child[5:], {})
                if "maxItems" not in iterated and "maxProperties" not in iterated:
                    problems.append(f"{path}: rule {rule['rule']!r} iterates an unbounded {child}")
        if node.get("type") == "string" and path.endswith("[]") and "maxLength" not in node:
            problems.append(f"{path}: list of unbounded strings")
    assert problems == []


def schema_errors_at(node: dict[str, Any], value: Any) -> list[str]:
    return [error.message for error in jsonschema.Draft4Validator(node).iter_errors(value)]


def _numeric_fields() -> list[tuple[str, str, dict[str, Any]]]:
    spec = crd_schema()["properties"]["spec"]["properties"]
    found = []
    for section, node in spec.items():
        for key, field in (node.get("properties") or {}).items():
            if field.get("type") in ("integer", "number") and ("minimum" in field or "maximum" in field):
                found.append((section, key, field))
    return found


# What a boundary value needs around it to be valid otherwise.
_CONTEXT: dict[tuple[str, str], dict[str, Any]] = {
    ("replicas", "min"): {"max": spec_module.MAX_REPLICAS},
    ("rollout", "maxUnavailable"): {"strategy": "Replace"},
}


@pytest.mark.parametrize(
    ("section", "key", "field"), _numeric_fields(), ids=[f"{s}.{k}" for s, k, _ in _numeric_fields()]
)
def test_numeric_limits_are_the_same_in_the_crd_and_spec_py(
    section: str, key: str, field: dict[str, Any]
) -> None:
    def attempt(value: float) -> tuple[bool, bool]:
        """(admitted by the schema, accepted by spec.py) for the field at `value`."""
        section_value = {**body()["spec"].get(section, {}), **_CONTEXT.get((section, key), {}), key: value}
        if section == "autoscaling":
            section_value.setdefault("metric", "running_requests")
        candidate = _mutated(_set(f"spec.{section}", section_value))
        try:
            parse(candidate)
            parsed = True
        except SpecError:
            parsed = False
        return not admission_errors(candidate), parsed

    step = 1 if field["type"] == "integer" else 0.001
    if "maximum" in field:
        assert attempt(field["maximum"]) == (True, True)
        assert attempt(field["maximum"] + step) == (False, False)
    if "minimum" in field:
        exclusive = field.get("exclusiveMinimum") is True
        assert attempt(field["minimum"]) == ((False, False) if exclusive else (True, True))
        assert attempt(field["minimum"] + step if exclusive else field["minimum"] - step) == (
            (True, True) if exclusive else (False, False)
        )


def test_the_size_limits_are_the_same_in_the_crd_and_spec_py() -> None:
    extra = crd_schema()["properties"]["spec"]["properties"]["engine"]["properties"]["extraArgs"]
    assert (extra["maxItems"], extra["items"]["maxLength"]) == (
        spec_module.MAX_EXTRA_ARGS,
        spec_module.MAX_EXTRA_ARG_LENGTH,
    )
    with pytest.raises(SpecError, match="at most 64 arguments"):
        parse(_mutated(_set("spec.engine.extraArgs", ["--x"] * 65)))
    limits = {}
    for path, node in _nodes(crd_schema()["properties"]["spec"]["properties"]["podTemplate"]):
        size = node.get("maxItems", node.get("maxProperties"))
        if size is not None:
            limits[path.rsplit(".", 1)[-1]] = size
    assert limits == MAX_ITEMS
    too_many = {"spec": {"tolerations": [{"key": str(i), "operator": "Exists"} for i in range(33)]}}
    with pytest.raises(SpecError, match=r"spec.podTemplate.spec.tolerations has 33 entries; at most 32"):
        parse(_mutated(_set("spec.podTemplate", too_many)))

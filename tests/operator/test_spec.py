"""The typed spec: defaults match the CRD's, and every wrong field is named in the error."""

from __future__ import annotations

import dataclasses
import re

import jsonschema
import pytest

from loraplex.operator.spec import (
    AutoscalingSpec,
    EngineSpec,
    ModelSpec,
    ReplicasSpec,
    ResourcesSpec,
    SpecError,
    parse,
)
from tests.operator.helpers import EXAMPLES, body, crd, crd_schema, load_yaml


def test_examples_validate_against_the_crd_schema() -> None:
    validator = jsonschema.Draft4Validator(crd_schema())
    assert len(EXAMPLES) >= 2
    for path in EXAMPLES:
        errors = list(validator.iter_errors(load_yaml(path)))
        assert not errors, f"{path.name}: {[e.message for e in errors]}"


def test_schema_rejects_a_wrong_enum_and_a_missing_field() -> None:
    validator = jsonschema.Draft4Validator(crd_schema())
    wrong = body(autoscaling={"mode": "sometimes"})
    assert any("sometimes" in e.message for e in validator.iter_errors(wrong))
    missing = body()
    del missing["spec"]["model"]["uri"]
    assert any("'uri' is a required property" in e.message for e in validator.iter_errors(missing))


def test_examples_parse() -> None:
    for path in EXAMPLES:
        parsed = parse(load_yaml(path))
        assert parsed.spec.model.uri


def test_crd_defaults_match_the_dataclass_defaults() -> None:
    spec = crd_schema()["properties"]["spec"]["properties"]
    sections = {
        "model": ModelSpec(uri="x"),
        "engine": EngineSpec(image="x"),
        "resources": ResourcesSpec(),
        "replicas": ReplicasSpec(),
        "autoscaling": AutoscalingSpec(),
    }
    checked = 0
    for section, instance in sections.items():
        for key, schema in spec[section]["properties"].items():
            if "default" not in schema:
                continue
            snake = "".join(f"_{c.lower()}" if c.isupper() else c for c in key)
            snake = {"extra_args": "extra_args"}.get(snake, snake)
            value = getattr(instance, snake)
            expected = list(value) if isinstance(value, tuple) else value
            assert schema["default"] == expected, f"spec.{section}.{key}"
            checked += 1
    assert checked >= 14


def test_crd_has_status_scale_and_printer_columns() -> None:
    version = crd()["spec"]["versions"][0]
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas.min"
    assert {c["name"] for c in version["additionalPrinterColumns"]} >= {"Phase", "Ready", "Endpoint"}
    assert crd()["spec"]["names"]["shortNames"] == ["infdep"]


def test_minimal_body_gets_defaults() -> None:
    parsed = parse(
        {
            "metadata": {"name": "m", "namespace": "ns"},
            "spec": {"model": {"uri": "u"}, "engine": {"image": "i"}},
        }
    )
    assert parsed.spec.autoscaling == AutoscalingSpec()
    assert parsed.spec.replicas == ReplicasSpec(min=1, max=1)
    assert parsed.spec.adapter_store is None
    assert dataclasses.asdict(parsed.spec.resources) == {"gpus_per_replica": 1, "cpu": "4", "memory": "16Gi"}


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"replicas": {"min": 5, "max": 2}}, "spec.replicas.min (5) exceeds spec.replicas.max (2)"),
        ({"model": {"uri": "u", "dtype": "int3"}}, "spec.model.dtype is 'int3'"),
        ({"engine": {"image": ""}}, "spec.engine.image is required"),
        ({"engine": {"image": "i", "poolFraction": 1.5}}, "spec.engine.poolFraction is 1.5"),
        ({"engine": {"image": "i", "extraArgs": [1]}}, "spec.engine.extraArgs must be a list of strings"),
        ({"resources": {"memory": "lots"}}, "spec.resources.memory 'lots'"),
        ({"resources": {"gpusPerReplica": True}}, "spec.resources.gpusPerReplica is True"),
        ({"autoscaling": {"metric": "pool_utilization", "target": 3}}, "above 1 for pool_utilization"),
        ({"autoscaling": {"target": 0}}, "target must be greater than 0"),
        ({"controlPlane": {"url": "ftp://x"}}, "must start with http:// or https://"),
        (
            {"adapterStore": {"uri": "s3://b", "secretRef": {}}},
            "spec.adapterStore.secretRef.name is required",
        ),
    ],
)
def test_invalid_specs_name_the_field(change: dict, words: str) -> None:
    with pytest.raises(SpecError, match=re.escape(words)):
        parse(body(**change))


def test_name_too_long_is_rejected() -> None:
    bad = body()
    bad["metadata"]["name"] = "x" * 60
    with pytest.raises(SpecError, match=r"metadata\.name"):
        parse(bad)

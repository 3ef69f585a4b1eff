"""The typed spec: defaults match the CRD's, and every wrong field is named in the error."""

from __future__ import annotations

import dataclasses
import re

import jsonschema
import pytest

from loraplex.operator.overlay import PodTemplateOverlay
from loraplex.operator.spec import (
    INTERNAL_TOKEN_KEY,
    MAX_SIGNALS,
    METRICS,
    AutoscalingSpec,
    EngineSpec,
    ModelCacheSpec,
    ModelSpec,
    ReplicasSpec,
    ResourcesSpec,
    RolloutSpec,
    SecretKeyRef,
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
    no_token = body()
    del no_token["spec"]["internalTokenSecretRef"]
    assert any("'internalTokenSecretRef' is a required" in e.message for e in validator.iter_errors(no_token))
    gcs = body(model={"uri": "gs://bucket/model"})
    assert any("does not match" in e.message for e in validator.iter_errors(gcs))


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
        "rollout": RolloutSpec(),
    }
    token_key = spec["internalTokenSecretRef"]["properties"]["key"]["default"]
    assert token_key == INTERNAL_TOKEN_KEY == SecretKeyRef(name="x").key
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
    assert checked >= 13


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
            "spec": {
                "model": {"uri": "/models/m.gguf"},
                "engine": {"image": "i"},
                "internalTokenSecretRef": {"name": "loraplex-secrets"},
            },
        }
    )
    assert parsed.spec.autoscaling == AutoscalingSpec()
    assert parsed.spec.replicas == ReplicasSpec(min=1, max=1)
    assert parsed.spec.adapter_store is None
    assert parsed.spec.internal_token == SecretKeyRef(name="loraplex-secrets", key="internal-token")
    assert parsed.spec.model_cache == ModelCacheSpec()
    assert parsed.spec.rollout == RolloutSpec(strategy="Surge", max_surge=1, max_unavailable=1)
    assert parsed.spec.pod_template == PodTemplateOverlay()
    assert dataclasses.asdict(parsed.spec.resources) == {"gpus_per_replica": 1, "cpu": "4", "memory": "16Gi"}


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"replicas": {"min": 5, "max": 2}}, "spec.replicas.min (5) exceeds spec.replicas.max (2)"),
        ({"model": {"uri": "/m.gguf", "dtype": "int3"}}, "spec.model.dtype is 'int3'"),
        ({"model": {"uri": "/m.gguf", "quantization": "int3"}}, "spec.model.quantization is 'int3'"),
        ({"model": {"uri": "gs://b/m"}}, "spec.model.uri scheme 'gs' is not supported"),
        ({"model": {"uri": "https://example.com/m.gguf"}}, "scheme 'https' is not supported"),
        ({"model": {"uri": "models/m.gguf"}}, "spec.model.uri 'models/m.gguf' is relative"),
        ({"model": {"uri": "file://host/m.gguf"}}, "must be file:///absolute/path"),
        ({"model": {"uri": "hf://just-a-name"}}, "is not hf://org/name"),
        ({"model": {"uri": "s3://B/m"}}, "is not s3://bucket/key"),
        ({"model": {"uri": "/m .gguf"}}, "printable characters without spaces"),
        ({"model": {"uri": "/" + "m" * 3000}}, "at most 2048"),
        ({"engine": {"image": "i", "extraArgs": ["--port", "9"]}}, "sets --port, which the operator sets"),
        ({"engine": {"image": "i", "extraArgs": ["--model=/x"]}}, "sets --model, which the operator sets"),
        ({"internalTokenSecretRef": None}, "spec.internalTokenSecretRef is required"),
        ({"internalTokenSecretRef": {"name": "Bad_Name"}}, "is not a Kubernetes object name"),
        ({"internalTokenSecretRef": {"name": "s", "key": "a/b"}}, "spec.internalTokenSecretRef.key 'a/b'"),
        ({"adapterStore": {"uri": "gs://b"}}, "spec.adapterStore.uri 'gs://b' must be"),
        ({"adapterStore": {"uri": "s3://b", "endpointUrl": "ftp://x"}}, "spec.adapterStore.endpointUrl"),
        ({"adapterStore": {"uri": "s3://b", "region": "US EAST"}}, "spec.adapterStore.region"),
        ({"modelCache": {"sizeLimit": "huge"}}, "spec.modelCache.sizeLimit 'huge'"),
        ({"modelCache": {"sizeLimit": "1Gi\n"}}, "spec.modelCache.sizeLimit '1Gi\\n'"),
        ({"internalTokenSecretRef": {"name": "s\n"}}, "is not a Kubernetes object name"),
        ({"modelCache": {"claimName": "c", "sizeLimit": "1Gi"}}, "drop it or claimName"),
        ({"engine": {"image": ""}}, "spec.engine.image is required"),
        ({"engine": {"image": "i", "poolFraction": 1.5}}, "spec.engine.poolFraction is 1.5"),
        ({"engine": {"image": "i", "extraArgs": [1]}}, "spec.engine.extraArgs must be a list of strings"),
        ({"resources": {"memory": "lots"}}, "spec.resources.memory 'lots'"),
        ({"resources": {"gpusPerReplica": True}}, "spec.resources.gpusPerReplica is True"),
        ({"resources": {"gpusPerReplica": 2}}, "gpusPerReplica is 2; the engine uses one GPU per replica"),
        (
            {"engine": {"image": "ghcr.io/x y:1"}},
            "spec.engine.image 'ghcr.io/x y:1' is not an image reference",
        ),
        ({"engine": {"image": "ghcr.io/Upper/engine:1"}}, "is not an image reference"),
        ({"autoscaling": {"mode": "hpa", "target": 0.0001}}, "smallest target an HPA quantity can carry"),
        (
            {"rollout": {"strategy": "Surge", "maxUnavailable": 1}},
            "maxUnavailable applies to strategy Replace",
        ),
        ({"rollout": {"maxSurge": 0}}, "spec.rollout.maxSurge is 0"),
        ({"autoscaling": {"metric": "pool_utilization", "target": 3}}, "above 1 for pool_utilization"),
        ({"autoscaling": {"target": 0}}, "target must be greater than 0"),
        ({"controlPlane": {"url": "http://x"}}, "spec.controlPlane was removed"),
        (
            {"autoscaling": {"signals": [{"metric": "adapter_demand"}, {"metric": "adapter_demand"}]}},
            "spec.autoscaling.signals[1].metric adapter_demand is already scaled on",
        ),
        (
            {"autoscaling": {"signals": [{"metric": "waiting_requests", "target": 2}]}},
            "signals[0].metric waiting_requests is already scaled on",
        ),
        (
            {"autoscaling": {"signals": [{"metric": "queue"}]}},
            "spec.autoscaling.signals[0].metric is 'queue'",
        ),
        ({"autoscaling": {"signals": [{"target": 1}]}}, "spec.autoscaling.signals[0].metric is ''"),
        ({"autoscaling": {"signals": "adapter_demand"}}, "spec.autoscaling.signals must be a list"),
        (
            {"autoscaling": {"signals": [{"metric": "pool_pressure", "target": 2}]}},
            "signals[0].target 2.0 is above 1 for pool_pressure",
        ),
        (
            {"autoscaling": {"mode": "hpa", "signals": [{"metric": "adapter_demand"}]}},
            "signals[0]: adapter_demand is computed by the builtin autoscaler only",
        ),
        (
            {"autoscaling": {"mode": "hpa", "metric": "adapter_demand", "target": 1}},
            "spec.autoscaling: adapter_demand is computed by the builtin autoscaler only",
        ),
        ({"inferencePool": {}}, "spec.inferencePool.endpointPickerRef is missing"),
        ({"inferencePool": {"endpointPickerRef": {"name": "Epp"}}}, "endpointPickerRef.name 'Epp' is not"),
        (
            {"inferencePool": {"endpointPickerRef": {"name": "epp", "port": 0}}},
            "spec.inferencePool.endpointPickerRef.port is 0",
        ),
        (
            {"inferencePool": {"endpointPickerRef": {"name": "epp", "failureMode": "Open"}}},
            "failureMode is 'Open'; use one of FailClose, FailOpen",
        ),
        (
            {"adapterStore": {"uri": "s3://b", "secretRef": {}}},
            "spec.adapterStore.secretRef.name is required",
        ),
    ],
)
def test_invalid_specs_name_the_field(change: dict, words: str) -> None:
    raw = body(**change)
    if raw["spec"].get("internalTokenSecretRef", "") is None:
        del raw["spec"]["internalTokenSecretRef"]
    with pytest.raises(SpecError, match=re.escape(words)):
        parse(raw)


@pytest.mark.parametrize(
    "uri",
    [
        "/models/SmolLM2-135M-Instruct-Q8_0.gguf",
        "file:///models/llama",
        "s3://models/llama-3-8b/",
        "hf://meta-llama/Meta-Llama-3-8B-Instruct",
        "hf://HuggingFaceTB/SmolLM2-135M-Instruct@main",
    ],
)
def test_supported_model_uris_parse_and_pass_the_schema(uri: str) -> None:
    raw = body(model={"uri": uri})
    assert parse(raw).spec.model.uri == uri
    assert not list(jsonschema.Draft4Validator(crd_schema()).iter_errors(raw))


def test_name_too_long_is_rejected() -> None:
    bad = body()
    bad["metadata"]["name"] = "x" * 57
    with pytest.raises(SpecError, match=r"metadata\.name .* at most 56 characters"):
        parse(bad)
    bad["metadata"]["name"] = "x" * 56
    assert parse(bad).name == "x" * 56


def test_quantization_choices_are_the_engines_in_the_schema_and_the_spec() -> None:
    from loraplex.engine.model.quant_formats import QUANTIZATIONS

    model = crd_schema()["properties"]["spec"]["properties"]["model"]["properties"]
    assert tuple(model["quantization"]["enum"]) == QUANTIZATIONS
    validator = jsonschema.Draft4Validator(crd_schema())
    assert not list(validator.iter_errors(body(model={"uri": "/m.gguf", "quantization": "int4"})))
    assert any(
        "'fp8'" in e.message for e in validator.iter_errors(body(model={"uri": "/m", "quantization": "fp8"}))
    )
    for choice in QUANTIZATIONS:
        assert parse(body(model={"uri": "/m.gguf", "quantization": choice})).spec.model.quantization == choice


def test_signals_take_their_default_targets_and_keep_their_order() -> None:
    scaling = parse(
        body(
            autoscaling={
                "signals": [{"metric": "adapter_demand"}, {"metric": "pool_pressure", "target": 0.8}]
            }
        )
    ).spec.autoscaling
    assert scaling.targets() == (("waiting_requests", 4.0), ("adapter_demand", 1.0), ("pool_pressure", 0.8))
    schema = crd_schema()["properties"]["spec"]["properties"]["autoscaling"]["properties"]
    assert (
        schema["metric"]["enum"]
        == list(METRICS)
        == schema["signals"]["items"]["properties"]["metric"]["enum"]
    )
    assert schema["signals"]["maxItems"] == MAX_SIGNALS

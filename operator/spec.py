"""The typed InferenceDeployment: parse a CR body (dict) into frozen dataclasses, or say what is wrong.

The CRD's openAPIV3Schema is the user-facing validation; this module repeats the checks that matter to the
operator (and the cross-field ones the schema cannot express everywhere) so that a body which never went
through an API server, or one written before a schema change, still fails with a readable reason.
Defaults mirror the CRD's `default:` values; tests/operator/test_spec.py keeps the two in step.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

GROUP = "loraplex.dev"
VERSION = "v1alpha1"
PLURAL = "inferencedeployments"
KIND = "InferenceDeployment"

MODEL_FORMATS = ("gguf", "hf")
DTYPES = ("float32", "bfloat16", "float16")
AUTOSCALING_MODES = ("builtin", "hpa", "off")
METRICS = ("waiting_requests", "running_requests", "pool_utilization")

_CPU = re.compile(r"^[0-9]+(\.[0-9]+)?m?$")
_MEMORY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|K|M|G|T)?$")
# Children are named `<cr name>-engine`; a Service name is a DNS-1035 label of at most 63 characters.
_NAME = re.compile(r"^[a-z]([-a-z0-9]{0,54}[a-z0-9])?$")


class SpecError(ValueError):
    """A spec that can never work as written; the message says which field and what to do."""


@dataclass(frozen=True)
class ModelSpec:
    uri: str
    format: str = "gguf"
    dtype: str = "bfloat16"


@dataclass(frozen=True)
class EngineSpec:
    image: str
    extra_args: tuple[str, ...] = ()
    pool_fraction: float = 0.9
    max_resident_adapters: int = 64
    max_batch_tokens: int = 8192


@dataclass(frozen=True)
class ResourcesSpec:
    gpus_per_replica: int = 1
    cpu: str = "4"
    memory: str = "16Gi"


@dataclass(frozen=True)
class ReplicasSpec:
    min: int = 1
    max: int = 1


@dataclass(frozen=True)
class AutoscalingSpec:
    mode: str = "builtin"
    metric: str = "waiting_requests"
    target: float = 4.0
    scale_up_stabilization_seconds: int = 0
    scale_down_stabilization_seconds: int = 300


@dataclass(frozen=True)
class SecretKeyRef:
    name: str
    key: str = "token"


@dataclass(frozen=True)
class AdapterStoreSpec:
    uri: str
    secret_name: str | None = None


@dataclass(frozen=True)
class ControlPlaneSpec:
    url: str
    token_secret: SecretKeyRef | None = None


@dataclass(frozen=True)
class InferenceDeploymentSpec:
    model: ModelSpec
    engine: EngineSpec
    resources: ResourcesSpec = field(default_factory=ResourcesSpec)
    replicas: ReplicasSpec = field(default_factory=ReplicasSpec)
    autoscaling: AutoscalingSpec = field(default_factory=AutoscalingSpec)
    adapter_store: AdapterStoreSpec | None = None
    control_plane: ControlPlaneSpec | None = None


@dataclass(frozen=True)
class InferenceDeployment:
    """The identity the children need (owner reference, names, namespace) plus the validated spec."""

    name: str
    namespace: str
    uid: str
    generation: int
    spec: InferenceDeploymentSpec


def parse(body: Mapping[str, Any]) -> InferenceDeployment:
    """Validate a whole CR body; raises SpecError naming the first wrong field."""
    meta = body.get("metadata") or {}
    name = str(meta.get("name") or "")
    if not _NAME.match(name):
        raise SpecError(
            f"metadata.name {name!r} must be a lowercase DNS label of at most 56 characters "
            "(children get a '-engine' suffix); rename the InferenceDeployment"
        )
    return InferenceDeployment(
        name=name,
        namespace=str(meta.get("namespace") or "default"),
        uid=str(meta.get("uid") or ""),
        generation=int(meta.get("generation") or 0),
        spec=parse_spec(body.get("spec")),
    )


def parse_spec(raw: Any) -> InferenceDeploymentSpec:
    spec = _section(raw, "spec", required=True)
    replicas = _parse_replicas(_section(spec.get("replicas"), "spec.replicas"))
    return InferenceDeploymentSpec(
        model=_parse_model(_section(spec.get("model"), "spec.model", required=True)),
        engine=_parse_engine(_section(spec.get("engine"), "spec.engine", required=True)),
        resources=_parse_resources(_section(spec.get("resources"), "spec.resources")),
        replicas=replicas,
        autoscaling=_parse_autoscaling(_section(spec.get("autoscaling"), "spec.autoscaling")),
        adapter_store=_parse_adapter_store(spec.get("adapterStore")),
        control_plane=_parse_control_plane(spec.get("controlPlane")),
    )


def _parse_model(raw: Mapping[str, Any]) -> ModelSpec:
    defaults = ModelSpec(uri="")
    return ModelSpec(
        uri=_string(raw, "uri", "spec.model"),
        format=_choice(raw, "format", MODEL_FORMATS, defaults.format, "spec.model"),
        dtype=_choice(raw, "dtype", DTYPES, defaults.dtype, "spec.model"),
    )


def _parse_engine(raw: Mapping[str, Any]) -> EngineSpec:
    defaults = EngineSpec(image="")
    extra = raw.get("extraArgs", [])
    if not isinstance(extra, list) or not all(isinstance(arg, str) for arg in extra):
        raise SpecError("spec.engine.extraArgs must be a list of strings, e.g. ['--log-level', 'info']")
    return EngineSpec(
        image=_string(raw, "image", "spec.engine"),
        extra_args=tuple(extra),
        pool_fraction=_number(raw, "poolFraction", defaults.pool_fraction, 0.05, 0.98, "spec.engine"),
        max_resident_adapters=_integer(
            raw, "maxResidentAdapters", defaults.max_resident_adapters, 1, 65536, "spec.engine"
        ),
        max_batch_tokens=_integer(
            raw, "maxBatchTokens", defaults.max_batch_tokens, 16, 1048576, "spec.engine"
        ),
    )


def _parse_resources(raw: Mapping[str, Any]) -> ResourcesSpec:
    defaults = ResourcesSpec()
    cpu = str(raw.get("cpu", defaults.cpu))
    memory = str(raw.get("memory", defaults.memory))
    if not _CPU.match(cpu):
        raise SpecError(f"spec.resources.cpu {cpu!r} is not a CPU quantity; write e.g. '4' or '500m'")
    if not _MEMORY.match(memory):
        raise SpecError(f"spec.resources.memory {memory!r} is not a memory quantity; write e.g. '16Gi'")
    return ResourcesSpec(
        gpus_per_replica=_integer(raw, "gpusPerReplica", defaults.gpus_per_replica, 0, 16, "spec.resources"),
        cpu=cpu,
        memory=memory,
    )


def _parse_replicas(raw: Mapping[str, Any]) -> ReplicasSpec:
    low = _integer(raw, "min", ReplicasSpec.min, 1, 1000, "spec.replicas")
    high = _integer(raw, "max", ReplicasSpec.max, 1, 1000, "spec.replicas")
    if low > high:
        raise SpecError(
            f"spec.replicas.min ({low}) exceeds spec.replicas.max ({high}); raise max or lower min"
        )
    return ReplicasSpec(min=low, max=high)


def _parse_autoscaling(raw: Mapping[str, Any]) -> AutoscalingSpec:
    defaults = AutoscalingSpec()
    where = "spec.autoscaling"
    metric = _choice(raw, "metric", METRICS, defaults.metric, where)
    target = _number(raw, "target", defaults.target, 0.0, 1e9, where)
    if target <= 0:
        raise SpecError("spec.autoscaling.target must be greater than 0")
    if metric == "pool_utilization" and target > 1:
        raise SpecError(f"spec.autoscaling.target {target} is above 1 for pool_utilization (a fraction 0..1)")
    return AutoscalingSpec(
        mode=_choice(raw, "mode", AUTOSCALING_MODES, defaults.mode, where),
        metric=metric,
        target=target,
        scale_up_stabilization_seconds=_integer(
            raw, "scaleUpStabilizationSeconds", defaults.scale_up_stabilization_seconds, 0, 3600, where
        ),
        scale_down_stabilization_seconds=_integer(
            raw, "scaleDownStabilizationSeconds", defaults.scale_down_stabilization_seconds, 0, 3600, where
        ),
    )


def _parse_adapter_store(raw: Any) -> AdapterStoreSpec | None:
    if raw is None:
        return None
    section = _section(raw, "spec.adapterStore")
    secret = section.get("secretRef")
    where = "spec.adapterStore.secretRef"
    secret_name = None if secret is None else _string(_section(secret, where, required=True), "name", where)
    return AdapterStoreSpec(uri=_string(section, "uri", "spec.adapterStore"), secret_name=secret_name)


def _parse_control_plane(raw: Any) -> ControlPlaneSpec | None:
    if raw is None:
        return None
    section = _section(raw, "spec.controlPlane")
    url = _string(section, "url", "spec.controlPlane")
    if not url.startswith(("http://", "https://")):
        raise SpecError(f"spec.controlPlane.url {url!r} must start with http:// or https://")
    token = section.get("tokenSecretRef")
    token_ref = None
    if token is not None:
        ref = _section(token, "spec.controlPlane.tokenSecretRef")
        where = "spec.controlPlane.tokenSecretRef"
        token_ref = SecretKeyRef(name=_string(ref, "name", where), key=str(ref.get("key", "token")))
    return ControlPlaneSpec(url=url, token_secret=token_ref)


def _section(raw: Any, where: str, required: bool = False) -> Mapping[str, Any]:
    if raw is None and not required:
        return {}
    if not isinstance(raw, Mapping):
        raise SpecError(f"{where} is missing or not an object; see crds/examples/ for a complete spec")
    return raw


def _string(raw: Mapping[str, Any], key: str, where: str) -> str:
    value = raw.get(key)
    if not isinstance(value, str) or not value:
        raise SpecError(f"{where}.{key} is required and must be a non-empty string")
    return value


def _choice(raw: Mapping[str, Any], key: str, allowed: tuple[str, ...], default: str, where: str) -> str:
    value = raw.get(key, default)
    if value not in allowed:
        raise SpecError(f"{where}.{key} is {value!r}; use one of {', '.join(allowed)}")
    return str(value)


def _integer(raw: Mapping[str, Any], key: str, default: int, low: int, high: int, where: str) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise SpecError(f"{where}.{key} is {value!r}; use an integer from {low} to {high}")
    return value


def _number(raw: Mapping[str, Any], key: str, default: float, low: float, high: float, where: str) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise SpecError(f"{where}.{key} is {value!r}; use a number from {low} to {high}")
    return float(value)

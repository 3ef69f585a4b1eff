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

# What `loraplex serve --model` resolves (engine/model/sources.py): a path in the image or on a volume,
# file://, s3://bucket/key (downloaded into the model cache) and hf://org/name[@revision].
MODEL_URI_SCHEMES = ("file", "s3", "hf")
DTYPES = ("float32", "bfloat16", "float16")
AUTOSCALING_MODES = ("builtin", "hpa", "off")
METRICS = ("waiting_requests", "running_requests", "pool_utilization")

_QUANTITY = r"[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|K|M|G|T)?"
_CPU = re.compile(r"^[0-9]+(\.[0-9]+)?m?$")
_MEMORY = re.compile(f"^{_QUANTITY}$")
# Children are named `<cr name>-engine`; a Service name is a DNS-1035 label of at most 63 characters.
_NAME = re.compile(r"^[a-z]([-a-z0-9]{0,54}[a-z0-9])?$")
# Secret and PVC names are DNS subdomains; Secret keys are [-._a-zA-Z0-9]+.
_OBJECT_NAME = re.compile(r"^[a-z0-9]([-.a-z0-9]{0,251}[a-z0-9])?$")
_SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]{1,253}$")
_HF_URI = re.compile(
    r"^hf://[A-Za-z0-9][-A-Za-z0-9_.]{0,95}/[A-Za-z0-9][-A-Za-z0-9_.]{0,95}(@[-A-Za-z0-9_./]{1,255})?$"
)
_S3_URI = re.compile(r"^s3://[a-z0-9][-a-z0-9.]{1,61}[a-z0-9](/[^\s]*)?$")
_MAX_URI = 2048
# The operator sets these itself: the Service, probes and NetworkPolicy depend on them.
MANAGED_ARGS = ("--model", "--port", "--host")
INTERNAL_TOKEN_KEY = "internal-token"


class SpecError(ValueError):
    """A spec that can never work as written; the message says which field and what to do."""


@dataclass(frozen=True)
class ModelSpec:
    uri: str
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
    key: str = INTERNAL_TOKEN_KEY


@dataclass(frozen=True)
class AdapterStoreSpec:
    uri: str
    endpoint_url: str | None = None
    region: str | None = None
    # A Secret with keys AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, like the chart's adapterStore one.
    secret_name: str | None = None


@dataclass(frozen=True)
class ModelCacheSpec:
    """Where downloaded base models live: a PersistentVolumeClaim (kept across restarts) or an emptyDir."""

    claim_name: str | None = None
    size_limit: str | None = None


@dataclass(frozen=True)
class InferenceDeploymentSpec:
    model: ModelSpec
    engine: EngineSpec
    # Required: on a cluster the engine serves nothing without the token the gateway sends.
    internal_token: SecretKeyRef
    resources: ResourcesSpec = field(default_factory=ResourcesSpec)
    replicas: ReplicasSpec = field(default_factory=ReplicasSpec)
    autoscaling: AutoscalingSpec = field(default_factory=AutoscalingSpec)
    adapter_store: AdapterStoreSpec | None = None
    model_cache: ModelCacheSpec = field(default_factory=ModelCacheSpec)


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
    if not _NAME.fullmatch(name):
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
    if "controlPlane" in spec:
        raise SpecError(
            "spec.controlPlane was removed (nothing read its url): delete it and name the internal token's "
            "Secret in spec.internalTokenSecretRef"
        )
    replicas = _parse_replicas(_section(spec.get("replicas"), "spec.replicas"))
    return InferenceDeploymentSpec(
        model=_parse_model(_section(spec.get("model"), "spec.model", required=True)),
        engine=_parse_engine(_section(spec.get("engine"), "spec.engine", required=True)),
        resources=_parse_resources(_section(spec.get("resources"), "spec.resources")),
        replicas=replicas,
        autoscaling=_parse_autoscaling(_section(spec.get("autoscaling"), "spec.autoscaling")),
        internal_token=_parse_secret_key_ref(
            spec.get("internalTokenSecretRef"), "spec.internalTokenSecretRef"
        ),
        adapter_store=_parse_adapter_store(spec.get("adapterStore")),
        model_cache=_parse_model_cache(_section(spec.get("modelCache"), "spec.modelCache")),
    )


def _parse_model(raw: Mapping[str, Any]) -> ModelSpec:
    defaults = ModelSpec(uri="")
    return ModelSpec(
        uri=check_model_uri(_string(raw, "uri", "spec.model")),
        dtype=_choice(raw, "dtype", DTYPES, defaults.dtype, "spec.model"),
    )


def check_model_uri(uri: str) -> str:
    """The URI if `loraplex serve --model` can resolve its form; SpecError naming the problem otherwise."""
    where = "spec.model.uri"
    if len(uri) > _MAX_URI or any(c.isspace() or not c.isprintable() for c in uri):
        raise SpecError(f"{where} must be at most {_MAX_URI} printable characters without spaces")
    scheme, sep, _ = uri.partition("://")
    if not sep:
        if not uri.startswith("/"):
            raise SpecError(f"{where} {uri!r} is relative; give an absolute path in the image or a volume")
        return uri
    if scheme not in MODEL_URI_SCHEMES:
        supported = ", ".join(f"{s}://" for s in MODEL_URI_SCHEMES)
        raise SpecError(f"{where} scheme {scheme!r} is not supported; use an absolute path, {supported}")
    if scheme == "file" and not uri.startswith("file:///"):
        raise SpecError(f"{where} {uri!r} must be file:///absolute/path")
    if scheme == "s3" and not _S3_URI.fullmatch(uri):
        raise SpecError(
            f"{where} {uri!r} is not s3://bucket/key (a lowercase bucket name of 3-63 characters)"
        )
    if scheme == "hf" and not _HF_URI.fullmatch(uri):
        raise SpecError(f"{where} {uri!r} is not hf://org/name or hf://org/name@revision")
    return uri


def _parse_engine(raw: Mapping[str, Any]) -> EngineSpec:
    defaults = EngineSpec(image="")
    extra = raw.get("extraArgs", [])
    if not isinstance(extra, list) or not all(isinstance(arg, str) for arg in extra):
        raise SpecError("spec.engine.extraArgs must be a list of strings, e.g. ['--max-num-seqs', '32']")
    for arg in extra:
        if arg.split("=", 1)[0] in MANAGED_ARGS:
            raise SpecError(
                f"spec.engine.extraArgs sets {arg.split('=', 1)[0]}, which the operator sets itself "
                "(spec.model.uri, port 8000); remove it"
            )
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
    if not _CPU.fullmatch(cpu):
        raise SpecError(f"spec.resources.cpu {cpu!r} is not a CPU quantity; write e.g. '4' or '500m'")
    if not _MEMORY.fullmatch(memory):
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


def _parse_secret_key_ref(raw: Any, where: str) -> SecretKeyRef:
    if raw is None:
        raise SpecError(
            f"{where} is required: name the Secret holding the internal token the gateway sends (the chart "
            f"makes <release>-loraplex-secrets with key {INTERNAL_TOKEN_KEY})"
        )
    section = _section(raw, where)
    name = _object_name(section, "name", where)
    key = section.get("key", INTERNAL_TOKEN_KEY)
    if not isinstance(key, str) or not _SECRET_KEY.fullmatch(key):
        raise SpecError(f"{where}.key {key!r} is not a Secret key (letters, digits, '-', '_', '.')")
    return SecretKeyRef(name=name, key=key)


def _parse_adapter_store(raw: Any) -> AdapterStoreSpec | None:
    if raw is None:
        return None
    where = "spec.adapterStore"
    section = _section(raw, where)
    uri = _string(section, "uri", where)
    if len(uri) > _MAX_URI or not uri.startswith(("/", "file:///", "s3://")):
        raise SpecError(
            f"{where}.uri {uri[:100]!r} must be an absolute path, file:///path or s3://bucket/prefix"
        )
    endpoint = section.get("endpointUrl")
    if endpoint is not None and (
        not isinstance(endpoint, str)
        or not endpoint.startswith(("http://", "https://"))
        or len(endpoint) > 2048
    ):
        raise SpecError(f"{where}.endpointUrl {endpoint!r} must be an http:// or https:// URL")
    region = section.get("region")
    if region is not None and (not isinstance(region, str) or not re.fullmatch(r"[a-z0-9-]{1,32}", region)):
        raise SpecError(f"{where}.region {region!r} is not a region name such as us-east-1")
    secret = section.get("secretRef")
    secret_name = None
    if secret is not None:
        secret_name = _object_name(
            _section(secret, f"{where}.secretRef", required=True), "name", f"{where}.secretRef"
        )
    return AdapterStoreSpec(uri=uri, endpoint_url=endpoint, region=region, secret_name=secret_name)


def _parse_model_cache(raw: Mapping[str, Any]) -> ModelCacheSpec:
    where = "spec.modelCache"
    claim = None if raw.get("claimName") is None else _object_name(raw, "claimName", where)
    size = raw.get("sizeLimit")
    if size is not None and (not isinstance(size, str) or not _MEMORY.fullmatch(size)):
        raise SpecError(f"{where}.sizeLimit {size!r} is not a quantity; write e.g. '40Gi'")
    if claim is not None and size is not None:
        raise SpecError(f"{where}: sizeLimit applies to the emptyDir cache only; drop it or claimName")
    return ModelCacheSpec(claim_name=claim, size_limit=size)


def _object_name(raw: Mapping[str, Any], key: str, where: str) -> str:
    value = _string(raw, key, where)
    if not _OBJECT_NAME.fullmatch(value):
        raise SpecError(
            f"{where}.{key} {value[:100]!r} is not a Kubernetes object name (lowercase DNS subdomain)"
        )
    return value


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

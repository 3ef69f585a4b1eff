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

from loraplex.engine.model.quant_formats import QUANTIZATIONS  # torch-free: the engine's own choices
from loraplex.operator.engine_args import ExtraArgsError, check_extra_args
from loraplex.operator.overlay import OverlayError, PodTemplateOverlay, parse_pod_template
from loraplex.operator.signals import SIGNALS

GROUP = "loraplex.dev"
VERSION = "v1alpha1"
PLURAL = "inferencedeployments"
KIND = "InferenceDeployment"

# What `loraplex serve --model` resolves (engine/model/sources.py): a path in the image or on a volume,
# file://, s3://bucket/key (downloaded into the model cache) and hf://org/name[@revision].
MODEL_URI_SCHEMES = ("file", "s3", "hf")
DTYPES = ("float32", "bfloat16", "float16")
AUTOSCALING_MODES = ("builtin", "hpa", "off")
METRICS = tuple(SIGNALS)
# Each signal at most once, beside the primary `metric`.
MAX_SIGNALS = len(METRICS) - 1
FAILURE_MODES = ("FailClose", "FailOpen")  # an InferencePool's endpointPickerRef.failureMode
# The endpoint picker's port when a CR names none: the port the inference extension's EPP serves on.
DEFAULT_EPP_PORT = 9002
# Surge: one extra pod during a rollout, none unavailable (needs a spare GPU); Replace: stop one pod, then
# start its successor (no spare GPU needed, one replica fewer while it loads).
ROLLOUT_STRATEGIES = ("Surge", "Replace")

# Limits shared with the CRD's schema and CEL rules (tests/operator/test_cel.py checks they agree).
# Children are named `<name>-engine`, and a Service name is a DNS-1035 label of at most 63 characters.
MAX_NAME_LENGTH = 63 - len("-engine")
# The engine runs one model on one device (engine/config.py: cuda, no tensor parallelism): a second GPU
# in the pod would sit idle. More throughput comes from more replicas.
MAX_GPUS_PER_REPLICA = 1
MAX_REPLICAS = 1000
MAX_ROLLOUT_STEP = 100
MAX_TARGET = 1e9
# The HPA's target is a Kubernetes quantity with milli precision: 0.001 is the smallest that is not 0.
MIN_HPA_TARGET = 0.001
MAX_STABILIZATION_SECONDS = 3600
MAX_EXTRA_ARGS = 64
MAX_EXTRA_ARG_LENGTH = 1024

_QUANTITY = r"[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|K|M|G|T)?"
_CPU = re.compile(r"^[0-9]+(\.[0-9]+)?m?$")
_MEMORY = re.compile(f"^{_QUANTITY}$")
# Children are named `<cr name>-engine`; a Service name is a DNS-1035 label of at most 63 characters.
_NAME = re.compile(rf"^[a-z]([-a-z0-9]{{0,{MAX_NAME_LENGTH - 2}}}[a-z0-9])?$")
# A Service's name (the endpoint picker's): a DNS-1035 label.
_SERVICE_NAME = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
# Secret and PVC names are DNS subdomains; Secret keys are [-._a-zA-Z0-9]+.
_OBJECT_NAME = re.compile(r"^[a-z0-9]([-.a-z0-9]{0,251}[a-z0-9])?$")
_SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]{1,253}$")
_HF_URI = re.compile(
    r"^hf://[A-Za-z0-9][-A-Za-z0-9_.]{0,95}/[A-Za-z0-9][-A-Za-z0-9_.]{0,95}(@[-A-Za-z0-9_./]{1,255})?$"
)
_S3_URI = re.compile(r"^s3://[a-z0-9][-a-z0-9.]{1,61}[a-z0-9](/[^\s]*)?$")
_MAX_URI = 2048
# [registry[:port]/]path[:tag][@sha256:digest], lowercase path as registries require.
MAX_IMAGE_LENGTH = 512
_IMAGE = re.compile(
    r"^[a-zA-Z0-9][-a-zA-Z0-9.]*(:[0-9]+)?(/[a-z0-9]+([._-]+[a-z0-9]+)*)*"
    r"(:[A-Za-z0-9_][-A-Za-z0-9_.]{0,127})?(@sha256:[a-f0-9]{64})?$"
)
INTERNAL_TOKEN_KEY = "internal-token"


class SpecError(ValueError):
    """A spec that can never work as written; the message says which field and what to do."""


@dataclass(frozen=True)
class ModelSpec:
    uri: str
    dtype: str = "bfloat16"
    quantization: str = "none"  # weight-only int8/int4 base weights: `loraplex serve --quantization`


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
class SignalTarget:
    metric: str
    target: float


@dataclass(frozen=True)
class AutoscalingSpec:
    mode: str = "builtin"
    metric: str = "waiting_requests"
    target: float = 4.0
    scale_up_stabilization_seconds: int = 0
    scale_down_stabilization_seconds: int = 300
    # More signals beside `metric`, each with its own per-pod target: the largest recommendation wins.
    signals: tuple[SignalTarget, ...] = ()

    def targets(self) -> tuple[tuple[str, float], ...]:
        """(signal, target) pairs, the primary first."""
        return ((self.metric, self.target), *((s.metric, s.target) for s in self.signals))


@dataclass(frozen=True)
class InferencePoolSpec:
    """An `InferencePool` (inference.networking.k8s.io/v1) over the engine pods, for a team's own inference
    gateway; the endpoint picker (EPP) is theirs, named here."""

    endpoint_picker: str
    endpoint_picker_port: int = DEFAULT_EPP_PORT
    failure_mode: str = "FailClose"


@dataclass(frozen=True)
class RolloutSpec:
    strategy: str = "Surge"
    max_surge: int = 1  # Surge only: extra pods started before old ones stop
    max_unavailable: int = 1  # Replace only: pods stopped before their successors start


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
    rollout: RolloutSpec = field(default_factory=RolloutSpec)
    pod_template: PodTemplateOverlay = field(default_factory=PodTemplateOverlay)
    inference_pool: InferencePoolSpec | None = None


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
            f"metadata.name {name!r} must be a lowercase DNS label of at most {MAX_NAME_LENGTH} characters "
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
        rollout=_parse_rollout(_section(spec.get("rollout"), "spec.rollout")),
        pod_template=_parse_pod_template(spec.get("podTemplate")),
        inference_pool=_parse_inference_pool(spec.get("inferencePool")),
    )


def _parse_pod_template(raw: Any) -> PodTemplateOverlay:
    try:
        return parse_pod_template(raw)
    except OverlayError as error:
        raise SpecError(str(error)) from error


def _parse_model(raw: Mapping[str, Any]) -> ModelSpec:
    defaults = ModelSpec(uri="")
    return ModelSpec(
        uri=check_model_uri(_string(raw, "uri", "spec.model")),
        dtype=_choice(raw, "dtype", DTYPES, defaults.dtype, "spec.model"),
        quantization=_choice(raw, "quantization", QUANTIZATIONS, defaults.quantization, "spec.model"),
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
    if len(extra) > MAX_EXTRA_ARGS or any(len(arg) > MAX_EXTRA_ARG_LENGTH for arg in extra):
        raise SpecError(
            f"spec.engine.extraArgs takes at most {MAX_EXTRA_ARGS} arguments of at most "
            f"{MAX_EXTRA_ARG_LENGTH} characters each"
        )
    try:
        check_extra_args(extra)
    except ExtraArgsError as error:
        raise SpecError(str(error)) from error
    image = _string(raw, "image", "spec.engine")
    if len(image) > MAX_IMAGE_LENGTH or not _IMAGE.fullmatch(image):
        raise SpecError(
            f"spec.engine.image {image[:100]!r} is not an image reference such as "
            "ghcr.io/loraplex/engine:0.1.0 or registry/name@sha256:<digest>"
        )
    return EngineSpec(
        image=image,
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
        gpus_per_replica=_gpus(raw.get("gpusPerReplica", defaults.gpus_per_replica)),
        cpu=cpu,
        memory=memory,
    )


def _parse_replicas(raw: Mapping[str, Any]) -> ReplicasSpec:
    low = _integer(raw, "min", ReplicasSpec.min, 1, MAX_REPLICAS, "spec.replicas")
    high = _integer(raw, "max", ReplicasSpec.max, 1, MAX_REPLICAS, "spec.replicas")
    if low > high:
        raise SpecError(
            f"spec.replicas.min ({low}) exceeds spec.replicas.max ({high}); raise max or lower min"
        )
    return ReplicasSpec(min=low, max=high)


def _gpus(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_GPUS_PER_REPLICA:
        raise SpecError(
            f"spec.resources.gpusPerReplica is {value!r}; the engine uses one GPU per replica (0 runs it on "
            f"the CPU), so use 0 to {MAX_GPUS_PER_REPLICA} and raise spec.replicas.max for more throughput"
        )
    return value


def _parse_rollout(raw: Mapping[str, Any]) -> RolloutSpec:
    where = "spec.rollout"
    defaults = RolloutSpec()
    strategy = _choice(raw, "strategy", ROLLOUT_STRATEGIES, defaults.strategy, where)
    # Each knob belongs to one strategy; setting the other's is a misunderstanding worth naming.
    if strategy == "Surge" and "maxUnavailable" in raw:
        raise SpecError(f"{where}.maxUnavailable applies to strategy Replace; Surge never stops a pod early")
    if strategy == "Replace" and "maxSurge" in raw:
        raise SpecError(f"{where}.maxSurge applies to strategy Surge; Replace never starts an extra pod")
    return RolloutSpec(
        strategy=strategy,
        max_surge=_integer(raw, "maxSurge", defaults.max_surge, 1, MAX_ROLLOUT_STEP, where),
        max_unavailable=_integer(raw, "maxUnavailable", defaults.max_unavailable, 1, MAX_ROLLOUT_STEP, where),
    )


def _parse_autoscaling(raw: Mapping[str, Any]) -> AutoscalingSpec:
    defaults = AutoscalingSpec()
    where = "spec.autoscaling"
    mode = _choice(raw, "mode", AUTOSCALING_MODES, defaults.mode, where)
    metric = _choice(raw, "metric", METRICS, defaults.metric, where)
    target = _signal_target(raw, metric, mode, defaults.target, where)
    signals = _parse_signals(raw.get("signals", []), metric, mode)
    return AutoscalingSpec(
        mode=mode,
        metric=metric,
        target=target,
        scale_up_stabilization_seconds=_integer(
            raw,
            "scaleUpStabilizationSeconds",
            defaults.scale_up_stabilization_seconds,
            0,
            MAX_STABILIZATION_SECONDS,
            where,
        ),
        scale_down_stabilization_seconds=_integer(
            raw,
            "scaleDownStabilizationSeconds",
            defaults.scale_down_stabilization_seconds,
            0,
            MAX_STABILIZATION_SECONDS,
            where,
        ),
        signals=signals,
    )


def _signal_target(raw: Mapping[str, Any], metric: str, mode: str, default: float, where: str) -> float:
    """`target` of `metric` at `where`: positive, a fraction for the fraction signals, an HPA quantity
    in hpa mode, and a signal an HPA can read there."""
    target = _number(raw, "target", default, 0.0, MAX_TARGET, where)
    if target <= 0:
        raise SpecError(f"{where}.target must be greater than 0")
    if SIGNALS[metric].fraction and target > 1:
        raise SpecError(f"{where}.target {target} is above 1 for {metric} (a fraction 0..1)")
    if mode == "hpa" and target < MIN_HPA_TARGET:
        raise SpecError(
            f"{where}.target {target} is below {MIN_HPA_TARGET}, the smallest target an HPA "
            "quantity can carry (1m)"
        )
    if mode == "hpa" and SIGNALS[metric].hpa_metric is None:
        raise SpecError(
            f"{where}: {metric} is computed by the builtin autoscaler only (an HPA cannot count the "
            "adapters in vllm:lora_requests_info's labels); use mode builtin or another metric"
        )
    return target


def _parse_signals(raw: Any, primary: str, mode: str) -> tuple[SignalTarget, ...]:
    where = "spec.autoscaling.signals"
    if not isinstance(raw, list) or len(raw) > MAX_SIGNALS:
        raise SpecError(f"{where} must be a list of at most {MAX_SIGNALS} {{metric, target}} objects")
    seen = {primary}
    signals = []
    for index, item in enumerate(raw):
        at = f"{where}[{index}]"
        section = _section(item, at, required=True)
        metric = _choice(section, "metric", METRICS, "", at)
        if metric in seen:
            raise SpecError(
                f"{at}.metric {metric} is already scaled on (spec.autoscaling.metric or an earlier "
                "signal); give each signal once"
            )
        seen.add(metric)
        target = _signal_target(section, metric, mode, SIGNALS[metric].default_target, at)
        signals.append(SignalTarget(metric=metric, target=target))
    return tuple(signals)


def _parse_inference_pool(raw: Any) -> InferencePoolSpec | None:
    if raw is None:
        return None
    where = "spec.inferencePool"
    picker = _section(_section(raw, where).get("endpointPickerRef"), f"{where}.endpointPickerRef", True)
    at = f"{where}.endpointPickerRef"
    name = _string(picker, "name", at)
    if not _SERVICE_NAME.fullmatch(name):
        raise SpecError(f"{at}.name {name[:100]!r} is not a Service name (a lowercase DNS label)")
    return InferencePoolSpec(
        endpoint_picker=name,
        endpoint_picker_port=_integer(picker, "port", DEFAULT_EPP_PORT, 1, 65535, at),
        failure_mode=_choice(picker, "failureMode", FAILURE_MODES, "FailClose", at),
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

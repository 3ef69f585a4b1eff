"""`spec.podTemplate`: what a cluster needs from engine pods that the operator cannot guess, merged in.

Placement (nodeSelector, affinity, tolerations, priorityClassName, runtimeClassName), identity
(serviceAccountName, imagePullSecrets), pod labels and annotations, a pod securityContext that only
tightens, and for the `engine` container extra env, envFrom and volumeMounts with the volumes they need.
The merge follows strategic-merge-patch semantics: maps merge key by key, lists of named things merge by
their key (containers, env, volumes and imagePullSecrets by `name`, volumeMounts by `mountPath`,
tolerations by `key`), scalars replace.

What the operator must own is refused, not merged, so a refusal names the field (InvalidSpec): the engine
container's command, args, image, ports, probes and resources; the env it sets (the internal token, the
ConfigMap's settings, the store credentials); its volumes `model-cache` and `tmp` and their mount paths;
the selector and ownership labels; and anything that would take the pod out of Pod Security "restricted"
(runAsNonRoot false, uid 0, an unconfined seccomp profile, host namespaces, volume types other than the
restricted set). Fields this module does not know are refused too: a typo must not vanish silently.
An allowed image runs next to the internal token, so what would make it run other code or send its traffic
elsewhere is refused as well: environment names by env_policy.py (and envFrom without a safe prefix), and
mounts anywhere but under MOUNT_PREFIXES, or nested in one another. Which CSI drivers and runtime classes
may be named is the cluster admin's choice, so policy.py checks those against the operator's settings.
Pure: parse_pod_template raises OverlayError, apply_overlay returns a new pod template.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from loraplex.operator.engine_args import operator_variables
from loraplex.operator.env_policy import env_prefix_problem, env_problem

ENGINE_CONTAINER = "engine"
# Labels the Service, the PDB and the control plane's discovery select on, and ownership markers.
OPERATOR_LABELS = frozenset(
    {
        "app.kubernetes.io/name",
        "app.kubernetes.io/instance",
        "app.kubernetes.io/component",
        "app.kubernetes.io/part-of",
        "app.kubernetes.io/managed-by",
    }
)
OPERATOR_ANNOTATION_PREFIX = "loraplex.dev/"
# Variables the operator sets on the engine (env and its ConfigMap); tests/operator/test_overlay.py keeps
# this in step with resources.py.
OPERATOR_ENV = frozenset(
    {
        "LORAPLEX_INTERNAL_TOKEN",
        "LORAPLEX_DEVICE",
        "LORAPLEX_POOL_FRACTION",
        "LORAPLEX_MAX_RESIDENT_ADAPTERS",
        "LORAPLEX_MAX_BATCH_TOKENS",
        "LORAPLEX_MODEL_CACHE",
        "LORAPLEX_ADAPTER_STORE",
        "LORAPLEX_S3_ENDPOINT_URL",
        "AWS_REGION",
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
    }
)
OPERATOR_VOLUMES = frozenset({"model-cache", "tmp"})
OPERATOR_MOUNT_PATHS = frozenset({"/var/cache/loraplex", "/tmp"})
# Where podTemplate volumes may be mounted: directories no image of ours uses, so nothing there is code
# or a system file (the engine image lives in /opt/loraplex, Python and libc under /usr, /etc, /lib).
MOUNT_PREFIXES = ("/mnt", "/data")
# Pod Security "restricted" permits exactly these volume sources.
VOLUME_SOURCES = frozenset(
    {
        "configMap",
        "csi",
        "downwardAPI",
        "emptyDir",
        "ephemeral",
        "persistentVolumeClaim",
        "projected",
        "secret",
    }
)
SECCOMP_TYPES = ("RuntimeDefault", "Localhost")
# Size limits, the CRD's maxItems/maxProperties too (they also bound the CEL rules' cost); test_cel.py
# checks the two agree.
MAX_ITEMS = {
    "labels": 64,
    "annotations": 64,
    "nodeSelector": 64,
    "tolerations": 32,
    "imagePullSecrets": 16,
    "supplementalGroups": 32,
    "env": 128,
    "envFrom": 16,
    "volumeMounts": 32,
    "volumes": 32,
    "containers": 1,  # the engine's, once
}

_SPEC_KEYS = (
    "nodeSelector",
    "affinity",
    "tolerations",
    "imagePullSecrets",
    "serviceAccountName",
    "securityContext",
    "priorityClassName",
    "runtimeClassName",
    "containers",
    "volumes",
)
_CONTAINER_KEYS = ("name", "env", "envFrom", "volumeMounts")
_SECURITY_KEYS = (
    "runAsUser",
    "runAsGroup",
    "runAsNonRoot",
    "fsGroup",
    "fsGroupChangePolicy",
    "supplementalGroups",
    "seccompProfile",
)
_TOLERATION_KEYS = ("key", "operator", "value", "effect", "tolerationSeconds")
_MOUNT_KEYS = ("name", "mountPath", "subPath", "readOnly")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-.a-z0-9]{0,251}[a-z0-9])?$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_QUALIFIED_NAME = re.compile(
    r"^([a-z0-9]([-.a-z0-9]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$")
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]{0,254}$")
WHERE = "spec.podTemplate"


class OverlayError(ValueError):
    """An overlay field that is malformed or would take over what the operator owns."""


@dataclass(frozen=True)
class PodTemplateOverlay:
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    spec: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SecretReference:
    """A credential the pod gets: a Secret, or a ServiceAccount (workload-identity webhooks hand its cloud
    role to the pod)."""

    name: str
    field: str  # where the CR names it, for the policy's message
    kind: str = "Secret"


def parse_pod_template(raw: Any) -> PodTemplateOverlay:
    """The validated overlay (deep copies); OverlayError naming the first refused field."""
    if raw is None:
        return PodTemplateOverlay()
    top = _mapping(raw, WHERE, ("metadata", "spec"))
    meta = _mapping(top.get("metadata") or {}, f"{WHERE}.metadata", ("labels", "annotations"))
    labels = _string_map(meta.get("labels") or {}, f"{WHERE}.metadata.labels", _LABEL_VALUE)
    for key in labels:
        if key in OPERATOR_LABELS:
            raise OverlayError(f"{WHERE}.metadata.labels.{key} is set by the operator (selectors rely on it)")
    annotations = _string_map(meta.get("annotations") or {}, f"{WHERE}.metadata.annotations", None)
    for key in annotations:
        if key.startswith(OPERATOR_ANNOTATION_PREFIX):
            raise OverlayError(
                f"{WHERE}.metadata.annotations.{key}: {OPERATOR_ANNOTATION_PREFIX}* is the operator's"
            )
    spec = dict(_mapping(top.get("spec") or {}, f"{WHERE}.spec", _SPEC_KEYS))
    for key, check in _SPEC_CHECKS.items():
        if key in spec:
            check(spec[key], f"{WHERE}.spec.{key}")
    _check_mounted_volumes_exist(spec)
    return PodTemplateOverlay(labels=labels, annotations=annotations, spec=copy.deepcopy(spec))


def secret_references(overlay: PodTemplateOverlay) -> list[SecretReference]:
    """Every credential the overlay gives the pod: pull secrets, env, envFrom, secret, projected and CSI
    volumes, and the ServiceAccount."""
    where = f"{WHERE}.spec"
    spec = overlay.spec
    found = [
        SecretReference(item["name"], f"{where}.imagePullSecrets[{i}]")
        for i, item in enumerate(spec.get("imagePullSecrets") or [])
    ]
    if spec.get("serviceAccountName"):
        found.append(
            SecretReference(spec["serviceAccountName"], f"{where}.serviceAccountName", "ServiceAccount")
        )
    for container in spec.get("containers") or []:
        for i, var in enumerate(container.get("env") or []):
            ref = (var.get("valueFrom") or {}).get("secretKeyRef")
            if ref:
                found.append(SecretReference(ref["name"], f"{where}.containers[engine].env[{i}]"))
        for i, source in enumerate(container.get("envFrom") or []):
            if source.get("secretRef"):
                found.append(
                    SecretReference(source["secretRef"]["name"], f"{where}.containers[engine].envFrom[{i}]")
                )
    for i, volume in enumerate(spec.get("volumes") or []):
        if volume.get("secret"):
            found.append(SecretReference(volume["secret"]["secretName"], f"{where}.volumes[{i}].secret"))
        csi_secret = (volume.get("csi") or {}).get("nodePublishSecretRef")
        if csi_secret:
            found.append(
                SecretReference(csi_secret["name"], f"{where}.volumes[{i}].csi.nodePublishSecretRef")
            )
        for j, source in enumerate((volume.get("projected") or {}).get("sources") or []):
            if source.get("secret"):
                found.append(
                    SecretReference(source["secret"]["name"], f"{where}.volumes[{i}].projected.sources[{j}]")
                )
    return found


def apply_overlay(template: Mapping[str, Any], overlay: PodTemplateOverlay) -> dict[str, Any]:
    """A new pod template: the operator's with the overlay merged in (strategic-merge semantics)."""
    result = copy.deepcopy(dict(template))
    meta = result.setdefault("metadata", {})
    meta["labels"] = {**(meta.get("labels") or {}), **overlay.labels}
    meta["annotations"] = {**(meta.get("annotations") or {}), **overlay.annotations}
    pod = result.setdefault("spec", {})
    for key, value in overlay.spec.items():
        value = copy.deepcopy(value)
        if key == "containers":
            pod["containers"] = _merge_containers(pod.get("containers") or [], value)
        elif key == "tolerations":
            pod[key] = _merge_list(pod.get(key) or [], value, "key")
        elif key in ("imagePullSecrets", "volumes"):
            pod[key] = _merge_list(pod.get(key) or [], value, "name")
        elif isinstance(value, Mapping):
            pod[key] = _merge_maps(pod.get(key) or {}, value)
        else:
            pod[key] = value
    return result


def _merge_containers(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    merged = [dict(container) for container in ours]
    for patch in theirs:
        target = next(c for c in merged if c.get("name") == patch["name"])  # parse allows only `engine`
        target["env"] = _merge_list(target.get("env") or [], patch.get("env") or [], "name")
        # envFrom: the last source wins a duplicate key, so the operator's ConfigMap goes after the user's.
        target["envFrom"] = [*(patch.get("envFrom") or []), *(target.get("envFrom") or [])]
        target["volumeMounts"] = _merge_list(
            target.get("volumeMounts") or [], patch.get("volumeMounts") or [], "mountPath"
        )
    return merged


def _merge_list(ours: list[dict[str, Any]], theirs: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    """Items with the same merge key merge (theirs win field by field); new ones are appended in order."""
    merged = [dict(item) for item in ours]
    for item in theirs:
        match = next((m for m in merged if item.get(key) is not None and m.get(key) == item.get(key)), None)
        if match is None:
            merged.append(dict(item))
        else:
            match.update(item)
    return merged


def _merge_maps(ours: Mapping[str, Any], theirs: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(ours)
    for key, value in theirs.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _merge_maps(merged[key], value)
        else:
            merged[key] = value
    return merged


# --- validation ------------------------------------------------------------------------------------------


def _mapping(raw: Any, where: str, allowed: tuple[str, ...] | None = None) -> Mapping[str, Any]:
    if not isinstance(raw, Mapping):
        raise OverlayError(f"{where} must be an object")
    if allowed is not None:
        unknown = sorted(set(raw) - set(allowed))
        if unknown:
            raise OverlayError(f"{where}.{unknown[0]} is not supported here; allowed: {', '.join(allowed)}")
    return raw


def _list(raw: Any, where: str) -> list[Any]:
    if not isinstance(raw, list):
        raise OverlayError(f"{where} must be a list")
    _check_size(raw, where)
    return raw


def _check_size(raw: list[Any] | Mapping[str, Any], where: str) -> None:
    limit = MAX_ITEMS.get(where.rsplit(".", 1)[-1])
    if limit is not None and len(raw) > limit:
        raise OverlayError(f"{where} has {len(raw)} entries; at most {limit}")


def _string_map(raw: Any, where: str, value_pattern: re.Pattern[str] | None) -> dict[str, str]:
    result: dict[str, str] = {}
    _check_size(_mapping(raw, where), where)
    for key, value in _mapping(raw, where).items():
        if not isinstance(key, str) or not _QUALIFIED_NAME.fullmatch(key):
            raise OverlayError(f"{where}: key {key!r} is not a qualified name such as example.com/team")
        if not isinstance(value, str) or (value_pattern is not None and not value_pattern.fullmatch(value)):
            raise OverlayError(f"{where}.{key}: value {value!r} is not a valid label value")
        result[key] = value
    return result


def _name(raw: Any, where: str, pattern: re.Pattern[str] = _DNS_SUBDOMAIN) -> str:
    if not isinstance(raw, str) or not pattern.fullmatch(raw):
        raise OverlayError(f"{where} {raw!r} is not a Kubernetes object name (lowercase DNS name)")
    return raw


def _check_node_selector(raw: Any, where: str) -> None:
    _string_map(raw, where, _LABEL_VALUE)


def _check_affinity(raw: Any, where: str) -> None:
    # The API server validates the terms; the operator only needs to know it is the affinity object.
    _mapping(raw, where, ("nodeAffinity", "podAffinity", "podAntiAffinity"))


def _check_tolerations(raw: Any, where: str) -> None:
    for i, item in enumerate(_list(raw, where)):
        toleration = _mapping(item, f"{where}[{i}]", _TOLERATION_KEYS)
        if toleration.get("operator", "Equal") not in ("Equal", "Exists"):
            raise OverlayError(f"{where}[{i}].operator must be Equal or Exists")
        if toleration.get("effect", "NoSchedule") not in ("NoSchedule", "PreferNoSchedule", "NoExecute"):
            raise OverlayError(f"{where}[{i}].effect must be NoSchedule, PreferNoSchedule or NoExecute")


def _check_pull_secrets(raw: Any, where: str) -> None:
    for i, item in enumerate(_list(raw, where)):
        _name(_mapping(item, f"{where}[{i}]", ("name",)).get("name"), f"{where}[{i}].name")


def _check_name(raw: Any, where: str) -> None:
    _name(raw, where)


def _check_security_context(raw: Any, where: str) -> None:
    context = _mapping(raw, where, _SECURITY_KEYS)
    if context.get("runAsNonRoot", True) is not True:
        raise OverlayError(f"{where}.runAsNonRoot must stay true (Pod Security restricted)")
    for key in ("runAsUser", "runAsGroup", "fsGroup"):
        value = context.get(key, 1)
        low = 1 if key == "runAsUser" else 0
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= 2**31 - 1:
            raise OverlayError(f"{where}.{key} is {value!r}; use an id from {low} (root is refused)")
    groups = _list(context.get("supplementalGroups", []), f"{where}.supplementalGroups")
    if not all(isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in groups):
        raise OverlayError(f"{where}.supplementalGroups must be a list of group ids")
    if context.get("fsGroupChangePolicy", "Always") not in ("Always", "OnRootMismatch"):
        raise OverlayError(f"{where}.fsGroupChangePolicy must be Always or OnRootMismatch")
    if "seccompProfile" in context:
        profile = _mapping(context["seccompProfile"], f"{where}.seccompProfile", ("type", "localhostProfile"))
        if profile.get("type") not in SECCOMP_TYPES:
            raise OverlayError(
                f"{where}.seccompProfile.type must be RuntimeDefault or Localhost (Pod Security restricted)"
            )
        if (profile["type"] == "Localhost") != isinstance(profile.get("localhostProfile"), str):
            raise OverlayError(
                f"{where}.seccompProfile.localhostProfile goes with type Localhost, and only it"
            )


def _check_containers(raw: Any, where: str) -> None:
    for i, item in enumerate(_list(raw, where)):
        container = _mapping(item, f"{where}[{i}]", _CONTAINER_KEYS)
        if container.get("name") != ENGINE_CONTAINER:
            raise OverlayError(
                f"{where}[{i}].name must be {ENGINE_CONTAINER!r}: only the engine container can be "
                "extended (no sidecars); its command, args, image, ports, probes and resources are "
                "the operator's"
            )
        _check_env(container.get("env", []), f"{where}[{i}].env")
        _check_env_from(container.get("envFrom", []), f"{where}[{i}].envFrom")
        _check_mounts(container.get("volumeMounts", []), f"{where}[{i}].volumeMounts")


def _check_env(raw: Any, where: str) -> None:
    for i, item in enumerate(_list(raw, where)):
        var = _mapping(item, f"{where}[{i}]", ("name", "value", "valueFrom"))
        name = var.get("name")
        if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
            raise OverlayError(f"{where}[{i}].name {name!r} is not an environment variable name")
        if name in OPERATOR_ENV or name in operator_variables():
            raise OverlayError(
                f"{where}[{i}].name {name} is set by the operator from the spec; set that field"
            )
        problem = env_problem(name)
        if problem is not None:
            raise OverlayError(f"{where}[{i}].name {name} {problem}")
        if ("value" in var) == ("valueFrom" in var):
            raise OverlayError(f"{where}[{i}] ({name}) needs exactly one of value and valueFrom")
        if "value" in var and not isinstance(var["value"], str):
            raise OverlayError(f"{where}[{i}].value ({name}) must be a string")
        if "valueFrom" in var:
            source = _mapping(
                var["valueFrom"],
                f"{where}[{i}].valueFrom",
                ("secretKeyRef", "configMapKeyRef", "fieldRef", "resourceFieldRef"),
            )
            if len(source) != 1:
                raise OverlayError(f"{where}[{i}].valueFrom ({name}) needs exactly one source")
            for kind in ("secretKeyRef", "configMapKeyRef"):
                if kind in source:
                    ref = _mapping(
                        source[kind], f"{where}[{i}].valueFrom.{kind}", ("name", "key", "optional")
                    )
                    _name(ref.get("name"), f"{where}[{i}].valueFrom.{kind}.name")
                    if not isinstance(ref.get("key"), str) or not ref["key"]:
                        raise OverlayError(f"{where}[{i}].valueFrom.{kind}.key is required")


def _check_env_from(raw: Any, where: str) -> None:
    for i, item in enumerate(_list(raw, where)):
        source = _mapping(item, f"{where}[{i}]", ("prefix", "configMapRef", "secretRef"))
        refs = [kind for kind in ("configMapRef", "secretRef") if kind in source]
        if len(refs) != 1:
            raise OverlayError(f"{where}[{i}] needs exactly one of configMapRef and secretRef")
        ref = _mapping(source[refs[0]], f"{where}[{i}].{refs[0]}", ("name", "optional"))
        _name(ref.get("name"), f"{where}[{i}].{refs[0]}.name")
        prefix = source.get("prefix", "")
        if not isinstance(prefix, str) or (prefix and not _ENV_NAME.fullmatch(prefix)):
            raise OverlayError(f"{where}[{i}].prefix {prefix!r} is not the start of a variable name")
        problem = env_prefix_problem(prefix)
        if problem is not None:
            raise OverlayError(f"{where}[{i}] ({refs[0]} {ref['name']}): prefix {prefix!r} {problem}")


def _check_mounts(raw: Any, where: str) -> None:
    seen: list[str] = []
    for i, item in enumerate(_list(raw, where)):
        mount = _mapping(item, f"{where}[{i}]", _MOUNT_KEYS)
        path = mount.get("mountPath")
        if not isinstance(path, str) or not path.startswith("/"):
            raise OverlayError(f"{where}[{i}].mountPath {path!r} must be an absolute path")
        if any(path == p or path.startswith(p + "/") for p in OPERATOR_MOUNT_PATHS):
            raise OverlayError(f"{where}[{i}].mountPath {path} is inside a volume the operator mounts")
        problem = mount_path_problem(path)
        if problem is not None:
            raise OverlayError(f"{where}[{i}].mountPath {path!r} {problem}")
        nested = next((p for p in seen if _inside(path, p) or _inside(p, path)), None)
        if nested is not None:
            # A volume's own content (a symlink) could steer the mount inside it anywhere in the image.
            raise OverlayError(f"{where}[{i}].mountPath {path} nests with {nested}; mount side by side")
        seen.append(path)
        _name(mount.get("name"), f"{where}[{i}].name", _DNS_LABEL)
        sub_path = mount.get("subPath", "")
        if not isinstance(sub_path, str) or sub_path.startswith("/") or ".." in sub_path.split("/"):
            raise OverlayError(f"{where}[{i}].subPath {sub_path!r} must be a relative path without '..'")


def mount_path_problem(path: str) -> str | None:
    """Why a podTemplate volume may not be mounted at `path`; None when it may (under MOUNT_PREFIXES)."""
    parts = path.split("/")[1:]
    if not all(parts) or any(part in (".", "..") for part in parts):
        return "must be a plain absolute path (no empty, '.' or '..' parts, no trailing '/')"
    if not any(path.startswith(prefix + "/") for prefix in MOUNT_PREFIXES):
        return (
            f"is outside {' and '.join(p + '/' for p in MOUNT_PREFIXES)}: a volume elsewhere could replace "
            "the engine's code or the system's files; mount it there (e.g. /mnt/certs) and point the engine "
            "at it"
        )
    return None


def _inside(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent + "/")


def _check_volumes(raw: Any, where: str) -> None:
    for i, item in enumerate(_list(raw, where)):
        volume = _mapping(item, f"{where}[{i}]")
        name = _name(volume.get("name"), f"{where}[{i}].name", _DNS_LABEL)
        if name in OPERATOR_VOLUMES:
            raise OverlayError(f"{where}[{i}].name {name} is a volume the operator defines")
        sources = sorted(set(volume) - {"name"})
        if len(sources) != 1 or sources[0] not in VOLUME_SOURCES:
            raise OverlayError(
                f"{where}[{i}] ({name}) needs exactly one source of {', '.join(sorted(VOLUME_SOURCES))} "
                f"(Pod Security restricted); got {', '.join(sources) or 'none'}"
            )
        source = _mapping(volume[sources[0]], f"{where}[{i}].{sources[0]}")
        if sources[0] == "secret":
            _name(source.get("secretName"), f"{where}[{i}].secret.secretName")
        if sources[0] == "csi":
            # The policy (policy.py) permits drivers by name, so the name must be there to compare.
            _name(source.get("driver"), f"{where}[{i}].csi.driver")
        if sources[0] == "csi" and "nodePublishSecretRef" in source:
            ref = _mapping(
                source["nodePublishSecretRef"], f"{where}[{i}].csi.nodePublishSecretRef", ("name",)
            )
            _name(ref.get("name"), f"{where}[{i}].csi.nodePublishSecretRef.name")
        if sources[0] == "projected":
            for j, item in enumerate(_list(source.get("sources") or [], f"{where}[{i}].projected.sources")):
                at = f"{where}[{i}].projected.sources[{j}]"
                # No serviceAccountToken: the engine gets no API token (workload identity injects its own).
                projection = _mapping(item, at, ("secret", "configMap", "downwardAPI", "clusterTrustBundle"))
                if projection.get("secret") is not None:
                    _name(_mapping(projection["secret"], f"{at}.secret").get("name"), f"{at}.secret.name")


def _check_mounted_volumes_exist(spec: Mapping[str, Any]) -> None:
    volumes = OPERATOR_VOLUMES | {volume["name"] for volume in spec.get("volumes") or []}
    for container in spec.get("containers") or []:
        for i, mount in enumerate(container.get("volumeMounts") or []):
            if mount["name"] not in volumes:
                raise OverlayError(
                    f"{WHERE}.spec.containers[engine].volumeMounts[{i}].name {mount['name']} names no "
                    "volume; add it to spec.podTemplate.spec.volumes"
                )


_SPEC_CHECKS: dict[str, Callable[[Any, str], None]] = {
    "nodeSelector": _check_node_selector,
    "affinity": _check_affinity,
    "tolerations": _check_tolerations,
    "imagePullSecrets": _check_pull_secrets,
    "serviceAccountName": _check_name,
    "securityContext": _check_security_context,
    "priorityClassName": _check_name,
    "runtimeClassName": _check_name,
    "containers": _check_containers,
    "volumes": _check_volumes,
}

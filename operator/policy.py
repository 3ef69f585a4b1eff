"""Which images and Secrets an InferenceDeployment may put into engine pods.

Whoever may create an InferenceDeployment would otherwise choose both the image the operator runs and the
Secrets it mounts into it: a path to any Secret of the namespace, and to any code. So:
- the image must match one of the operator's `allowed_images` globs (default: the project's engine image,
  config.DEFAULT_ALLOWED_IMAGES) unless the admin set `allow_any_image`;
- every Secret the pod reads (the internal token, the store credentials, and the podTemplate's pull
  secrets, env, envFrom, secret, projected and CSI volumes) must be in a namespace labelled
  `loraplex.io/engine-secrets=allowed`, or match one of `allowed_secrets` (`namespace/name` globs). A
  podTemplate ServiceAccount is a credential too (workload-identity webhooks hand the pod its cloud role),
  under the same rule;
- a podTemplate's `runtimeClassName` and the drivers of its `csi` volumes must be in `allowed_runtime_classes`
  and `allowed_csi_drivers` (exact names; none by default): a CSI driver such as the Secrets Store one
  mounts secrets of its own, and a runtime class decides how the pod is isolated.
A refused CR gets no children created or changed; reconcile re-evaluates on every pass, so labelling the
namespace later unblocks it. `violations` is pure; `namespace_labels` is the one read it needs.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping

from loraplex.operator.config import OperatorConfig
from loraplex.operator.kube import KubeClient, KubeError
from loraplex.operator.overlay import SecretReference, secret_references
from loraplex.operator.spec import InferenceDeployment

SECRETS_LABEL = "loraplex.io/engine-secrets"
SECRETS_LABEL_VALUE = "allowed"


def secrets_used(idep: InferenceDeployment) -> list[SecretReference]:
    """Every credential the engine pods get (Secrets, and a ServiceAccount), with the CR field that names
    it (first mention of a name wins)."""
    spec = idep.spec
    found = [SecretReference(spec.internal_token.name, "spec.internalTokenSecretRef")]
    if spec.adapter_store is not None and spec.adapter_store.secret_name:
        found.append(SecretReference(spec.adapter_store.secret_name, "spec.adapterStore.secretRef"))
    found.extend(secret_references(spec.pod_template))
    unique: dict[tuple[str, str], SecretReference] = {}
    for reference in found:
        unique.setdefault((reference.kind, reference.name), reference)
    return list(unique.values())


def image_violation(image: str, config: OperatorConfig) -> str | None:
    if config.allow_any_image or any(fnmatch.fnmatchcase(image, p) for p in config.allowed_images):
        return None
    return (
        f"image {image} (spec.engine.image) matches none of the operator's allowed images "
        f"({', '.join(config.allowed_images)}); an admin adds it to LORAPLEX_OPERATOR_ALLOWED_IMAGES "
        "(chart: operator.policy.allowedImages)"
    )


def secret_allow_listed(namespace: str, name: str, config: OperatorConfig) -> bool:
    return any(fnmatch.fnmatchcase(f"{namespace}/{name}", p) for p in config.allowed_secrets)


def needs_namespace_labels(idep: InferenceDeployment, config: OperatorConfig) -> bool:
    """Whether some Secret is not allow-listed, so the namespace's label decides (saves a read if not)."""
    return any(not secret_allow_listed(idep.namespace, s.name, config) for s in secrets_used(idep))


def pod_violations(idep: InferenceDeployment, config: OperatorConfig) -> list[str]:
    """The podTemplate's runtime class and CSI drivers the admin has not permitted."""
    where = "spec.podTemplate.spec"
    spec = idep.spec.pod_template.spec
    found = []
    runtime = spec.get("runtimeClassName")
    if runtime is not None and runtime not in config.allowed_runtime_classes:
        found.append(
            f"runtime class {runtime} ({where}.runtimeClassName) is not permitted: an admin adds it to "
            "LORAPLEX_OPERATOR_ALLOWED_RUNTIME_CLASSES (chart: operator.policy.allowedRuntimeClasses)"
        )
    for i, volume in enumerate(spec.get("volumes") or []):
        if "csi" not in volume:
            continue
        driver = volume["csi"]["driver"]  # overlay.py checked it is a driver name
        if driver not in config.allowed_csi_drivers:
            found.append(
                f"CSI driver {driver} ({where}.volumes[{i}].csi.driver) is not permitted: an admin adds it "
                "to LORAPLEX_OPERATOR_ALLOWED_CSI_DRIVERS (chart: operator.policy.allowedCsiDrivers)"
            )
    return found


def violations(
    idep: InferenceDeployment, config: OperatorConfig, namespace_labels: Mapping[str, str]
) -> list[str]:
    """Why the CR is refused, one sentence per rule broken; empty when it may run."""
    found = []
    image = image_violation(idep.spec.engine.image, config)
    if image is not None:
        found.append(image)
    found.extend(pod_violations(idep, config))
    if namespace_labels.get(SECRETS_LABEL) == SECRETS_LABEL_VALUE:
        return found
    for secret in secrets_used(idep):
        if not secret_allow_listed(idep.namespace, secret.name, config):
            found.append(
                f"{secret.kind} {idep.namespace}/{secret.name} ({secret.field}) is not permitted: label the "
                f"namespace {SECRETS_LABEL}={SECRETS_LABEL_VALUE}, or an admin adds it to "
                "LORAPLEX_OPERATOR_ALLOWED_SECRETS (chart: operator.policy.allowedSecrets)"
            )
    return found


async def namespace_labels(kube: KubeClient, namespace: str) -> dict[str, str]:
    """The namespace's labels; none when it cannot be found (then only the allow-list permits Secrets)."""
    try:
        found = await kube.get_namespace(namespace)
    except KubeError as error:
        # Typically a 403: the operator's role lacks `get` on namespaces (the chart grants it).
        raise KubeError(
            error.status, f"cannot read Namespace {namespace} for the Secret policy: {error}"
        ) from error
    return dict(((found or {}).get("metadata") or {}).get("labels") or {})


async def check(kube: KubeClient, idep: InferenceDeployment, config: OperatorConfig) -> list[str]:
    labels = await namespace_labels(kube, idep.namespace) if needs_namespace_labels(idep, config) else {}
    return violations(idep, config, labels)

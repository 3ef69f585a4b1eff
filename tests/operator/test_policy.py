"""The Secret and image policy: pure rules, the configuration, and a refused CR against the API emulator
(nothing created or changed, Degraded PolicyViolation, one Warning Event; a namespace label unblocks it)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from loraplex.operator import events, policy
from loraplex.operator.config import DEFAULT_ALLOWED_IMAGES, OperatorConfig
from loraplex.operator.kube import KubeError
from loraplex.operator.main import reconcile
from loraplex.operator.policy import (
    SECRETS_LABEL,
    image_violation,
    needs_namespace_labels,
    secrets_used,
    violations,
)
from loraplex.operator.spec import SpecError, parse
from tests.operator.emulated import Emulated, emulated_cluster, inference_deployment
from tests.operator.helpers import body

pytestmark = pytest.mark.timeout(60)
ALLOWED = {SECRETS_LABEL: "allowed"}


def overlay_with_secrets() -> dict[str, Any]:
    return {
        "spec": {
            "imagePullSecrets": [{"name": "pull"}],
            "serviceAccountName": "engine-identity",
            "containers": [
                {
                    "name": "engine",
                    "env": [
                        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
                    ],
                    "envFrom": [{"prefix": "EXTRA_", "secretRef": {"name": "extra-env"}}],
                    "volumeMounts": [{"name": "certs", "mountPath": "/mnt/certs"}],
                }
            ],
            "volumes": [
                {"name": "certs", "secret": {"secretName": "certs"}},
                {"name": "bundle", "projected": {"sources": [{"secret": {"name": "bundle"}}]}},
                {
                    "name": "vault",
                    "csi": {"driver": "secrets-store.csi.k8s.io", "nodePublishSecretRef": {"name": "csi"}},
                },
            ],
        }
    }


def test_config_reads_the_policy_from_the_environment() -> None:
    config = OperatorConfig.from_env(
        {
            "LORAPLEX_OPERATOR_ALLOWED_IMAGES": "registry.example.com/engine:*, ghcr.io/loraplex/engine:*",
            "LORAPLEX_OPERATOR_ALLOW_ANY_IMAGE": "false",
            "LORAPLEX_OPERATOR_ALLOWED_SECRETS": "loraplex/loraplex-*,*/engine-token",
            "LORAPLEX_OPERATOR_ALLOWED_CSI_DRIVERS": "ebs.csi.aws.com, secrets-store.csi.k8s.io",
            "LORAPLEX_OPERATOR_ALLOWED_RUNTIME_CLASSES": "nvidia",
        }
    )
    assert config.allowed_csi_drivers == ("ebs.csi.aws.com", "secrets-store.csi.k8s.io")
    assert config.allowed_runtime_classes == ("nvidia",)
    assert OperatorConfig.from_env({}).allowed_csi_drivers == ()
    assert config.allowed_images == ("registry.example.com/engine:*", "ghcr.io/loraplex/engine:*")
    assert config.allowed_secrets == ("loraplex/loraplex-*", "*/engine-token")
    assert not config.allow_any_image
    assert OperatorConfig.from_env({"LORAPLEX_OPERATOR_ALLOW_ANY_IMAGE": "TRUE"}).allow_any_image
    # Unset or empty (a chart's empty list): the project's own engine image only.
    assert OperatorConfig.from_env({}).allowed_images == DEFAULT_ALLOWED_IMAGES
    assert (
        OperatorConfig.from_env({"LORAPLEX_OPERATOR_ALLOWED_IMAGES": " "}).allowed_images
        == DEFAULT_ALLOWED_IMAGES
    )
    with pytest.raises(ValueError, match="must be true or false"):
        OperatorConfig.from_env({"LORAPLEX_OPERATOR_ALLOW_ANY_IMAGE": "yes"})
    with pytest.raises(ValueError, match="is not namespace/name"):
        OperatorConfig.from_env({"LORAPLEX_OPERATOR_ALLOWED_SECRETS": "loraplex-secrets"})


def test_default_image_policy_is_the_project_engine_image() -> None:
    config = OperatorConfig()
    assert image_violation("ghcr.io/loraplex/engine:0.1.0", config) is None
    assert image_violation("ghcr.io/loraplex/engine@sha256:" + "a" * 64, config) is None
    for refused in (
        "ghcr.io/loraplex/engine-evil:1",
        "docker.io/someone/engine:0.1.0",
        "ghcr.io/loraplex/engine",
    ):
        message = image_violation(refused, config)
        assert message is not None and refused in message and "LORAPLEX_OPERATOR_ALLOWED_IMAGES" in message
    assert image_violation("docker.io/someone/engine:1", OperatorConfig(allow_any_image=True)) is None
    # A glob's `*` matches `/` too: the spec's reference grammar (a tag has no `/`, nothing follows a digest)
    # is what keeps `ghcr.io/loraplex/engine:*` from matching another repository.
    for sneaky in ("ghcr.io/loraplex/engine:5000/evil/engine:1", "ghcr.io/loraplex/engine:1 evil/x"):
        assert image_violation(sneaky, config) is None  # the glob alone would let it through...
        with pytest.raises(SpecError, match="is not an image reference"):
            parse(body(engine={"image": sneaky}))  # ...the spec never gets that far
    listed = OperatorConfig(allowed_images=("registry.example.com/*",))
    assert image_violation("registry.example.com/team/engine:2", listed) is None
    assert image_violation("ghcr.io/loraplex/engine:0.1.0", listed) is not None


def test_every_secret_the_pod_reads_is_checked() -> None:
    idep = parse(body(podTemplate=overlay_with_secrets()))
    used = {s.name: s.field for s in secrets_used(idep)}
    assert {s.name: s.kind for s in secrets_used(idep) if s.kind != "Secret"} == {
        "engine-identity": "ServiceAccount"
    }
    assert used == {
        "engine-identity": "spec.podTemplate.spec.serviceAccountName",
        "csi": "spec.podTemplate.spec.volumes[2].csi.nodePublishSecretRef",
        "loraplex-secrets": "spec.internalTokenSecretRef",
        "loraplex-adapter-store": "spec.adapterStore.secretRef",
        "pull": "spec.podTemplate.spec.imagePullSecrets[0]",
        "hf": "spec.podTemplate.spec.containers[engine].env[0]",
        "extra-env": "spec.podTemplate.spec.containers[engine].envFrom[0]",
        "certs": "spec.podTemplate.spec.volumes[0].secret",
        "bundle": "spec.podTemplate.spec.volumes[1].projected.sources[0]",
    }
    # The CSI driver is permitted here: only the Secret rule is under test.
    config = OperatorConfig(allowed_csi_drivers=("secrets-store.csi.k8s.io",))
    found = violations(idep, config, {})
    assert len(found) == len(used)
    assert any("Secret loraplex/hf (spec.podTemplate.spec.containers[engine].env[0])" in v for v in found)
    assert any(
        "ServiceAccount loraplex/engine-identity (spec.podTemplate.spec.serviceAccountName)" in v
        for v in found
    )
    assert violations(idep, config, ALLOWED) == []
    assert violations(idep, config, {SECRETS_LABEL: "yes"}) == found  # only the exact value


def test_the_allow_list_permits_by_namespace_and_name() -> None:
    idep = parse(body())  # namespace loraplex; loraplex-secrets and loraplex-adapter-store
    config = OperatorConfig(allowed_secrets=("loraplex/loraplex-s*",))
    remaining = violations(idep, config, {})
    assert len(remaining) == 1 and "loraplex/loraplex-adapter-store" in remaining[0]
    assert needs_namespace_labels(idep, config)
    everything = OperatorConfig(allowed_secrets=("loraplex/*",))
    assert violations(idep, everything, {}) == []
    assert not needs_namespace_labels(idep, everything)  # no Namespace read needed
    assert len(violations(idep, OperatorConfig(allowed_secrets=("other/*",)), {})) == 2


def test_image_and_secret_violations_add_up() -> None:
    idep = parse(body(engine={"image": "docker.io/someone/engine:1"}))
    found = violations(idep, OperatorConfig(), {})
    assert len(found) == 3 and "docker.io/someone/engine:1" in found[0]


# --- against the API emulator ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def emulated() -> Iterator[Emulated]:
    with emulated_cluster(engines=1) as emulated:
        yield emulated


def reconcile_live(emulated: Emulated, name: str, config: OperatorConfig) -> dict[str, Any]:
    live = emulated.cluster.get("InferenceDeployment", name)
    assert live is not None
    return asyncio.run(reconcile(emulated.kube, live, config))


def conditions(emulated: Emulated, name: str) -> dict[str, dict[str, Any]]:
    live = emulated.cluster.get("InferenceDeployment", name) or {}
    return {c["type"]: c for c in (live.get("status") or {}).get("conditions") or []}


def test_a_refused_cr_gets_no_children_a_condition_and_an_event(emulated: Emulated) -> None:
    cluster = emulated.cluster
    cluster.create(inference_deployment("guarded"))
    status = reconcile_live(emulated, "guarded", OperatorConfig())
    assert status["phase"] == "Degraded"
    for kind in ("Deployment", "Service", "ConfigMap", "PodDisruptionBudget"):
        assert cluster.get(kind, "guarded-engine") is None, kind
    degraded = conditions(emulated, "guarded")["Degraded"]
    assert (degraded["status"], degraded["reason"]) == ("True", "PolicyViolation")
    assert (
        "Secret default/loraplex-secrets (spec.internalTokenSecretRef) is not permitted"
        in degraded["message"]
    )
    assert f"label the namespace {SECRETS_LABEL}=allowed" in degraded["message"]
    assert conditions(emulated, "guarded")["Ready"]["reason"] == "PolicyViolation"
    warnings = emulated.events("guarded")
    assert [(e["type"], e["reason"]) for e in warnings] == [(events.WARNING, events.POLICY_VIOLATION)]
    assert warnings[0]["message"] == degraded["message"]
    assert (
        warnings[0]["involvedObject"]["uid"]
        == cluster.get("InferenceDeployment", "guarded")["metadata"]["uid"]
    )

    # Re-evaluated on every pass; the same refusal is not announced again.
    reconcile_live(emulated, "guarded", OperatorConfig())
    assert cluster.get("Deployment", "guarded-engine") is None
    assert [e.get("count", 1) for e in emulated.events("guarded")] == [1]

    # The namespace label added later unblocks it.
    emulated.label_namespace({SECRETS_LABEL: "allowed"})
    status = reconcile_live(emulated, "guarded", OperatorConfig())
    assert cluster.get("Deployment", "guarded-engine") is not None
    assert conditions(emulated, "guarded")["Degraded"]["reason"] != "PolicyViolation"


def test_a_refused_image_leaves_the_running_deployment_untouched(emulated: Emulated) -> None:
    cluster = emulated.cluster
    config = OperatorConfig(allowed_secrets=("default/*",))
    cluster.create(inference_deployment("imaged"))
    reconcile_live(emulated, "imaged", config)
    before = cluster.get("Deployment", "imaged-engine")
    assert before is not None
    cluster.patch(
        "InferenceDeployment", "imaged", {"spec": {"engine": {"image": "docker.io/someone/engine:1"}}}
    )
    reconcile_live(emulated, "imaged", config)
    after = cluster.get("Deployment", "imaged-engine")
    assert after is not None
    assert after["spec"] == before["spec"]
    assert after["metadata"]["annotations"] == before["metadata"]["annotations"]
    degraded = conditions(emulated, "imaged")["Degraded"]
    assert (
        degraded["reason"] == "PolicyViolation" and "image docker.io/someone/engine:1" in degraded["message"]
    )
    assert [e["reason"] for e in emulated.events("imaged") if e["type"] == events.WARNING] == [
        events.POLICY_VIOLATION
    ]
    # An admin who opts out of the image policy unblocks it.
    reconcile_live(emulated, "imaged", OperatorConfig(allowed_secrets=("default/*",), allow_any_image=True))
    container = cluster.get("Deployment", "imaged-engine")["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "docker.io/someone/engine:1"


def test_a_namespace_the_operator_may_not_read_is_named_in_the_error() -> None:
    class Forbidden:
        async def get_namespace(self, name: str) -> dict[str, Any] | None:
            raise KubeError(403, f'namespaces "{name}" is forbidden')

    idep = parse(body())
    with pytest.raises(
        KubeError, match=r"cannot read Namespace loraplex for the Secret policy: .*403"
    ) as raised:
        asyncio.run(policy.check(Forbidden(), idep, OperatorConfig()))  # type: ignore[arg-type]
    assert raised.value.status == 403
    # Nothing to read when the allow-list covers every Secret.
    assert asyncio.run(policy.check(Forbidden(), idep, OperatorConfig(allowed_secrets=("loraplex/*",)))) == []  # type: ignore[arg-type]

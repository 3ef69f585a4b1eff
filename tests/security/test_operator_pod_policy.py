"""Whoever may create an InferenceDeployment cannot run other code in an allowed engine image, read secrets
the Secret policy never saw, or send the engine's traffic elsewhere.

Each case is a podTemplate or extraArgs that the operator accepted before (issue 29, item 5): an allowed
image with `PYTHONPATH` or `LD_PRELOAD` pointed at a ConfigMap volume, or a ConfigMap mounted over the
installed package, runs the CR author's code next to the internal token; a Secrets Store CSI volume mounts
a vault's secrets; `HTTPS_PROXY`, `AWS_ENDPOINT_URL_S3` and `HF_ENDPOINT` redirect the engine's traffic;
any runtime class was taken; `--por 9000` reached the engine, whose parser read it as `--port 9000`.
Spec refusals (SpecError) become the InvalidSpec condition, policy refusals the PolicyViolation one
(operator/main.py reconcile), each with a Warning Event.
"""

from __future__ import annotations

from typing import Any

import pytest

from loraplex.cli.main import build_parser
from loraplex.operator.config import OperatorConfig
from loraplex.operator.policy import violations
from loraplex.operator.spec import SpecError, parse
from tests.operator.helpers import body

ALLOWED_NAMESPACE = {"loraplex.io/engine-secrets": "allowed"}  # every Secret permitted: not under test
PACKAGE = "/opt/loraplex/lib/python3.12/site-packages/loraplex"


def engine(
    env: list[dict[str, Any]] | None = None,
    mounts: list[dict[str, Any]] | None = None,
    volumes: list[dict[str, Any]] | None = None,
    env_from: list[dict[str, Any]] | None = None,
    **spec: Any,
) -> dict[str, Any]:
    container: dict[str, Any] = {"name": "engine", "env": env or [], "volumeMounts": mounts or []}
    if env_from is not None:
        container["envFrom"] = env_from
    return {"spec": {"containers": [container], "volumes": volumes or [], **spec}}


def code_volume(mount_path: str) -> dict[str, Any]:
    return {
        "mounts": [{"name": "code", "mountPath": mount_path}],
        "volumes": [{"name": "code", "configMap": {"name": "payload", "defaultMode": 0o755}}],
    }


def variable(name: str, value: str = "x") -> list[dict[str, Any]]:
    return [{"name": name, "value": value}]


# (id, podTemplate, words the refusal must contain)
SPEC_BYPASSES = [
    ("pythonpath", engine(env=variable("PYTHONPATH", "/mnt/code"), **code_volume("/mnt/code")), "PYTHONPATH"),
    (
        "ld-preload",
        engine(env=variable("LD_PRELOAD", "/mnt/code/x.so"), **code_volume("/mnt/code")),
        "LD_PRELOAD",
    ),
    ("over-the-package", engine(**code_volume(PACKAGE)), "is outside /mnt/ and /data/"),
    ("over-a-system-path", engine(**code_volume("/etc/ld.so.preload")), "is outside /mnt/ and /data/"),
    ("dot-dot", engine(**code_volume("/mnt/../opt/loraplex")), "plain absolute path"),
    ("https-proxy", engine(env=variable("HTTPS_PROXY", "http://attacker:3128")), "through a proxy"),
    ("https-proxy-lowercase", engine(env=variable("https_proxy", "http://attacker:3128")), "through a proxy"),
    (
        "aws-endpoint",
        engine(env=variable("AWS_ENDPOINT_URL_S3", "http://attacker")),
        "store traffic elsewhere",
    ),
    (
        "aws-endpoint-any",
        engine(env=variable("AWS_ENDPOINT_URL", "http://attacker")),
        "store traffic elsewhere",
    ),
    ("aws-config-file", engine(env=variable("AWS_CONFIG_FILE", "/mnt/code/config")), "AWS_CONFIG_FILE"),
    ("hf-endpoint", engine(env=variable("HF_ENDPOINT", "http://attacker")), "HF_ENDPOINT"),
    ("path", engine(env=variable("PATH", "/mnt/code:/usr/bin"), **code_volume("/mnt/code")), "PATH"),
    (
        "triton-cache",
        engine(env=variable("TRITON_CACHE_DIR", "/mnt/code"), **code_volume("/mnt/code")),
        "TRITON",
    ),
    ("tmpdir", engine(env=variable("TMPDIR", "/mnt/code"), **code_volume("/mnt/code")), "TMPDIR"),
    (
        "operator-option-as-variable",
        engine(env=variable("LORAPLEX_HOST", "127.0.0.1")),
        "set by the operator",
    ),
    ("unknown-loraplex-variable", engine(env=variable("LORAPLEX_NOT_AN_OPTION")), "not a variable"),
    (
        "env-from-without-prefix",
        engine(env_from=[{"configMapRef": {"name": "has-a-pythonpath-key"}}]),
        "give a prefix",
    ),
    (
        "env-from-with-a-guarded-prefix",
        engine(env_from=[{"prefix": "PYTHON", "configMapRef": {"name": "has-a-path-key"}}]),
        "PYTHON",
    ),
    (
        "nested-mounts",
        engine(
            mounts=[{"name": "a", "mountPath": "/mnt/a"}, {"name": "b", "mountPath": "/mnt/a/link"}],
            volumes=[
                {"name": "a", "persistentVolumeClaim": {"claimName": "has-a-symlink"}},
                {"name": "b", "configMap": {"name": "payload"}},
            ],
        ),
        "nests with /mnt/a",
    ),
]

EXTRA_ARGS_BYPASSES = [
    ("abbreviated-port", ["--por", "9000"], "unrecognized arguments: --por"),
    ("abbreviated-port-equals", ["--po=9000"], "unrecognized arguments: --po=9000"),
    ("abbreviated-model", ["--mod", "/mnt/other"], "unrecognized arguments: --mod"),
    ("old-name-of-an-operator-option", ["--pool-fraction", "0.5"], "sets --gpu-memory-fraction"),
    ("store-redirect", ["--s3-endpoint-url", "http://attacker"], "sets --s3-endpoint-url"),
    ("listen-elsewhere", ["--host=127.0.0.1"], "sets --host"),
    ("expanded-by-the-kubelet", ["--served-model-name", "$(SNEAKY)"], "contains $(...)"),
    ("a-value-the-engine-refuses", ["--max-num-seqs", "0"], "max_num_seqs"),
    ("help-stops-the-engine", ["--help"], "unrecognized arguments: --help"),
]


@pytest.mark.parametrize(
    ("overlay", "words"), [c[1:] for c in SPEC_BYPASSES], ids=[c[0] for c in SPEC_BYPASSES]
)
def test_pod_template_bypasses_are_invalid_specs(overlay: dict[str, Any], words: str) -> None:
    with pytest.raises(SpecError) as refused:
        parse(body(podTemplate=overlay))
    assert words in str(refused.value)
    assert "spec.podTemplate.spec" in str(refused.value)  # the refusal names the field


@pytest.mark.parametrize(
    ("extra", "words"), [c[1:] for c in EXTRA_ARGS_BYPASSES], ids=[c[0] for c in EXTRA_ARGS_BYPASSES]
)
def test_extra_args_are_read_as_the_engine_reads_them(extra: list[str], words: str) -> None:
    with pytest.raises(SpecError) as refused:
        parse(body(engine={"image": "ghcr.io/loraplex/engine:0.2.0", "extraArgs": extra}))
    assert words in str(refused.value) and "spec.engine.extraArgs" in str(refused.value)


def test_the_engine_itself_takes_no_abbreviation() -> None:
    """What the operator refuses, the engine refuses too (an older operator, or a pod made by hand)."""
    args, unknown = build_parser().parse_known_args(["serve", "--model", "/m", "--por", "9000"])
    assert args.port is None and unknown == ["--por", "9000"]


@pytest.mark.parametrize(
    ("overlay", "words"),
    [
        (
            engine(
                mounts=[{"name": "vault", "mountPath": "/mnt/vault"}],
                volumes=[{"name": "vault", "csi": {"driver": "secrets-store.csi.k8s.io", "readOnly": True}}],
            ),
            "CSI driver secrets-store.csi.k8s.io (spec.podTemplate.spec.volumes[0].csi.driver) is not",
        ),
        (engine(runtimeClassName="runc-unconfined"), "runtime class runc-unconfined"),
    ],
    ids=["secrets-store-csi", "runtime-class"],
)
def test_csi_drivers_and_runtime_classes_need_the_admins_allow_list(
    overlay: dict[str, Any], words: str
) -> None:
    idep = parse(body(podTemplate=overlay))
    refused = violations(idep, OperatorConfig(), ALLOWED_NAMESPACE)
    assert len(refused) == 1 and words in refused[0]
    permitted = OperatorConfig(
        allowed_csi_drivers=("secrets-store.csi.k8s.io",), allowed_runtime_classes=("runc-unconfined",)
    )
    assert violations(idep, permitted, ALLOWED_NAMESPACE) == []


def test_what_a_cluster_needs_still_passes() -> None:
    """The policy refuses the bypasses, not the uses: a token for gated models, thread counts, a CA bundle
    under /mnt, an engine option, settings imported under a prefix."""
    overlay = engine(
        env=[
            {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
            {"name": "HF_HUB_OFFLINE", "value": "1"},
            {"name": "OMP_NUM_THREADS", "value": "8"},
            {"name": "SSL_CERT_FILE", "value": "/mnt/certs/ca.pem"},
            {"name": "LORAPLEX_MAX_NUM_SEQS", "value": "32"},
        ],
        env_from=[{"prefix": "APP_", "configMapRef": {"name": "app-settings"}}],
        mounts=[
            {"name": "certs", "mountPath": "/mnt/certs", "readOnly": True},
            {"name": "models", "mountPath": "/data/models", "readOnly": True},
        ],
        volumes=[
            {"name": "certs", "configMap": {"name": "ca-bundle"}},
            {"name": "models", "persistentVolumeClaim": {"claimName": "models"}},
        ],
    )
    idep = parse(
        body(
            podTemplate=overlay,
            engine={"image": "ghcr.io/loraplex/engine:0.2.0", "extraArgs": ["--max-num-seqs", "32"]},
        )
    )
    assert violations(idep, OperatorConfig(), ALLOWED_NAMESPACE) == []

"""The Helm chart: CRDs in sync with crds/, lint clean, renders, and every rendered object validates."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from loraplex.operator.generate_chart_crds import expected
from tests.operator.helpers import KUBE_VERSION, ROOT, crd

CHART = ROOT / "charts" / "loraplex"
VALUE_FILES = {"default": None, "gpu": CHART / "values-gpu.yaml"}


def render(values: dict[str, Any] | None) -> list[dict[str, Any]]:
    manifests = helm.Chart.load(CHART).render(values, name="loraplex", namespace="loraplex", is_install=True)
    return [doc for text in manifests.values() for doc in yaml.safe_load_all(text) if doc]


def values(name: str) -> dict[str, Any] | None:
    path: Path | None = VALUE_FILES[name]
    return None if path is None else yaml.safe_load(path.read_text())


def test_chart_crds_are_generated_from_crds() -> None:
    for path, text in expected().items():
        assert path.exists(), f"{path} missing: run python -m loraplex.operator.generate_chart_crds"
        assert path.read_text() == text, (
            f"{path} is stale: run python -m loraplex.operator.generate_chart_crds"
        )


@pytest.mark.parametrize("name", sorted(VALUE_FILES))
def test_chart_lints_clean(name: str) -> None:
    report = helm.lint(CHART, values(name), strict=True, namespace="loraplex")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not report["errors"] and not problems, report


@pytest.mark.parametrize("name", sorted(VALUE_FILES))
def test_every_rendered_object_validates_strictly(name: str) -> None:
    objects = render(values(name))
    kinds = {obj["kind"] for obj in objects}
    assert kinds >= {
        "CustomResourceDefinition",
        "Deployment",
        "ServiceAccount",
        "ClusterRole",
        "Job",
        "Service",
    }
    for obj in objects:
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


def test_rendered_crd_equals_the_source_and_is_kept() -> None:
    rendered = next(obj for obj in render(None) if obj["kind"] == "CustomResourceDefinition")
    assert rendered["spec"] == crd()["spec"]
    assert rendered["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    unkept = next(o for o in render({"crds": {"keep": False}}) if o["kind"] == "CustomResourceDefinition")
    assert "helm.sh/resource-policy" not in unkept["metadata"]["annotations"]
    assert all(o["kind"] != "CustomResourceDefinition" for o in render({"crds": {"enabled": False}}))


def test_gpu_values_expose_the_control_plane_and_scope_the_operator() -> None:
    objects = render(values("gpu"))
    ingress = next(o for o in objects if o["kind"] == "Ingress")
    assert ingress["spec"]["tls"][0]["secretName"] == "llm-example-com-tls"
    operator = next(
        o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("operator")
    )
    assert operator["spec"]["template"]["spec"]["containers"][0]["args"] == ["--namespace=loraplex"]
    assert all(o["kind"] != "Secret" for o in objects)  # the database URL comes from the existing Secret
    migrate = next(o for o in objects if o["kind"] == "Job")
    assert migrate["spec"]["template"]["spec"]["containers"][0]["command"] == ["alembic", "upgrade", "head"]


def test_operator_rbac_is_least_privilege() -> None:
    role = next(o for o in render(None) if o["kind"] == "ClusterRole")
    resources = {res for rule in role["rules"] for res in rule["resources"]}
    assert "secrets" not in resources and "*" not in resources
    assert all("*" not in rule["verbs"] for rule in role["rules"])
    pods = next(rule for rule in role["rules"] if rule["resources"] == ["pods"])
    assert pods["verbs"] == ["list"]


def test_values_schema_rejects_a_typo() -> None:
    chart = helm.Chart.load(CHART)
    with pytest.raises(helm.HelmError):
        chart.validate_schema({"operator": {"logLevl": "debug"}})
    with pytest.raises(helm.HelmError):
        chart.validate_schema({"web": {"replicas": -1}})
    chart.validate_schema(values("gpu"))

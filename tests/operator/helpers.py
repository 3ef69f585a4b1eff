"""Shared bits of the operator tests: the CRD, the examples, bodies to start from."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "crds" / "inferencedeployment.yaml"
EXAMPLES = sorted((ROOT / "crds" / "examples").glob("*.yaml"))
# kubernetes-validate ships schemas per Kubernetes minor; this one is current and carries strict variants.
KUBE_VERSION = "1.33"


def load_yaml(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def crd() -> dict[str, Any]:
    return load_yaml(CRD_PATH)


def crd_schema() -> dict[str, Any]:
    return crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def example(name: str) -> dict[str, Any]:
    return load_yaml(ROOT / "crds" / "examples" / name)


def body(name: str = "gpu.yaml", uid: str = "uid-1", generation: int = 1, **spec: Any) -> dict[str, Any]:
    """An example CR as an API server would hand it over: with uid and generation."""
    result = copy.deepcopy(example(name))
    result["metadata"].update(uid=uid, generation=generation)
    result["spec"].update(spec)
    return result

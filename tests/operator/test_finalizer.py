"""No finalizer on InferenceDeployments: deleting one never waits for the operator.

The operator runs as its own process (tests/operator/processes.py) so that it can be stopped for real; the
API emulator collects children by owner reference, as Kubernetes' garbage collector does.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import kopf
import pytest

from loraplex.operator.main import autoscale, resync
from tests.operator.cluster import Cluster, wait_for
from tests.operator.emulated import running_cluster
from tests.operator.helpers import example
from tests.operator.processes import OperatorProcess

pytestmark = pytest.mark.timeout(180)
CHILD_KINDS = ("Deployment", "Service", "ConfigMap", "PodDisruptionBudget")
LEGACY_FINALIZER = "loraplex.dev/operator"


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    with running_cluster(engines=2) as fake:
        yield fake


def inference_deployment(name: str, **metadata: Any) -> dict[str, Any]:
    body = copy.deepcopy(example("gpu.yaml"))
    body["metadata"] = {"name": name, "namespace": "default", **metadata}
    body["spec"]["autoscaling"] = {"mode": "off"}
    return body


def finalizers(cluster: Cluster, name: str) -> list[str]:
    return list((cluster.get("InferenceDeployment", name) or {}).get("metadata", {}).get("finalizers") or [])


def test_kopf_registers_our_daemons_without_a_finalizer() -> None:
    """The registry patch in main.py took (it touches kopf internals: a kopf release may move them)."""
    daemons = [
        h for h in kopf.get_default_registry()._spawning.get_all_handlers() if h.fn in (resync, autoscale)
    ]
    assert len(daemons) == 2
    assert all(handler.requires_finalizer is False for handler in daemons)


def test_a_deployment_deleted_with_the_operator_stopped_goes_at_once(
    cluster: Cluster, tmp_path: Path
) -> None:
    operator = OperatorProcess(cluster, tmp_path, "operator-a", peering=False)
    try:
        cluster.create(inference_deployment("llama"))
        # An object from an earlier version still carries kopf's finalizer: the operator takes it off.
        cluster.create(inference_deployment("legacy", finalizers=[LEGACY_FINALIZER]))
        for child in ("llama-engine", "legacy-engine"):
            wait_for(partial(cluster.get, "Deployment", child), what=f"Deployment {child}")
        wait_for(lambda: not finalizers(cluster, "legacy"), what="the legacy finalizer removed")
        assert finalizers(cluster, "llama") == []
        # Deleted while the operator runs: its daemons notice and end (nothing re-creates the children).
        cluster.delete("InferenceDeployment", "legacy")
        operator.wait_for_log("default/legacy is gone: its daemon stops")
    finally:
        assert operator.stop() == 0, operator.log()[-4000:]
    assert "did not exit in time" not in operator.log()
    assert cluster.get("Deployment", "legacy-engine") is None
    cluster.delete("InferenceDeployment", "llama")
    # No operator, no finalizer: the API server deletes at once and collects the children.
    assert cluster.get("InferenceDeployment", "llama") is None
    for kind in CHILD_KINDS:
        assert cluster.get(kind, "llama-engine") is None, kind


def test_a_finalizer_left_by_an_old_operator_would_block_the_delete(cluster: Cluster) -> None:
    """The counter-check: the emulator does honour finalizers, so the test above proves something."""
    cluster.create(inference_deployment("stuck", finalizers=[LEGACY_FINALIZER]))
    cluster.delete("InferenceDeployment", "stuck")
    stuck = cluster.get("InferenceDeployment", "stuck")
    assert stuck is not None and stuck["metadata"].get("deletionTimestamp")
    # The documented way out when no operator will ever run again: take the finalizer off by hand.
    cluster.patch("InferenceDeployment", "stuck", {"metadata": {"finalizers": None}})
    wait_for(lambda: cluster.get("InferenceDeployment", "stuck") is None, what="the released object gone")

"""Two operator processes, peered as the chart runs them: one works, the other waits; kill the worker and
the other takes over. Who did what is read from the API emulator's calls, by each process's token."""

from __future__ import annotations

import copy
import signal
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import kopf
import pytest

from loraplex.operator import peering
from tests.operator.cluster import Cluster, wait_for
from tests.operator.emulated import running_cluster
from tests.operator.helpers import example
from tests.operator.processes import PEERING, OperatorProcess
from tests.operator.rbac import ungranted
from tests.operator.test_chart import render

pytestmark = pytest.mark.timeout(240)
PEERING_WRITES = {("kopf.dev", "clusterkopfpeerings", "create"), ("kopf.dev", "clusterkopfpeerings", "patch")}


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    with running_cluster(engines=2) as fake:
        yield fake


def inference_deployment(name: str) -> dict[str, Any]:
    body = copy.deepcopy(example("gpu.yaml"))
    body["metadata"] = {"name": name, "namespace": "default"}
    body["spec"]["autoscaling"] = {"mode": "off"}
    return body


def writes(cluster: Cluster, token: str) -> set[tuple[str, str, str]]:
    return {call for call in cluster.api.calls.get(token, set()) if call[2] in ("create", "patch", "delete")}


def peers(cluster: Cluster) -> dict[str, dict[str, Any]]:
    return dict((cluster.get("ClusterKopfPeering", PEERING) or {}).get("status") or {})


def test_one_of_two_operators_works_and_the_other_takes_over_when_it_dies(
    cluster: Cluster, tmp_path: Path
) -> None:
    operators = {name: OperatorProcess(cluster, tmp_path, name) for name in ("operator-a", "operator-b")}
    try:
        # Both keep-alives land in the one ClusterKopfPeering (the first process to start creates it).
        wait_for(lambda: len(peers(cluster)) == 2, what="both operators peered")
        both = peers(cluster)
        priorities = {name: int(both[name]["priority"]) for name in operators}
        assert len(set(priorities.values())) == 2, priorities  # drawn at random, so one outranks the other
        active, standby = sorted(operators, key=priorities.__getitem__, reverse=True)
        # The standby has seen the active one (or never looked before it was in the peering object).
        operators[active].wait_for_peering_state("active")
        operators[standby].wait_for_peering_state("paused", "waiting")

        cluster.create(inference_deployment("first"))
        wait_for(partial(cluster.get, "Deployment", "first-engine"), what="first's Deployment")
        wait_for(
            lambda: "status" in (cluster.get("InferenceDeployment", "first") or {}), what="first's status"
        )
        assert ("apps", "deployments", "create") in writes(cluster, active)
        assert writes(cluster, standby) <= PEERING_WRITES, "the paused operator wrote something"

        # A crash, not a clean exit: the standby waits for the active one's keep-alive to run out (3 s).
        operators[active].stop(signal.SIGKILL)
        operators[standby].wait_for_peering_state("active")
        cluster.create(inference_deployment("second"))
        wait_for(partial(cluster.get, "Deployment", "second-engine"), timeout=60, what="second's Deployment")
        assert ("apps", "deployments", "create") in writes(cluster, standby)
        # The survivor also cleans the dead peer out of the peering object.
        wait_for(lambda: set(peers(cluster)) == {standby}, what="the dead operator's keep-alive removed")
    finally:
        for process in operators.values():
            process.stop()
    # Whatever either process did, the chart's RBAC allows.
    for name in operators:
        assert ungranted(cluster.api.calls[name], render(None), peering=PEERING) == [], name


def test_a_clean_exit_hands_over_at_once(cluster: Cluster, tmp_path: Path) -> None:
    """SIGTERM (a rolling update, a drain): the leaving operator withdraws its keep-alive, so the standby
    resumes without waiting for the lifetime to pass (a long one here, 600 s, would fail the test)."""
    slow = {"LORAPLEX_OPERATOR_PEERING_LIFETIME_SECONDS": "600"}
    operators = {
        name: OperatorProcess(cluster, tmp_path, name, env=slow) for name in ("operator-a", "operator-b")
    }
    try:
        wait_for(lambda: len(peers(cluster)) == 2, what="both operators peered")
        both = peers(cluster)
        active, standby = sorted(operators, key=lambda name: int(both[name]["priority"]), reverse=True)
        operators[active].wait_for_peering_state("active")
        operators[standby].wait_for_peering_state("paused", "waiting")
        assert operators[active].stop(signal.SIGTERM) == 0
        operators[standby].wait_for_peering_state("active", timeout=30)
        cluster.create(inference_deployment("third"))
        wait_for(partial(cluster.get, "Deployment", "third-engine"), what="third's Deployment")
        assert ("apps", "deployments", "create") in writes(cluster, standby)
    finally:
        for process in operators.values():
            process.stop()


def test_peering_is_cluster_wide_with_a_drawn_priority_only_when_asked_for() -> None:
    asked = kopf.OperatorSettings()
    asked.peering.mandatory, asked.peering.name = True, PEERING  # what `kopf run --peering=NAME` sets
    assert peering.configure(asked, lifetime_seconds=7.4)
    assert asked.peering.clusterwide and asked.peering.lifetime == 7
    low, high = peering.PRIORITY_RANGE
    assert low <= asked.peering.priority <= high
    given = kopf.OperatorSettings()
    given.peering.mandatory, given.peering.priority = True, 42  # `--priority 42` is kept
    assert peering.configure(given, lifetime_seconds=60) and given.peering.priority == 42
    for flags in ({"standalone": True, "mandatory": False}, {"standalone": False, "mandatory": False}):
        settings = kopf.OperatorSettings()
        settings.peering.standalone, settings.peering.mandatory = flags["standalone"], flags["mandatory"]
        assert not peering.configure(settings, lifetime_seconds=60)
        assert not settings.peering.clusterwide and settings.peering.priority == 0

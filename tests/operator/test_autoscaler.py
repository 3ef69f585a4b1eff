"""The HPA decision as a pure function, the metrics parser, and the simulation: no flapping, bounded lag."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from loraplex.operator.autoscaler import Decision, ScalingPolicy, ScalingState, decide, recommend
from loraplex.operator.events import SCALED_DOWN, SCALED_UP
from loraplex.operator.main import scale_event
from loraplex.operator.metrics import parse_metric, ready_pod_targets
from loraplex.operator.simulate import (
    SLOTS,
    adapter_policy,
    adapter_trace,
    default_policy,
    plot,
    simulate,
    synthetic_trace,
)
from loraplex.operator.spec import parse
from tests.operator.helpers import body

WAITING = "waiting_requests"
POLICY = ScalingPolicy(min_replicas=1, max_replicas=10, targets=((WAITING, 4.0),), scale_down_window_s=300.0)


def waiting(*values: float) -> dict[str, list[float]]:
    return {WAITING: list(values)}


def test_ratio_to_target() -> None:
    assert recommend(2, [8.0, 8.0], 4.0) == (4, 8.0, "ScaleUp")
    assert recommend(4, [1.0] * 4, 4.0) == (1, 1.0, "ScaleDown")


def test_tolerance_holds_within_ten_percent() -> None:
    assert recommend(3, [4.3, 4.3, 4.3], 4.0)[0] == 3
    assert recommend(3, [3.7, 3.7, 3.7], 4.0)[0] == 3
    assert recommend(3, [4.5, 4.5, 4.5], 4.0)[0] == 4


def test_no_metrics_holds() -> None:
    decision = decide(3, {}, POLICY, ScalingState(), 0.0)
    assert (decision.desired, decision.reason, decision.signal) == (3, "NoMetrics", None)


def test_silent_pods_are_counted_conservatively() -> None:
    # Two of four pods still loading: their absence must not read as "idle" (no scale-down)...
    assert recommend(4, [1.0, 1.0], 4.0)[0] == 4 - 1  # (1+1+4+4)/4/4 = 0.625 -> ceil(2.5) = 3
    # ...nor as "overloaded" (scale up from the ready pods' load only, counting the silent ones as 0).
    assert recommend(4, [8.0, 8.0], 4.0)[0] == 4  # (8+8+0+0)/4/4 = 1.0 -> hold


def test_bounds_clamp() -> None:
    assert decide(9, waiting(*[40.0] * 9), POLICY, ScalingState(), 0.0).desired == 10
    low = decide(1, waiting(0.0), POLICY, ScalingState(), 0.0)
    assert low.desired == 1


def test_scale_up_rate_limit() -> None:
    policy = ScalingPolicy(min_replicas=1, max_replicas=100, targets=((WAITING, 1.0),))
    first = decide(2, waiting(50.0, 50.0), policy, ScalingState(), 0.0)
    assert (first.desired, first.reason) == (6, "RateLimited")  # max(+100%, +4 pods) from 2
    second = decide(6, waiting(*[50.0] * 6), policy, first.state, 5.0)
    assert second.desired == 6  # the 15 s period still counts the first step
    third = decide(6, waiting(*[50.0] * 6), policy, second.state, 16.0)
    assert third.desired == 12


def test_scale_down_waits_for_the_stabilization_window() -> None:
    state = ScalingState()
    current = 4
    for t in range(0, 300, 15):  # busy: the recommendation stays 4
        decision = decide(current, waiting(*[4.0] * current), POLICY, state, float(t))
        state, current = decision.state, decision.desired
    assert current == 4
    for t in range(300, 600, 15):  # idle for less than the window: hold
        decision = decide(current, waiting(*[0.5] * current), POLICY, state, float(t))
        state, current = decision.state, decision.desired
        if t < 585:
            assert current == 4, t
    for t in range(600, 900, 15):
        decision = decide(current, waiting(*[0.5] * current), POLICY, state, float(t))
        state, current = decision.state, decision.desired
    assert current < 4


def test_scale_down_rate_limit() -> None:
    state = ScalingState()
    policy = ScalingPolicy(
        min_replicas=1, max_replicas=20, targets=((WAITING, 4.0),), scale_down_window_s=0.0
    )
    decision = decide(16, waiting(*[0.1] * 16), policy, state, 0.0)
    assert (decision.desired, decision.reason) == (8, "RateLimited")  # at most -50% per minute


def test_parse_metric_sums_label_sets_and_skips_comments() -> None:
    text = (
        "# HELP loraplex_requests_waiting queued\n# TYPE loraplex_requests_waiting gauge\n"
        'loraplex_requests_waiting{tenant="a"} 3\nloraplex_requests_waiting{tenant="b"} 2.5 1700000000\n'
        "loraplex_requests_waiting_total 99\nloraplex_pool_utilization 0.5\n"
    )
    assert parse_metric(text, "loraplex_requests_waiting") == 5.5
    assert parse_metric(text, "loraplex_pool_utilization") == 0.5
    assert parse_metric(text, "loraplex_requests_running") is None


def test_ready_pod_targets() -> None:
    def pod(ready: str, ip: str | None, deleting: bool = False) -> dict:
        return {
            "metadata": {"deletionTimestamp": "x"} if deleting else {},
            "spec": {"containers": [{"ports": [{"name": "http", "containerPort": 8000}]}]},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": ready}]},
        }

    pods = [
        pod("True", "10.0.0.1"),
        pod("False", "10.0.0.2"),
        pod("True", None),
        pod("True", "10.0.0.4", True),
    ]
    assert ready_pod_targets(pods) == ["http://10.0.0.1:8000"]


def test_simulation_has_no_flapping_and_bounded_lag(tmp_path: Path) -> None:
    policy = default_policy()
    steps = simulate(synthetic_trace(), policy)
    changes = [
        (b.t, b.replicas - a.replicas) for a, b in itertools.pairwise(steps) if b.replicas != a.replicas
    ]
    last_up = None
    for t, delta in changes:
        if delta > 0:
            last_up = t
        elif last_up is not None:
            assert t - last_up >= policy.scale_down_window_s, (
                f"scale-down at {t}s only {t - last_up}s after scale-up"
            )
    # Direction reversals are few: the bursts (every 150 s) must not make the replicas follow them.
    reversals = sum(1 for (_, a), (_, b) in itertools.pairwise(changes) if (a > 0) != (b > 0))
    assert reversals <= 4, changes
    # Lag: replicas are never short of 90% of what the load needs for more than 60 s (4 periods).
    short = 0.0
    for step in steps:
        short = short + 15 if step.replicas < 0.9 * step.needed else 0.0
        assert short <= 60, f"short of replicas for {short}s at {step.t}s"
    assert max(s.replicas for s in steps) >= 20 and steps[-1].replicas == 1
    out = tmp_path / "autoscaling.png"
    plot(steps, str(out))
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_policy_rejects_bad_bounds_and_targets() -> None:
    with pytest.raises(ValueError, match="min_replicas"):
        ScalingPolicy(min_replicas=3, max_replicas=2, targets=((WAITING, 1.0),))
    with pytest.raises(ValueError, match="at least one"):
        ScalingPolicy(min_replicas=1, max_replicas=2, targets=())
    with pytest.raises(ValueError, match="one target"):
        ScalingPolicy(min_replicas=1, max_replicas=2, targets=((WAITING, 1.0), (WAITING, 2.0)))
    with pytest.raises(ValueError, match="must be positive"):
        ScalingPolicy(min_replicas=1, max_replicas=2, targets=((WAITING, 0.0),))


def test_the_scale_event_says_direction_reason_and_metric() -> None:
    idep = parse(body(autoscaling={"metric": "pool_utilization", "target": 0.75}))
    up = Decision(current=2, desired=3, raw=3, value=0.9123456, reason="ScaleUp")
    assert scale_event(idep, up) == (
        SCALED_UP,
        "scaled Deployment llama3-8b-engine from 2 to 3 replicas "
        "(ScaleUp; pool_utilization 0.9123 per ready pod, target 0.75)",
    )
    down = Decision(current=3, desired=1, raw=1, value=None, reason="AtMinimum")
    reason, message = scale_event(idep, down)
    assert reason == SCALED_DOWN and "(AtMinimum; pool_utilization no samples, target 0.75)" in message


def test_the_adapter_wave_is_seen_only_with_adapter_demand(tmp_path: Path) -> None:
    """A steady queue while the adapters in use grow eightfold: the queue signal alone keeps 3 pods and
    leaves most adapters without a slot; with adapter_demand the replicas follow the adapters, nothing
    stays unplaced for more than the pod start and one period, and they come back down afterwards."""
    wave = adapter_trace()
    alone, with_demand = simulate(wave, default_policy()), simulate(wave, adapter_policy())
    assert max(s.replicas for s in alone) == 3
    assert max(s.unplaced for s in alone) >= 40
    assert max(s.replicas for s in with_demand) >= 64 // SLOTS
    late = 0.0
    for step in with_demand:
        late = late + 15 if step.unplaced > SLOTS else 0.0
        assert late <= 90, f"adapters unplaced for {late}s at {step.t}s"
    assert with_demand[-1].replicas == 3  # back to what the queue needs
    out = tmp_path / "autoscaling.png"
    plot(simulate(synthetic_trace(), default_policy()), str(out), (alone, with_demand))
    assert out.read_bytes()[:4] == b"\x89PNG"

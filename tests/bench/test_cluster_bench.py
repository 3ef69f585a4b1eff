"""`bench cluster` on a tiny pool: every request is accounted for, runs are reproducible, the router's
outstanding counts return to zero, on a trace that floods one adapter our placement beats the rendezvous
routing it replaces, and prewarm keeps the sets' growth off the request path."""

from __future__ import annotations

from dataclasses import replace

import pytest

from loraplex.bench import cluster
from loraplex.bench import cluster_sim as sim

MODEL = sim.gpu_model("A100")
TINY = sim.Workload(adapters=200, duration_s=8.0, load=0.5, bursts=0, seed=3)


def run(policy: str, workload: sim.Workload = TINY, pods: int = 4) -> sim.Result:
    return sim.simulate(MODEL, workload, pods, cluster.policy_factory(policy, MODEL, workload.seed))


@pytest.mark.parametrize("policy", cluster.POLICIES)
def test_every_request_is_served_once(policy: str) -> None:
    result = run(policy)
    assert result.requests > 50
    assert result.finished == result.requests  # the drain leaves nothing behind at this load
    assert 0 < result.pods_used <= 4
    assert result.bytes_moved > 0 and result.cold_loads_per_s > 0


def test_runs_are_deterministic() -> None:
    assert run("ours") == run("ours")
    assert run("llm-d") == run("llm-d")


def test_ours_counts_every_request_in_and_out() -> None:
    made: list[cluster.Ours] = []
    factory = cluster.policy_factory("ours", MODEL, 0)

    def keep(*args: object) -> sim.Policy:
        policy = factory(*args)
        made.append(policy)
        return policy

    sim.simulate(MODEL, TINY, 4, keep)
    (ours,) = made
    assert ours.router.outstanding.requests == {} and ours.router.outstanding.by_key == {}


def test_ours_beats_rendezvous_when_one_adapter_floods() -> None:
    flood = replace(TINY, bursts=1, burst_pods=2.0, burst_s=6.0)
    ours, rendezvous = run("ours", flood), run("rendezvous", flood)
    assert ours.requests == rendezvous.requests  # the same trace
    assert ours.ttft_p99 < rendezvous.ttft_p99 and ours.ttft_p50 < rendezvous.ttft_p50
    assert ours.goodput > rendezvous.goodput


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        cluster.policy_factory("nope", MODEL, 0)


def test_prewarm_takes_the_loads_of_growth_off_the_request_path() -> None:
    # One adapter floods a small pool: its set grows. With prewarm every cold load is an adapter's first
    # request anywhere (nothing is evicted at this size), and each join is a prewarm; without, each join
    # is a cold load a request waits on.
    flood = replace(TINY, bursts=1, burst_pods=2.0, burst_s=6.0)
    per_pod = sim.saturated_rps(MODEL, flood)
    trace = sim.trace(flood, flood.load * 4 * per_pod, flood.burst_pods * per_pod)
    adapters = len({r.adapter for r in trace if r.adapter is not None})
    policy = cluster.placement_policy(MODEL)

    def ours(prewarm: bool) -> sim.Result:
        return sim.simulate(
            MODEL, flood, 4, lambda pods, ranks, loop: cluster.Ours(pods, ranks, loop, 3, policy, prewarm)
        )

    warm, cold = ours(True), ours(False)
    assert warm.prewarms_per_s > 0 and cold.prewarms_per_s == 0
    assert warm.cold_loads_per_s * flood.duration_s == pytest.approx(adapters)
    assert cold.cold_loads_per_s * flood.duration_s > adapters  # the joins, loaded on demand
    assert warm.finished == warm.requests

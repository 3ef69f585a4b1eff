"""Replay a synthetic load trace through the autoscaler decision and plot replicas against load.

    python -m loraplex.operator.simulate docs/autoscaling.png

The load model is deliberately simple: each request holds a batch slot for `service_s` seconds, so by
Little's law a pod sees `rate × service_s / ready` running requests (the running_requests metric); new
pods serve only after `startup_s` (model load). The decision function is the one the operator runs.
"""

from __future__ import annotations

import argparse
import math
import random
from dataclasses import dataclass

from loraplex.operator.autoscaler import ScalingPolicy, ScalingState, decide

METRIC = "running_requests"  # what this load model produces per pod


@dataclass(frozen=True)
class Step:
    t: float
    load: float  # requests per second offered
    needed: int  # replicas that would hold the target exactly
    replicas: int  # the Deployment's replica count
    ready: int


def synthetic_trace(duration_s: int = 3600, step_s: int = 15, seed: int = 7) -> list[tuple[float, float]]:
    """(time, requests/s): idle, a ramp, a plateau, two bursts, a ramp down, idle; ±5% noise."""
    rng = random.Random(seed)
    points = []
    for t in range(0, duration_s, step_s):
        if t < 300:
            base = 2.0
        elif t < 1200:
            base = 2.0 + (t - 300) / 900 * 38.0  # ramp to 40 req/s over 15 minutes
        elif t < 1800:
            base = 40.0
        elif t < 2400:
            base = 80.0 if (t // 150) % 2 == 0 else 20.0  # bursts of 2.5 minutes
        elif t < 3000:
            base = 20.0 - (t - 2400) / 600 * 18.0
        else:
            base = 2.0
        points.append((float(t), base * (1 + rng.uniform(-0.05, 0.05))))
    return points


def simulate(
    trace: list[tuple[float, float]],
    policy: ScalingPolicy,
    service_s: float = 2.0,
    startup_s: float = 60.0,
) -> list[Step]:
    state = ScalingState()
    replicas = policy.min_replicas
    started: list[float] = [-startup_s] * replicas  # start time of each pod, oldest first
    steps = []
    for t, load in trace:
        ready = sum(1 for s in started if t - s >= startup_s)
        per_pod = load * service_s / max(ready, 1)
        decision = decide(replicas, {METRIC: [per_pod] * ready}, policy, state, t)
        state = decision.state
        if decision.desired > replicas:
            started += [t] * (decision.desired - replicas)
        elif decision.desired < replicas:
            started = started[: decision.desired]  # the oldest pods stay
        replicas = decision.desired
        target = dict(policy.targets)[METRIC]
        needed = min(policy.max_replicas, max(policy.min_replicas, math.ceil(load * service_s / target)))
        steps.append(Step(t=t, load=load, needed=needed, replicas=replicas, ready=ready))
    return steps


def default_policy() -> ScalingPolicy:
    return ScalingPolicy(min_replicas=1, max_replicas=24, targets=((METRIC, 8.0),), scale_down_window_s=300.0)


def plot(steps: list[Step], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    minutes = [s.t / 60 for s in steps]
    fig, load_axis = plt.subplots(figsize=(10, 4.5), dpi=110)
    load_axis.plot(minutes, [s.load for s in steps], color="tab:gray", alpha=0.6, label="load (req/s)")
    load_axis.set_xlabel("minutes")
    load_axis.set_ylabel("requests / s")
    replica_axis = load_axis.twinx()
    replica_axis.step(
        minutes, [s.needed for s in steps], where="post", color="tab:green", ls="--", label="needed"
    )
    replica_axis.step(minutes, [s.replicas for s in steps], where="post", color="tab:blue", label="replicas")
    replica_axis.step(
        minutes, [s.ready for s in steps], where="post", color="tab:orange", alpha=0.7, label="ready"
    )
    replica_axis.set_ylabel("replicas")
    handles = load_axis.get_legend_handles_labels()[0] + replica_axis.get_legend_handles_labels()[0]
    labels = load_axis.get_legend_handles_labels()[1] + replica_axis.get_legend_handles_labels()[1]
    load_axis.legend(handles, labels, loc="upper left")
    load_axis.set_title(
        "builtin autoscaler: running_requests target 8/pod, 60 s pod start, 5 min scale-down window"
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", nargs="?", default="docs/autoscaling.png")
    args = parser.parse_args(argv)
    plot(simulate(synthetic_trace(), default_policy()), args.output)


if __name__ == "__main__":
    main()

"""Replay synthetic traces through the autoscaler decision and plot replicas against demand.

    python -m loraplex.operator.simulate docs/autoscaling.png

The load model is deliberately simple: each request holds a batch slot for `service_s` seconds, so by
Little's law a pod sees `rate × service_s / ready` running requests (the running_requests signal); new
pods serve only after `startup_s` (model load). With adapters, `adapters` distinct adapters have
requests in flight, spread over the ready pods by placement, each pod with `slots` adapter slots: a pod's
adapter_demand is `adapters / ready / slots`, and what exceeds every pod's slots is unplaced. The decision
function is the one the operator runs.
"""

from __future__ import annotations

import argparse
import math
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

from loraplex.operator.autoscaler import ScalingPolicy, ScalingState, decide

if TYPE_CHECKING:
    from matplotlib.axes import Axes

METRIC = "running_requests"  # what this load model produces per pod
SLOTS = 8  # adapter slots per pod (max_lora) in the adapter scenario


@dataclass(frozen=True)
class Step:
    t: float
    load: float  # requests per second offered
    needed: int  # replicas that would hold every target exactly
    replicas: int  # the Deployment's replica count
    ready: int
    adapters: float = 0.0  # distinct adapters with requests in flight
    unplaced: float = 0.0  # of those, beyond every ready pod's slots


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


def adapter_trace(
    duration_s: int = 3600, step_s: int = 15, seed: int = 11
) -> list[tuple[float, float, float]]:
    """(time, requests/s, adapters in flight): a steady 10 req/s while the adapters in use go from 8 to
    64 over 20 minutes (tenants bring their long tail in), hold, and fall back; ±5% noise."""
    rng = random.Random(seed)
    points = []
    for t in range(0, duration_s, step_s):
        if t < 600:
            adapters = 8.0
        elif t < 1800:
            adapters = 8.0 + (t - 600) / 1200 * 56.0
        elif t < 2700:
            adapters = 64.0
        else:
            adapters = max(8.0, 64.0 - (t - 2700) / 300 * 56.0)
        noise = 1 + rng.uniform(-0.05, 0.05)
        points.append((float(t), 10.0 * noise, float(round(adapters * noise))))
    return points


def simulate(
    trace: list[tuple[float, float]] | list[tuple[float, float, float]],
    policy: ScalingPolicy,
    service_s: float = 2.0,
    startup_s: float = 60.0,
    slots: int = SLOTS,
) -> list[Step]:
    state = ScalingState()
    replicas = policy.min_replicas
    started: list[float] = [-startup_s] * replicas  # start time of each pod, oldest first
    targets = dict(policy.targets)
    steps = []
    for t, load, *rest in trace:
        adapters = rest[0] if rest else 0.0
        ready = sum(1 for s in started if t - s >= startup_s)
        per_pod = {
            METRIC: load * service_s / max(ready, 1),
            "adapter_demand": adapters / max(ready, 1) / slots,
        }
        samples = {name: [per_pod[name]] * ready for name in targets}
        decision = decide(replicas, samples, policy, state, t)
        state = decision.state
        if decision.desired > replicas:
            started += [t] * (decision.desired - replicas)
        elif decision.desired < replicas:
            started = started[: decision.desired]  # the oldest pods stay
        replicas = decision.desired
        wanted = [load * service_s / targets[METRIC], adapters / slots]  # what each need asks for
        needed = min(policy.max_replicas, max(policy.min_replicas, math.ceil(max(wanted))))
        unplaced = max(0.0, adapters - ready * slots)
        steps.append(Step(t, load, needed, replicas, ready, adapters, unplaced))
    return steps


def default_policy() -> ScalingPolicy:
    return ScalingPolicy(min_replicas=1, max_replicas=24, targets=((METRIC, 8.0),), scale_down_window_s=300.0)


def adapter_policy() -> ScalingPolicy:
    """The default policy plus the adapter_demand signal at one adapter in flight per slot."""
    return ScalingPolicy(
        min_replicas=1,
        max_replicas=24,
        targets=((METRIC, 8.0), ("adapter_demand", 1.0)),
        scale_down_window_s=300.0,
    )


def plot(steps: list[Step], path: str, adapters: tuple[list[Step], list[Step]] | None = None) -> None:
    """The load run; with `adapters` (queue signal alone, with adapter_demand) a second panel below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = 1 if adapters is None else 2
    fig, axes = plt.subplots(rows, 1, figsize=(10, 4.5 * rows), dpi=110, squeeze=False)
    load_axis = axes[0][0]
    minutes = [s.t / 60 for s in steps]
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
    _legend(load_axis, replica_axis)
    load_axis.set_title(
        "builtin autoscaler: running_requests target 8/pod, 60 s pod start, 5 min scale-down window"
    )
    if adapters is not None:
        _plot_adapters(axes[1][0], *adapters)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _plot_adapters(axis: Axes, alone: list[Step], with_demand: list[Step]) -> None:
    minutes = [s.t / 60 for s in alone]
    axis.plot(minutes, [s.adapters for s in alone], color="tab:gray", alpha=0.6, label="adapters in flight")
    axis.plot(
        minutes, [s.unplaced for s in alone], color="tab:red", alpha=0.6, label="unplaced, queue signal alone"
    )
    axis.plot(
        minutes, [s.unplaced for s in with_demand], color="tab:purple", label="unplaced, with adapter_demand"
    )
    axis.set_xlabel("minutes")
    axis.set_ylabel("adapters")
    replicas = axis.twinx()
    for steps, color, label in (
        (alone, "tab:orange", "queue signal alone"),
        (with_demand, "tab:blue", "with adapter_demand"),
    ):
        replicas.step(
            minutes, [s.replicas for s in steps], where="post", color=color, label=f"replicas, {label}"
        )
    replicas.set_ylabel("replicas")
    replicas.set_ylim(bottom=0)  # the queue-only line sits at 3: keep it off the axis floor
    _legend(axis, replicas)
    axis.set_title(
        f"10 req/s while the adapters in use grow from 8 to 64 ({SLOTS} slots a pod), adapter_demand target 1"
    )


def _legend(left: Axes, right: Axes) -> None:
    (left_handles, left_labels), (right_handles, right_labels) = (
        left.get_legend_handles_labels(),
        right.get_legend_handles_labels(),
    )
    left.legend(left_handles + right_handles, left_labels + right_labels, loc="upper left", fontsize="small")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", nargs="?", default="docs/autoscaling.png")
    args = parser.parse_args(argv)
    wave = adapter_trace()
    adapters = (simulate(wave, default_policy()), simulate(wave, adapter_policy()))
    plot(simulate(synthetic_trace(), default_policy()), args.output, adapters)


if __name__ == "__main__":
    main()

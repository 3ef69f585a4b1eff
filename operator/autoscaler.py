"""The replica decision: the Kubernetes HPA algorithm as a pure function of metrics, state and time.

1. Per signal (operator/signals.py), ratio = mean(per-pod value) / target over ready pods; within
   ±tolerance (10%) keep the replica count. Pods that exist but report nothing count as 0 when scaling up
   and as exactly `target` when scaling down (the HPA's conservative rule), so starting pods neither
   trigger more scale-up nor invite a scale-down.
2. raw = ceil(ratio × counted pods) per signal; the largest wins (the HPA's rule for several metrics), and
   names the signal that drove the decision. A signal without samples takes no part, except that while
   one is missing the others may not scale down (the HPA's rule too: never shed capacity blind).
3. Stabilization: scale up to the *lowest* recommendation of the last scaleUpStabilizationSeconds, down to
   the *highest* of the last scaleDownStabilizationSeconds (so a short dip never sheds replicas).
4. Rate limits: at most +max(100%, 4 pods) per 15 s up, at most -50% per 60 s down.
5. Clamp to [min, max].
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ScalingPolicy:
    min_replicas: int
    max_replicas: int
    targets: tuple[tuple[str, float], ...]  # (signal, per-pod target); the first is the primary
    tolerance: float = 0.1
    scale_up_window_s: float = 0.0
    scale_down_window_s: float = 300.0
    scale_up_percent: float = 100.0
    scale_up_pods: int = 4
    scale_up_period_s: float = 15.0
    scale_down_percent: float = 50.0
    scale_down_period_s: float = 60.0

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.max_replicas:
            bounds = f"{self.min_replicas}..{self.max_replicas}"
            raise ValueError(f"need 1 <= min_replicas <= max_replicas, got {bounds}")
        if not self.targets:
            raise ValueError("a scaling policy needs at least one (signal, target)")
        names = [name for name, _ in self.targets]
        if len(set(names)) != len(names):
            raise ValueError(f"each signal may have one target, got {names}")
        for name, target in self.targets:
            if not target > 0:
                raise ValueError(f"the target of {name} must be positive, got {target}")


@dataclass(frozen=True)
class ScalingState:
    """What the decision remembers: past raw recommendations and past replica changes, as (time, value),
    and the counters each pod reported last (for the rate signals; read and written by signals.py)."""

    recommendations: tuple[tuple[float, int], ...] = ()
    changes: tuple[tuple[float, int], ...] = ()
    counters: Mapping[str, tuple[float, Mapping[str, float]]] = field(default_factory=dict)


@dataclass(frozen=True)
class Reading:
    """One signal's part in a decision: its mean per ready pod (None: no samples) and what it asked for."""

    signal: str
    target: float
    value: float | None
    raw: int
    reason: str


@dataclass(frozen=True)
class Decision:
    current: int
    desired: int
    raw: int
    value: float | None  # the driving signal's mean per ready pod; None without samples
    reason: str
    state: ScalingState = field(repr=False, default_factory=ScalingState)
    signal: str | None = None  # the signal whose recommendation won; None when none had samples
    readings: tuple[Reading, ...] = ()
    unplaced_adapters: int | None = None  # adapters in demand beyond every pod's slots (signals.py)


def recommend(
    current: int, samples: Sequence[float], target: float, tolerance: float = 0.1
) -> tuple[int, float | None, str]:
    """Steps 1-2 for one signal: the raw recommendation from per-pod samples of the ready pods."""
    if not samples:
        return current, None, "NoMetrics"
    mean = sum(samples) / len(samples)
    ratio = mean / target
    if abs(ratio - 1.0) <= tolerance:
        return current, mean, "WithinTolerance"
    missing = max(0, current - len(samples))
    if missing:
        assumed = 0.0 if ratio > 1 else target
        adjusted = (sum(samples) + missing * assumed) / (len(samples) + missing) / target
        # Counting the silent pods may flip the direction or land inside the tolerance: then hold.
        if abs(adjusted - 1.0) <= tolerance or (adjusted > 1) != (ratio > 1):
            return current, mean, "WithinTolerance"
        return math.ceil(adjusted * (len(samples) + missing)), mean, "ScaleUp" if ratio > 1 else "ScaleDown"
    return math.ceil(ratio * len(samples)), mean, "ScaleUp" if ratio > 1 else "ScaleDown"


def combine(current: int, readings: Sequence[Reading]) -> tuple[int, Reading | None, str]:
    """The largest recommendation of the signals with samples, the reading behind it, and the reason."""
    measured = [r for r in readings if r.value is not None]
    if not measured:
        return current, None, "NoMetrics"
    best = max(measured, key=lambda r: r.raw)  # the first of equals: the primary signal leads ties
    if len(measured) < len(readings) and best.raw < current:
        return current, best, "SignalMissing"
    return best.raw, best, best.reason


def decide(
    current: int,
    samples: Mapping[str, Sequence[float]],
    policy: ScalingPolicy,
    state: ScalingState,
    now: float,
) -> Decision:
    """The replica count to set now from each signal's per-pod samples (a signal absent from `samples`
    has none); `now` is seconds on any monotonic clock shared with `state`."""
    readings = tuple(
        Reading(name, target, *_reading(recommend(current, samples.get(name, ()), target, policy.tolerance)))
        for name, target in policy.targets
    )
    raw, driver, reason = combine(current, readings)
    value = driver.value if driver is not None else None
    history = (*state.recommendations, (now, raw))

    up = min([raw, *(r for t, r in history if now - t <= policy.scale_up_window_s)])
    down = max([raw, *(r for t, r in history if now - t <= policy.scale_down_window_s)])
    desired = current
    if desired < up:
        desired = up
    if desired > down:
        desired = down
    if desired != raw and reason in ("ScaleUp", "ScaleDown"):
        reason = "Stabilized"

    limited = _rate_limit(current, desired, policy, state.changes, now)
    if limited != desired:
        desired, reason = limited, "RateLimited"
    clamped = max(policy.min_replicas, min(policy.max_replicas, desired))
    if clamped != desired:
        desired, reason = clamped, "AtMaximum" if clamped == policy.max_replicas else "AtMinimum"

    keep = max(policy.scale_up_window_s, policy.scale_down_window_s)
    period = max(policy.scale_up_period_s, policy.scale_down_period_s)
    changes = state.changes + (((now, desired - current),) if desired != current else ())
    new_state = ScalingState(
        recommendations=tuple((t, r) for t, r in history if now - t <= keep),
        changes=tuple((t, d) for t, d in changes if now - t <= period),
        counters=state.counters,
    )
    return Decision(
        current=current,
        desired=desired,
        raw=raw,
        value=value,
        reason=reason,
        state=new_state,
        signal=driver.signal if driver is not None else None,
        readings=readings,
    )


def _reading(recommendation: tuple[int, float | None, str]) -> tuple[float | None, int, str]:
    raw, value, reason = recommendation
    return value, raw, reason


def _rate_limit(
    current: int, desired: int, policy: ScalingPolicy, changes: tuple[tuple[float, int], ...], now: float
) -> int:
    if desired > current:
        added = sum(d for t, d in changes if d > 0 and now - t < policy.scale_up_period_s)
        start = current - added
        limit = max(math.ceil(start * (1 + policy.scale_up_percent / 100)), start + policy.scale_up_pods)
        return max(current, min(desired, limit))
    if desired < current:
        removed = -sum(d for t, d in changes if d < 0 and now - t < policy.scale_down_period_s)
        start = current + removed
        limit = math.ceil(start * (1 - policy.scale_down_percent / 100))
        return min(current, max(desired, limit))
    return desired

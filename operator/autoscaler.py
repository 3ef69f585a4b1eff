"""The replica decision: the Kubernetes HPA algorithm as a pure function of metrics, state and time.

1. ratio = mean(per-pod metric) / target over ready pods; within ±tolerance (10%) keep the replica count.
   Pods that exist but report nothing count as 0 when scaling up and as exactly `target` when scaling down
   (the HPA's conservative rule), so starting pods neither trigger more scale-up nor invite a scale-down.
2. raw = ceil(ratio × counted pods).
3. Stabilization: scale up to the *lowest* recommendation of the last scaleUpStabilizationSeconds, down to
   the *highest* of the last scaleDownStabilizationSeconds (so a short dip never sheds replicas).
4. Rate limits: at most +max(100%, 4 pods) per 15 s up, at most -50% per 60 s down.
5. Clamp to [min, max].
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ScalingPolicy:
    min_replicas: int
    max_replicas: int
    target: float
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
        if self.target <= 0:
            raise ValueError(f"target must be positive, got {self.target}")


@dataclass(frozen=True)
class ScalingState:
    """What the decision remembers: past raw recommendations and past replica changes, as (time, value)."""

    recommendations: tuple[tuple[float, int], ...] = ()
    changes: tuple[tuple[float, int], ...] = ()


@dataclass(frozen=True)
class Decision:
    current: int
    desired: int
    raw: int
    value: float | None  # mean per-pod metric over ready pods; None without samples
    reason: str
    state: ScalingState = field(repr=False, default_factory=ScalingState)


def recommend(current: int, samples: list[float], policy: ScalingPolicy) -> tuple[int, float | None, str]:
    """Steps 1-2: the raw recommendation from per-pod samples of the ready pods."""
    if not samples:
        return current, None, "NoMetrics"
    mean = sum(samples) / len(samples)
    ratio = mean / policy.target
    if abs(ratio - 1.0) <= policy.tolerance:
        return current, mean, "WithinTolerance"
    missing = max(0, current - len(samples))
    if missing:
        assumed = 0.0 if ratio > 1 else policy.target
        adjusted = (sum(samples) + missing * assumed) / (len(samples) + missing) / policy.target
        # Counting the silent pods may flip the direction or land inside the tolerance: then hold.
        if abs(adjusted - 1.0) <= policy.tolerance or (adjusted > 1) != (ratio > 1):
            return current, mean, "WithinTolerance"
        return math.ceil(adjusted * (len(samples) + missing)), mean, "ScaleUp" if ratio > 1 else "ScaleDown"
    return math.ceil(ratio * len(samples)), mean, "ScaleUp" if ratio > 1 else "ScaleDown"


def decide(
    current: int, samples: list[float], policy: ScalingPolicy, state: ScalingState, now: float
) -> Decision:
    """The replica count to set now; `now` is seconds on any monotonic clock shared with `state`."""
    raw, value, reason = recommend(current, samples, policy)
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
    )
    return Decision(current=current, desired=desired, raw=raw, value=value, reason=reason, state=new_state)


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

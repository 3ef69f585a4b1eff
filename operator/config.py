"""The operator's one settings object, read from the environment once at startup (never at import)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class OperatorConfig:
    resync_seconds: float = 30.0  # drift repair and status refresh, per InferenceDeployment
    autoscale_seconds: float = 15.0  # builtin autoscaler period (the HPA's default sync period)
    scrape_timeout_seconds: float = 2.0
    request_timeout_seconds: float = 10.0
    peering_lifetime_seconds: float = 60.0  # a crashed active replica is replaced after this (kopf peering)

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value <= 0:
                raise ValueError(f"{name} is {value}, not positive: fix LORAPLEX_OPERATOR_{name.upper()}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> OperatorConfig:
        """LORAPLEX_OPERATOR_RESYNC_SECONDS=5 and so on; unset keys keep their defaults."""
        env = os.environ if environ is None else environ
        values = {}
        for name in cls.__dataclass_fields__:
            raw = env.get(f"LORAPLEX_OPERATOR_{name.upper()}")
            if raw is not None:
                try:
                    values[name] = float(raw)
                except ValueError as error:
                    raise ValueError(f"LORAPLEX_OPERATOR_{name.upper()}={raw!r} is not a number") from error
        return cls(**values)

"""The operator's one settings object, read from the environment once at startup (never at import)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

# What an unset (or empty) LORAPLEX_OPERATOR_ALLOWED_IMAGES permits: the project's own engine image, by
# tag or digest. Anything else needs the admin to list it, or to opt out with ALLOW_ANY_IMAGE.
DEFAULT_ALLOWED_IMAGES = ("ghcr.io/loraplex/engine:*", "ghcr.io/loraplex/engine@sha256:*")


@dataclass(frozen=True)
class OperatorConfig:
    resync_seconds: float = 30.0  # drift repair and status refresh, per InferenceDeployment
    # The same while an InferenceDeployment is not Ready (rolling out, or its engine crashing): a crash
    # changes no Deployment field the operator watches, so only a resync shows it in the status.
    converging_resync_seconds: float = 5.0
    autoscale_seconds: float = 15.0  # builtin autoscaler period (the HPA's default sync period)
    scrape_timeout_seconds: float = 2.0
    request_timeout_seconds: float = 10.0
    peering_lifetime_seconds: float = 60.0  # a crashed active replica is replaced after this (kopf peering)
    # The Secret and image policy (operator/policy.py): fnmatch globs, matched case-sensitively.
    allowed_images: tuple[str, ...] = DEFAULT_ALLOWED_IMAGES
    allow_any_image: bool = False
    allowed_secrets: tuple[str, ...] = ()  # `namespace/name` globs, e.g. `loraplex/loraplex-*`
    # What the autoscaler presents to engines' /metrics (metrics.scrape_headers); the chart passes the
    # internal token of its Secret. Empty: scrape without one (engines without a token serve it openly).
    internal_token: str = field(default="", repr=False)
    # Make an InferencePool for a CR that asks for one (the chart grants the RBAC only then).
    inference_pools: bool = False
    # Exact names a podTemplate may use; none by default. A CSI driver mounts what it fetches (the Secrets
    # Store driver: a vault's secrets, which the Secret policy never sees), and a runtime class chooses how
    # the pod is isolated, so both are the admin's to permit.
    allowed_csi_drivers: tuple[str, ...] = ()
    allowed_runtime_classes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value <= 0:
                raise ValueError(f"{name} is {value}, not positive: fix LORAPLEX_OPERATOR_{name.upper()}")
        for pattern in self.allowed_secrets:
            namespace, slash, name = pattern.partition("/")
            if not slash or not namespace or not name or "/" in name:
                raise ValueError(
                    f"LORAPLEX_OPERATOR_ALLOWED_SECRETS entry {pattern!r} is not namespace/name "
                    "(globs allowed, e.g. loraplex/loraplex-* or */engine-token)"
                )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> OperatorConfig:
        """LORAPLEX_OPERATOR_RESYNC_SECONDS=5 and so on; unset keys keep their defaults."""
        env = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for spec in fields(cls):
            variable = f"LORAPLEX_OPERATOR_{spec.name.upper()}"
            raw = env.get(variable)
            if raw is None:
                continue
            if spec.name.startswith("allowed_"):
                patterns = tuple(part.strip() for part in raw.split(",") if part.strip())
                # Empty means "not configured" (a chart renders an empty list so): keep the default.
                if patterns:
                    values[spec.name] = patterns
            elif spec.name == "internal_token":
                values[spec.name] = raw.strip()
            elif spec.name in ("allow_any_image", "inference_pools"):
                if raw.strip().lower() not in ("true", "false"):
                    raise ValueError(f"{variable}={raw!r} must be true or false")
                values[spec.name] = raw.strip().lower() == "true"
            else:
                try:
                    values[spec.name] = float(raw)
                except ValueError as error:
                    raise ValueError(f"{variable}={raw!r} is not a number") from error
        return cls(**values)  # type: ignore[arg-type]

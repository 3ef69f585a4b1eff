"""The control plane's one settings class, read from LORAPLEX_* environment variables."""

from __future__ import annotations

import secrets
from ipaddress import IPv4Network, IPv6Network
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from loraplex.adapters import AdapterError, ArtifactStore, LocalArtifactStore, open_store


class Settings(BaseSettings):
    """Everything the control plane needs; unset secrets are generated once and kept under data_dir."""

    model_config = SettingsConfigDict(env_prefix="LORAPLEX_", extra="ignore")

    data_dir: Path = Field(default_factory=lambda: Path.home() / ".loraplex")
    # SQLite under data_dir when unset (the single-machine default); postgresql+psycopg://... in a cluster.
    database_url: str = ""
    admin_token: SecretStr | None = None
    key_pepper: SecretStr | None = None
    internal_token: SecretStr | None = None
    # Where adapters are stored (LORAPLEX_ADAPTER_STORE; engines read the same setting): a directory,
    # file://..., or s3://bucket/prefix. Unset: <data_dir>/artifacts (or LORAPLEX_ARTIFACT_ROOT, old name).
    adapter_store: str = ""
    # An S3-compatible service other than AWS (MinIO, Ceph RGW, ...); credentials come from AWS_* variables.
    s3_endpoint_url: str | None = None
    artifact_root: Path | None = None
    max_upload_bytes: int = Field(default=512 * 1024 * 1024, gt=0)
    engine_connect_timeout_s: float = Field(default=5.0, gt=0)
    engine_read_timeout_s: float = Field(default=300.0, gt=0)
    # A replica that refused a connection is skipped for this long before it is tried again.
    endpoint_cooldown_s: float = Field(default=10.0, ge=0)
    # Placement (services/routing.py, docs/placement.md): a pod with this many of this gateway's requests
    # outstanding is saturated (an adapter's set then grows); adapter bytes one pod may be assigned (its
    # pool less KV headroom; 0: unbounded); how long a surplus replica stays once demand has fallen, and
    # how long an adapter with no request keeps its place.
    placement_saturation: float = Field(default=48.0, gt=0)
    placement_pod_adapter_bytes: int = Field(default=0, ge=0)
    placement_cool_s: float = Field(default=30.0, gt=0)
    placement_idle_s: float = Field(default=300.0, gt=0)
    # How often each engine's own queue is read from its /metrics (services/engine_load.py): every replica
    # of the control plane then sees the same load per pod, not only the requests it sent itself. 0: never.
    engine_load_interval_s: float = Field(default=2.0, ge=0, le=300)
    # How often every engine replica's adapter registrations are compared with the database, and the
    # adapters deleted meanwhile unregistered (a delete also starts a pass at once): services/engine_sync.py.
    engine_sync_interval_s: float = Field(default=30.0, gt=0, le=3600)
    # Replica discovery for kubernetes://<namespace>/<name> deployment endpoints: "auto" watches pods when
    # a cluster configuration exists (in a pod, or KUBECONFIG / ~/.kube/config), "on" refuses to start
    # without one, "off" never asks the Kubernetes API (such deployments then have no replicas).
    kubernetes_discovery: Literal["auto", "on", "off"] = "auto"
    # How long one pod WATCH lasts before the API server ends it and it is resumed.
    kubernetes_watch_timeout_s: float = Field(default=300.0, ge=1, le=3600)
    # The completion limit of a gateway request that names none: forwarded to the engine as max_tokens,
    # so the tokens-per-minute reservation (prompt + this) bounds what the request can produce.
    default_max_tokens: int = Field(default=256, gt=0, le=65_536)
    # Requests one tenant, and one API key, may have in flight through one gateway replica at once (a
    # tenant's quota max_in_flight replaces the first), and each tenant's share of the replica's
    # upstream connections to the engines: every tenant may always hold upstream_tenant_floor of them
    # while any is free, and upstream_reserve_fraction of them are kept for tenants below that
    # (wire/shares.py; docs/security.md, "Shares of queues and connections").
    tenant_max_in_flight: int = Field(default=64, ge=1, le=1_000_000)
    key_max_in_flight: int = Field(default=32, ge=1, le=1_000_000)
    upstream_connections: int = Field(default=512, ge=1, le=65_536)
    upstream_tenant_floor: int = Field(default=16, ge=0, le=65_536)
    upstream_reserve_fraction: float = Field(default=0.25, ge=0, lt=1)
    # The console: the key that signs its cookies, how long a sign-in lasts, and sign-in throttling
    # (this many failures per email within the window lock that email until the window ends; a
    # client address gets four times as many).
    session_secret: SecretStr | None = None
    session_hours: float = Field(default=12.0, gt=0)
    sign_in_max_failures: int = Field(default=5, ge=1)
    sign_in_window_s: float = Field(default=900.0, gt=0)
    # Reverse proxies (comma-separated CIDRs) whose client-address header is believed: sign-in throttling
    # counts the right-most hop of that header that is not one of them. Empty: the TCP peer is the client.
    trusted_proxies: str = ""
    client_address_header: str = Field(default="X-Forwarded-For", min_length=1, max_length=64)
    # Secure cookies: None sends them Secure exactly when the request came over https.
    secure_cookies: bool | None = None
    # Deployment endpoints on loopback (127.0.0.1, localhost) receive the internal token too: only on one
    # machine, where the engine listens beside the control plane (`loraplex up` sets it). Off on clusters.
    allow_loopback_endpoints: bool = False

    @model_validator(mode="after")
    def _defaults(self) -> Settings:
        if not self.database_url:
            self.database_url = f"sqlite:///{self.data_dir / 'loraplex.db'}"
        if not self.adapter_store:
            self.adapter_store = str(self.artifact_root or self.data_dir / "artifacts")
        try:
            store = self.artifact_store()
        except (ValueError, AdapterError) as exc:
            raise ValueError(f"LORAPLEX_ADAPTER_STORE: {exc}") from None
        if isinstance(store, LocalArtifactStore):
            self.artifact_root = store.root
        elif self.artifact_root is None:
            self.artifact_root = self.data_dir / "artifacts"
        return self

    def artifact_store(self) -> ArtifactStore:
        """The store adapters are written to (no connection is made until it is used)."""
        return open_store(self.adapter_store, endpoint_url=self.s3_endpoint_url or None)

    @model_validator(mode="after")
    def _trusted_proxies_are_networks(self) -> Settings:
        try:
            self.trusted_networks()
        except ValueError as exc:
            raise ValueError(f"LORAPLEX_TRUSTED_PROXIES: {exc}") from None
        return self

    def trusted_networks(self) -> tuple[IPv4Network | IPv6Network, ...]:
        from .services.client_address import parse_networks

        return parse_networks(c for c in self.trusted_proxies.split(",") if c.strip())

    def pepper(self) -> bytes:
        return _secret(self.key_pepper, self.data_dir / "key_pepper").encode()

    def engine_token(self) -> str:
        return _secret(self.internal_token, self.data_dir / "internal_token")

    def console_secret(self) -> bytes:
        return _secret(self.session_secret, self.data_dir / "session_secret").encode()

    def artifacts(self) -> Path:
        assert self.artifact_root is not None  # set by _defaults
        return self.artifact_root


def secret_in_file(path: Path) -> str:
    """The secret kept in `path`, made (random, owner-readable only) the first time it is asked for."""
    return _secret(None, path)


def _secret(value: SecretStr | None, path: Path) -> str:
    """The configured secret, else the one kept in `path` (made once, readable by its owner only)."""
    if value is not None:
        return value.get_secret_value()
    if path.is_file():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    path.touch(mode=0o600)
    path.write_text(token)
    return token

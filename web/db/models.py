"""The control plane's tables, as SQLAlchemy 2 typed models (migrations/ mirrors them)."""

from __future__ import annotations

import datetime as dt
import enum
import uuid
from typing import Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    Date,
    DateTime,
    Enum,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    false,
    true,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

# Names every constraint, so migrations can refer to them on Postgres and SQLite alike.
NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# An autoincrementing 64-bit key on Postgres; SQLite only autoincrements INTEGER PRIMARY KEY.
BigId = BigInteger().with_variant(Integer(), "sqlite")


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)
    type_annotation_map: ClassVar[dict[Any, Any]] = {
        dt.datetime: DateTime(timezone=True),
        dict[str, Any]: JSON,
        list[str]: JSON,
    }


class AdapterStatus(enum.StrEnum):
    UPLOADED = "uploaded"
    VALIDATING = "validating"
    READY = "ready"
    FAILED = "failed"


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=uuid.uuid4)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    disabled: Mapped[bool] = mapped_column(default=False)
    # The tenant's share of a busy engine relative to others (2: twice the tokens of a tenant of 1); the
    # gateway sends it with every request, the engine's fairness counters divide by it.
    fair_share_weight: Mapped[float] = mapped_column(Float, default=1.0, server_default="1")
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)

    quota: Mapped[Quota | None] = relationship(back_populates="tenant", cascade="all, delete-orphan")


class KeyScope(enum.StrEnum):
    """What a key may do: ALL (manage, read, infer), INFERENCE (call models only), READ (listings, usage)."""

    ALL = "all"
    INFERENCE = "inference"
    READ = "read"


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=uuid.uuid4)
    tenant_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(128))
    # HMAC-SHA256 of the key under the server's pepper (hex); the key itself is never stored.
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[dt.datetime | None]
    revoked_at: Mapped[dt.datetime | None]
    last_used_at: Mapped[dt.datetime | None]
    # What the key may do (services/scopes.py); keys made before scopes existed have all of it.
    scope: Mapped[str] = mapped_column(String(16), default=KeyScope.ALL.value, server_default="all")
    # The adapter names the key may call and manage; None: every adapter of its tenant.
    adapters: Mapped[list[str] | None] = mapped_column(JSON)
    # Whether the key may call the base models (an adapter-limited key usually may not).
    base_model: Mapped[bool] = mapped_column(default=True, server_default=true())


class Deployment(Base):
    __tablename__ = "deployments"

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=uuid.uuid4)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    base_model: Mapped[str] = mapped_column(String(256))
    # The base model's shapes, copied in so the control plane validates adapters without the engine.
    num_layers: Mapped[int]
    hidden_size: Mapped[int]
    intermediate_size: Mapped[int]
    q_size: Mapped[int]
    kv_size: Mapped[int]
    endpoints: Mapped[list[str]]
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class AdapterName(Base):
    """One adapter name of a tenant: which of its versions the bare name addresses, and the last version
    number given, so a number is never given to other bytes while the name lives. Every writer of an
    adapter takes this row first (services/adapters.py)."""

    __tablename__ = "adapter_names"

    tenant_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True
    )
    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    # The version `model: "<name>"` addresses; None only while the name has no version left to point at.
    active_version: Mapped[int | None]
    last_version: Mapped[int] = mapped_column(default=0)
    # A canary split of the bare name's requests, {"<version>": weight}; None: all go to the active version
    # (services/traffic.py).
    traffic: Mapped[dict[str, int] | None] = mapped_column(JSON)
    # Whether a request that names its caller (OpenAI's `user`) always gets the same version of the split.
    sticky: Mapped[bool] = mapped_column(default=True, server_default=true())


class Adapter(Base):
    """One version of a tenant's adapter: its own bytes (digest), status and id, the id the engines know
    it by, so two versions of a name are two engine adapters and may share a batch."""

    __tablename__ = "adapters"
    __table_args__ = (
        UniqueConstraint("tenant_id", "name", "version", name="uq_adapters_tenant_id_name_version"),
    )

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=uuid.uuid4)
    tenant_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    deployment_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("deployments.id", ondelete="RESTRICT"), index=True
    )
    name: Mapped[str] = mapped_column(String(128))
    # 1, 2, ... within the name: `model: "<name>@<version>"` addresses it.
    version: Mapped[int] = mapped_column(default=1, server_default="1")
    status: Mapped[AdapterStatus] = mapped_column(
        Enum(AdapterStatus, name="adapter_status", values_callable=lambda e: [m.value for m in e]),
        default=AdapterStatus.UPLOADED,
    )
    error: Mapped[str | None] = mapped_column(Text)
    rank: Mapped[int | None]
    target_modules: Mapped[list[str]] = mapped_column(default=list)
    bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    sha256: Mapped[str | None] = mapped_column(String(64))
    storage_uri: Mapped[str | None] = mapped_column(Text)
    # Who uploaded it, as words kept after the key or user is gone: "key lpx_AbCd1234 (ci)", "user a@b.c".
    uploaded_by: Mapped[str | None] = mapped_column(String(400))
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    # Kept resident on its deployment's engines (services/pins.py); counts against max_pinned_adapters.
    pinned: Mapped[bool] = mapped_column(default=False, server_default=false())

    deployment: Mapped[Deployment] = relationship()
    # The name this version belongs to (its active version and traffic split); read-only from here.
    name_row: Mapped[AdapterName | None] = relationship(
        primaryjoin="and_(foreign(Adapter.tenant_id) == AdapterName.tenant_id, "
        "foreign(Adapter.name) == AdapterName.name)",
        viewonly=True,
    )


class Quota(Base):
    """Limits of one tenant; None means unlimited (max_in_flight: the gateway's default)."""

    __tablename__ = "quotas"

    tenant_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True
    )
    requests_per_minute: Mapped[int | None]
    tokens_per_minute: Mapped[int | None]
    max_adapters: Mapped[int | None]
    max_adapter_bytes: Mapped[int | None] = mapped_column(BigInteger)
    # The total bytes of the tenant's adapters (config and weights; two adapters with one digest count twice).
    max_storage_bytes: Mapped[int | None] = mapped_column(BigInteger)
    # Requests in flight at once through one gateway replica; None: the replica's default
    # (LORAPLEX_TENANT_MAX_IN_FLIGHT), never unlimited.
    max_in_flight: Mapped[int | None]
    # Adapter versions pinned resident on the engines at once; None: unlimited.
    max_pinned_adapters: Mapped[int | None] = mapped_column(default=2, server_default="2")

    tenant: Mapped[Tenant] = relationship(back_populates="quota")


class StorageUsage(Base):
    """How many adapters (names) a tenant has and the bytes all their versions take: the counters its
    storage quotas are enforced on, each change a single conditional UPDATE, so parallel uploads cannot
    overshoot."""

    __tablename__ = "storage_usage"

    tenant_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True
    )
    adapters: Mapped[int] = mapped_column(default=0)
    bytes: Mapped[int] = mapped_column(BigInteger, default=0)


class Artifact(Base):
    """One adapter in the artifact store, shared by every adapter row with its digest. `refcount` counts
    those rows; at zero the object is deleted from the store and then this row (services/adapters.py)."""

    __tablename__ = "artifacts"

    digest: Mapped[str] = mapped_column(String(64), primary_key=True)
    # Where the store keeps it; set when an upload reserves the row, before the object is written, so
    # an upload cut short still leaves a row that says what to clean up.
    uri: Mapped[str] = mapped_column(Text)
    bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    refcount: Mapped[int] = mapped_column(default=0)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class RateWindow(Base):
    """Requests and tokens of one tenant in one wall-clock minute, shared by every gateway replica."""

    __tablename__ = "rate_windows"

    tenant_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True
    )
    minute: Mapped[int] = mapped_column(BigInteger, primary_key=True)  # unix time // 60
    requests: Mapped[int] = mapped_column(default=0)
    tokens: Mapped[int] = mapped_column(BigInteger, default=0)


class UsageRecord(Base):
    __tablename__ = "usage_records"
    __table_args__ = (Index("ix_usage_records_tenant_day", "tenant_id", "day"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    tenant_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    api_key_id: Mapped[uuid.UUID | None] = mapped_column(ForeignKey("api_keys.id", ondelete="SET NULL"))
    adapter_id: Mapped[uuid.UUID | None] = mapped_column(ForeignKey("adapters.id", ondelete="SET NULL"))
    # The model the tenant asked for, kept after the adapter is deleted.
    model: Mapped[str] = mapped_column(String(256))
    # The adapter version that served it (a name's requests may be split between versions); None: the
    # base model, or a record from before versions.
    adapter_version: Mapped[int | None]
    endpoint: Mapped[str] = mapped_column(String(64))
    prompt_tokens: Mapped[int] = mapped_column(default=0)
    completion_tokens: Mapped[int] = mapped_column(default=0)
    # Prompt tokens the engine served from its prefix cache (usage.prompt_tokens_details.cached_tokens).
    cached_tokens: Mapped[int] = mapped_column(default=0, server_default="0")
    # False when the counts are estimated (no usage came back from the engine).
    exact: Mapped[bool] = mapped_column(default=True)
    latency_ms: Mapped[int] = mapped_column(default=0)
    status: Mapped[str] = mapped_column(String(32))
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    day: Mapped[dt.date] = mapped_column(Date)


class UserRole(enum.StrEnum):
    ADMIN = "admin"  # runs the platform: tenants, quotas, deployments, users
    MEMBER = "member"  # works inside one tenant: keys, adapters, playground, usage


class User(Base):
    """A person who signs in to the console: a tenant's member, or a platform admin."""

    __tablename__ = "users"

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=uuid.uuid4)
    # Stored lowercased, so sign-in does not depend on how the address was typed.
    email: Mapped[str] = mapped_column(String(320), unique=True)
    # argon2id in its encoded form (parameters and salt included); never the password itself.
    password_hash: Mapped[str] = mapped_column(String(256))
    role: Mapped[UserRole] = mapped_column(
        Enum(UserRole, name="user_role", values_callable=lambda e: [m.value for m in e]),
        default=UserRole.MEMBER,
    )
    # Members belong to one tenant; an admin may have none.
    tenant_id: Mapped[uuid.UUID | None] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), index=True
    )
    disabled: Mapped[bool] = mapped_column(default=False)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    last_sign_in_at: Mapped[dt.datetime | None]

    tenant: Mapped[Tenant | None] = relationship()


class ConsoleSession(Base):
    """A signed-in browser. The cookie holds a random token; only its sha256 is stored here."""

    __tablename__ = "console_sessions"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    user_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"), index=True)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[dt.datetime]


class SignInFailures(Base):
    """Sign-in attempts of one subject (an email or a client address) in its current window: each is
    counted before its password is checked; a successful one is given back."""

    __tablename__ = "sign_in_failures"

    subject: Mapped[str] = mapped_column(String(400), primary_key=True)
    # Indexed: every sign-in attempt sweeps the windows that have ended.
    window_started_at: Mapped[dt.datetime] = mapped_column(index=True)
    failures: Mapped[int] = mapped_column(default=0)

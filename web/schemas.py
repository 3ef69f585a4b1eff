"""Request and response bodies, one per use; ORM rows never leave the services unconverted."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Annotated

from pydantic import (
    AnyHttpUrl,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    TypeAdapter,
    ValidationError,
    model_validator,
)

from .db.models import KeyScope
from .services.discovery import is_kubernetes_uri, parse_target
from .services.endpoint_policy import endpoint_problem

Name = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")]
# A version's weight in a traffic split.
WeightValue = Annotated[int, Field(ge=0, le=1_000_000)]
# The longest overlap a rotated key keeps working beside its successor: 30 days.
MAX_ROTATION_OVERLAP_S = 30 * 24 * 3600
# Free text stored or looked up: no control characters (Postgres text cannot hold NUL, logs should not).
PRINTABLE = r"^[^\x00-\x1f\x7f]+$"
Label = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=PRINTABLE)]
Count = Annotated[int, Field(ge=0, le=2**31 - 1)]
Bytes = Annotated[int, Field(ge=0, le=2**62)]
Positive = Annotated[int, Field(ge=1, le=2**20)]
# A tenant's share of a busy engine relative to others: 2 gets twice the tokens of 1 when both wait.
ShareWeight = Annotated[
    float,
    Field(
        gt=0,
        le=1000,
        allow_inf_nan=False,
        description="The tenant's share of a busy engine relative to other tenants (default 1).",
    ),
]


class Public(BaseModel):
    model_config = ConfigDict(from_attributes=True)


class QuotaUpdate(BaseModel):
    """Limits of a tenant; null means unlimited (max_in_flight: the gateway's default)."""

    requests_per_minute: Count | None = None
    tokens_per_minute: Count | None = None
    max_adapters: Count | None = None
    max_adapter_bytes: Bytes | None = None
    max_storage_bytes: Bytes | None = Field(
        default=None, description="Total bytes of the tenant's adapters (config and weights); null: no limit."
    )
    max_in_flight: Count | None = Field(
        default=None,
        description="Requests in flight at once through one gateway replica; null: the gateway's default "
        "(LORAPLEX_TENANT_MAX_IN_FLIGHT), never unlimited.",
    )
    max_pinned_adapters: Count | None = Field(
        default=2,
        description="Adapter versions the tenant may pin resident on the engines at once (2 unless set); "
        "null: no limit.",
    )


class QuotaPublic(Public, QuotaUpdate):
    pass


class TenantCreate(BaseModel):
    name: Name
    fair_share_weight: ShareWeight = 1.0


class TenantUpdate(BaseModel):
    name: Name | None = None
    disabled: bool | None = None
    fair_share_weight: ShareWeight | None = None


class TenantPublic(Public):
    id: uuid.UUID
    name: str
    disabled: bool
    fair_share_weight: float
    created_at: dt.datetime
    quota: QuotaPublic


# The adapters one key may be limited to: a bounded list of adapter names.
MAX_KEY_ADAPTERS = 256


class KeyCreate(BaseModel):
    name: Label
    expires_at: dt.datetime | None = None
    scope: KeyScope = Field(
        default=KeyScope.ALL,
        description="`all`: manage, read and call models; `inference`: call models only; "
        "`read`: listings and usage only.",
    )
    adapters: list[Name] | None = Field(
        default=None,
        max_length=MAX_KEY_ADAPTERS,
        description="The adapter names the key may use; null: every adapter of the tenant.",
    )
    base_model: bool | None = Field(
        default=None,
        description="Whether the key may call the base models; default: yes without an adapter list, "
        "no with one.",
    )


class KeyRotate(BaseModel):
    overlap_seconds: int = Field(
        default=0,
        ge=0,
        le=MAX_ROTATION_OVERLAP_S,
        description="How long the old key stays valid beside the new one (never past its own expiry).",
    )


class KeyPublic(Public):
    id: uuid.UUID
    name: str
    prefix: str = Field(description="The key's first characters, to recognise it; not a secret.")
    created_at: dt.datetime
    expires_at: dt.datetime | None
    revoked_at: dt.datetime | None
    last_used_at: dt.datetime | None
    scope: KeyScope = KeyScope.ALL
    adapters: list[str] | None = Field(default=None, description="null: every adapter of the tenant.")
    base_model: bool = True


class KeyCreated(KeyPublic):
    key: str = Field(description="The secret key, shown this once; only a keyed hash of it is kept.")


class BaseShapeIn(BaseModel):
    num_layers: Positive
    hidden_size: Positive
    intermediate_size: Positive
    q_size: Positive
    kv_size: Positive


_HTTP_URL: TypeAdapter[AnyHttpUrl] = TypeAdapter(AnyHttpUrl)


def _endpoint(value: object) -> str:
    """An engine replica URL, or `kubernetes://<namespace>/<name>` for the pods discovery finds."""
    if not isinstance(value, str):
        raise ValueError("an endpoint is a string")
    if len(value) > 2048:
        raise ValueError("an endpoint is at most 2048 characters")
    if is_kubernetes_uri(value):
        return parse_target(value).uri
    try:
        url = _HTTP_URL.validate_python(value)
    except ValidationError as exc:
        raise ValueError(
            f"{value[:100]!r} is neither an http(s):// URL nor kubernetes://<namespace>/<name> "
            f"({exc.errors()[0]['msg']})"
        ) from None
    if url.query or url.fragment:
        raise ValueError(f"{value[:100]!r}: an endpoint URL has no query or fragment")
    # Loopback depends on a setting, so the service checks it (deployments.check_endpoints).
    problem = endpoint_problem(str(url), allow_loopback=True)
    if problem is not None:
        raise ValueError(f"{value[:100]!r} {problem}")
    return str(url).rstrip("/")


Endpoint = Annotated[
    str,
    BeforeValidator(_endpoint),
    Field(
        description="http(s)://host:port of one engine replica, or kubernetes://<namespace>/"
        "<inferencedeployment> for the ready pods the control plane discovers."
    ),
]
Endpoints = Annotated[list[Endpoint], Field(max_length=256)]


class DeploymentCreate(BaseModel):
    name: Name
    base_model: Annotated[str, StringConstraints(min_length=1, max_length=256, pattern=PRINTABLE)]
    endpoints: Endpoints
    shape: BaseShapeIn | None = Field(
        default=None, description="The base model's shapes; omit for a model the control plane knows."
    )


class DeploymentUpdate(BaseModel):
    """What an admin may change in place: the replicas (the base model and shapes fix the adapters)."""

    endpoints: Endpoints


class ReplicaPublic(BaseModel):
    """One replica the gateway may route to now."""

    endpoint: str | None = Field(description="Its URL; null for a pod that has no IP yet.")
    pod: str | None = Field(description="The engine pod's name; null for a static endpoint.")
    ready: bool | None = Field(
        description="Whether discovery counts it ready; null for a static endpoint (tried, not watched)."
    )
    detail: str


class DeploymentPublic(Public):
    id: uuid.UUID
    name: str
    base_model: str
    endpoints: list[str]
    replicas: list[ReplicaPublic] = Field(
        default_factory=list, description="What the endpoints stand for now (discovered pods, static URLs)."
    )
    discovery: str | None = Field(
        default=None, description="For kubernetes:// endpoints: whether the pods are followed, or why not."
    )
    shape: BaseShapeIn
    created_at: dt.datetime


class AdapterPublic(Public):
    """An adapter as one of its versions: the active one, unless a version was asked for."""

    id: uuid.UUID = Field(description="The version's id (each version is its own adapter on the engines).")
    name: str
    version: int = Field(description='Request exactly this version as `model: "<name>@<version>"`.')
    deployment: str
    base_model: str
    status: str
    error: str | None
    rank: int | None
    target_modules: list[str]
    bytes: int
    sha256: str | None
    uploaded_by: str | None = Field(description="The key or console user that uploaded this version.")
    created_at: dt.datetime
    traffic: dict[str, int] | None = Field(
        default=None,
        description="The name's canary split, {version: weight}; null: all go to the active version.",
    )
    sticky: bool = Field(default=True, description="Whether a split keeps each `user` on one version.")
    pinned: bool = Field(default=False, description="Whether this version is pinned resident on the engines.")


class AdapterVersionPublic(Public):
    """One version of an adapter, as `GET /api/v1/adapters/{name}/versions` lists them."""

    id: uuid.UUID
    version: int
    active: bool = Field(description="Whether the bare name addresses this version.")
    weight: int | None = Field(
        default=None, description="Its weight in the name's traffic split; null: no split."
    )
    status: str
    error: str | None
    sha256: str | None = Field(description="The whole adapter's content digest: the version's identity.")
    bytes: int
    rank: int | None
    uploaded_by: str | None
    created_at: dt.datetime
    pinned: bool = Field(default=False, description="Whether it is pinned resident on the engines.")


class TrafficSplit(BaseModel):
    """How the bare name's requests are shared between ready versions, by weight."""

    traffic: dict[Annotated[str, StringConstraints(pattern=r"^[1-9][0-9]{0,8}$")], WeightValue] = Field(
        min_length=1,
        max_length=16,
        description='{"<version>": weight}: e.g. {"1": 90, "2": 10}. Weights are relative (at least one '
        "above 0).",
    )
    sticky: bool = Field(
        default=True,
        description="A request carrying OpenAI's `user` always gets the same version while the split stands.",
    )

    @model_validator(mode="after")
    def _some_weight(self) -> TrafficSplit:
        if not any(self.traffic.values()):
            raise ValueError("at least one version needs a weight above 0")
        return self

    def versions(self) -> dict[int, int]:
        return {int(v): w for v, w in self.traffic.items()}


class AdapterPin(BaseModel):
    """Which version to pin resident on the engines; omitted: the active one."""

    version: int | None = Field(default=None, ge=1, le=2**31 - 1)


class AdapterRollback(BaseModel):
    """Which version the bare name should address; omitted: the newest ready version before the active."""

    version: int | None = Field(default=None, ge=1, le=2**31 - 1)


class StorageUsagePublic(BaseModel):
    """A tenant's adapters and the bytes they take, beside the quotas they count against (null: unlimited)."""

    adapters: int
    max_adapters: int | None
    bytes: int = Field(description="Config and weights of all the tenant's adapters (copies count again).")
    max_storage_bytes: int | None


class UsageRow(BaseModel):
    day: dt.date
    model: str = Field(description="The adapter (or base model) the requests named.")
    version: int | None = Field(
        default=None,
        description="With by_version: the adapter version that served them (null: the base model).",
    )
    requests: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = Field(default=0, description="Prompt tokens the engine took from its prefix cache.")


class UsageSummary(BaseModel):
    since: dt.date
    rows: list[UsageRow]
    requests: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


class Health(BaseModel):
    status: str
    database: bool


class Liveness(BaseModel):
    status: str

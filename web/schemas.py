"""Request and response bodies, one per use; ORM rows never leave the services unconverted."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Annotated

from pydantic import AnyHttpUrl, BaseModel, ConfigDict, Field, StringConstraints

Name = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")]
# Free text stored or looked up: no control characters (Postgres text cannot hold NUL, logs should not).
PRINTABLE = r"^[^\x00-\x1f\x7f]+$"
Label = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=PRINTABLE)]
Count = Annotated[int, Field(ge=0, le=2**31 - 1)]
Bytes = Annotated[int, Field(ge=0, le=2**62)]
Positive = Annotated[int, Field(ge=1, le=2**20)]


class Public(BaseModel):
    model_config = ConfigDict(from_attributes=True)


class QuotaUpdate(BaseModel):
    """Limits of a tenant; null means unlimited."""

    requests_per_minute: Count | None = None
    tokens_per_minute: Count | None = None
    max_adapters: Count | None = None
    max_adapter_bytes: Bytes | None = None


class QuotaPublic(Public, QuotaUpdate):
    pass


class TenantCreate(BaseModel):
    name: Name


class TenantUpdate(BaseModel):
    name: Name | None = None
    disabled: bool | None = None


class TenantPublic(Public):
    id: uuid.UUID
    name: str
    disabled: bool
    created_at: dt.datetime
    quota: QuotaPublic


class KeyCreate(BaseModel):
    name: Label
    expires_at: dt.datetime | None = None


class KeyPublic(Public):
    id: uuid.UUID
    name: str
    prefix: str = Field(description="The key's first characters, to recognise it; not a secret.")
    created_at: dt.datetime
    expires_at: dt.datetime | None
    revoked_at: dt.datetime | None
    last_used_at: dt.datetime | None


class KeyCreated(KeyPublic):
    key: str = Field(description="The secret key, shown this once; only a keyed hash of it is kept.")


class BaseShapeIn(BaseModel):
    num_layers: Positive
    hidden_size: Positive
    intermediate_size: Positive
    q_size: Positive
    kv_size: Positive


class DeploymentCreate(BaseModel):
    name: Name
    base_model: Annotated[str, StringConstraints(min_length=1, max_length=256, pattern=PRINTABLE)]
    endpoints: Annotated[list[AnyHttpUrl], Field(max_length=256)]
    shape: BaseShapeIn | None = Field(
        default=None, description="The base model's shapes; omit for a model the control plane knows."
    )


class DeploymentPublic(Public):
    id: uuid.UUID
    name: str
    base_model: str
    endpoints: list[str]
    shape: BaseShapeIn
    created_at: dt.datetime


class AdapterPublic(Public):
    id: uuid.UUID
    name: str
    deployment: str
    base_model: str
    status: str
    error: str | None
    rank: int | None
    target_modules: list[str]
    bytes: int
    sha256: str | None
    created_at: dt.datetime


class UsageRow(BaseModel):
    day: dt.date
    model: str = Field(description="The adapter (or base model) the requests named.")
    requests: int
    prompt_tokens: int
    completion_tokens: int


class UsageSummary(BaseModel):
    since: dt.date
    rows: list[UsageRow]
    requests: int
    prompt_tokens: int
    completion_tokens: int


class Health(BaseModel):
    status: str
    database: bool


class Liveness(BaseModel):
    status: str

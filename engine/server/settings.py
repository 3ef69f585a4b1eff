"""The server's options: command-line flags over LORAPLEX_* environment variables over defaults.

The operator starts `loraplex serve --model URI --dtype T --port 8000` with its tuning knobs in a
ConfigMap (operator/resources.py), so every knob here also reads from the environment. Variables this
server does not know (LORAPLEX_MODEL_FORMAT, LORAPLEX_DATABASE_URL, ...) are ignored: the same
ConfigMap feeds other programs.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from loraplex import wire

if TYPE_CHECKING:
    from loraplex.engine.config import EngineConfig

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ServerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LORAPLEX_", extra="ignore", env_ignore_empty=True)

    model: str | None = Field(
        default=None,
        description="a .gguf file or Hugging Face directory (path or file:// URI), "
        "s3://bucket/key-or-prefix/, or hf://org/name[@revision]",
    )
    # Where s3:// and hf:// models are downloaded once and re-used (LORAPLEX_MODEL_CACHE; the loader reads
    # the same variable). Unset: ~/.cache/loraplex/models.
    model_cache: Path | None = None
    served_model_name: str | None = Field(default=None, description="the base model's id in the API")
    host: str = "0.0.0.0"
    port: int = Field(default=8000, ge=0, le=65535)
    device: str = "auto"
    dtype: str = "auto"
    seed: int = 0
    page_size: int = Field(default=16, ge=1)
    num_pages: int | None = Field(default=None, ge=2)
    kv_cache_bytes: int = Field(default=1 << 30, ge=1)
    pool_fraction: float = Field(default=0.85, gt=0.0, lt=1.0)
    max_num_seqs: int = Field(default=64, ge=1)
    max_batch_tokens: int = Field(default=1024, ge=1)
    max_model_len: int | None = Field(default=None, ge=2)
    max_resident_adapters: int | None = Field(default=None, ge=1)
    adapter_host_cache_bytes: int | None = Field(default=None, ge=1)
    max_queue: int = Field(default=256, ge=1, description="requests waiting to be scheduled before 429")
    internal_token: SecretStr | None = None
    # The artifact store (LORAPLEX_ADAPTER_STORE, the control plane's setting too): a directory, file://...
    # or s3://bucket/prefix. Set, adapters are fetched from it only (other URIs are refused), into
    # adapter_cache_dir() for s3://; relative adapter URIs resolve under it.
    adapter_store: str | None = Field(default=None, description="where adapters are fetched from")
    # An S3-compatible service other than AWS (MinIO, Ceph RGW); credentials come from AWS_* variables.
    s3_endpoint_url: str | None = None
    adapters: list[str] = Field(default_factory=list, description="NAME=PATH_OR_URI[@SHA256] at start")
    drain_timeout_s: float = Field(default=30.0, ge=0.0)
    tenant_label_limit: int = Field(default=64, ge=0, description="tenants with their own metrics label")

    @field_validator("model")
    @classmethod
    def _model_uri_is_well_formed(cls, value: str | None) -> str | None:
        if value is not None:
            from loraplex.engine.model.sources import check_model_uri

            check_model_uri(value)  # a malformed URI fails now, not after the server is up
        return value

    @field_validator("internal_token")
    @classmethod
    def _blank_token_is_none(cls, value: SecretStr | None) -> SecretStr | None:
        return value if value is not None and value.get_secret_value().strip() else None

    @field_validator("adapters")
    @classmethod
    def _adapters_are_pairs(cls, value: list[str]) -> list[str]:
        for item in value:
            parse_adapter_arg(item)
        return value

    @property
    def model_name(self) -> str:
        """The id clients send as `model` for the base model (and /v1/models lists)."""
        if self.served_model_name:
            return self.served_model_name
        if self.model is None:
            return DEFAULT_MODEL_NAME
        from loraplex.engine.model.sources import served_name

        return served_name(self.model)

    def start_adapters(self) -> list[tuple[str, str, str | None]]:
        return [parse_adapter_arg(item) for item in self.adapters]

    def adapter_cache_dir(self) -> Path:
        """Where adapters fetched from an s3:// store are kept: in the model cache (LORAPLEX_MODEL_CACHE, a
        volume on a cluster), else ~/.cache/loraplex/adapters."""
        if self.model_cache is not None:
            return self.model_cache / "loraplex-adapters"
        return Path.home() / ".cache/loraplex/adapters"

    def resolve_adapter_uri(self, uri: str) -> str:
        """A relative path names a directory under the adapter store (when one is set)."""
        if self.adapter_store is None or urlparse(uri).scheme or Path(uri).is_absolute():
            return uri
        return f"{self.adapter_store.rstrip('/')}/{uri}"

    def engine_config(self) -> EngineConfig:
        from loraplex.engine.config import EngineConfig

        wanted: dict[str, Any] = {
            "model": model_path(self.model) if self.model is not None else None,
            "model_cache": str(self.model_cache) if self.model_cache is not None else None,
            "device": self.device,
            "dtype": self.dtype,
            "seed": self.seed,
            "page_size": self.page_size,
            "num_pages": self.num_pages,
            "kv_cache_bytes": self.kv_cache_bytes,
            "gpu_memory_fraction": self.pool_fraction,
            "max_num_seqs": self.max_num_seqs,
            "max_batch_tokens": max(self.max_batch_tokens, self.max_num_seqs),
            "max_model_len": self.max_model_len,
            "max_resident_adapters": self.max_resident_adapters,
            "adapter_host_cache_bytes": self.adapter_host_cache_bytes,
        }
        known = {f.name for f in fields(EngineConfig)}
        # None means "the engine's default" for the options it has defaults for.
        return EngineConfig(**{k: v for k, v in wanted.items() if k in known and v is not None})


def model_path(model: str) -> str:
    """A file:// URI as the path it names; anything else as given (the loader explains what it cannot use)."""
    parsed = urlparse(model)
    if parsed.scheme == "file":
        return unquote(parsed.path)
    return model


def parse_adapter_arg(item: str) -> tuple[str, str, str | None]:
    """NAME=PATH_OR_URI, optionally @SHA256 at the end: (name, uri, sha256 or None)."""
    name, sep, uri = item.partition("=")
    if not sep or not name.strip() or not uri.strip():
        raise ValueError(f"adapter {item!r}: expected NAME=PATH_OR_URI (optionally @SHA256 at the end)")
    sha256: str | None = None
    head, at, tail = uri.rpartition("@")
    if at and wire.is_sha256(tail):
        uri, sha256 = head, tail.lower()
    if wire.is_gateway_adapter(name):
        raise ValueError(
            f"adapter name {name!r}: names starting with {wire.ADAPTER_NAME_PREFIX!r} are reserved for the "
            "gateway"
        )
    return name.strip(), uri.strip(), sha256

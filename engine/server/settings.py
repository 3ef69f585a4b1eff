"""The server's options: command-line flags over LORAPLEX_* environment variables over defaults.

Two kinds of option, each declared once (engine/options.py): the engine's (EngineConfig's fields,
engine/config.py) and the server's own (ServerSettings' fields below, with an `Opt` in the annotation).
ServerSettings has a field for every one of both, so `ServerSettings(max_num_seqs=8)`, the variable
`LORAPLEX_MAX_NUM_SEQS` and the flag `--max-num-seqs` are one option, converted and refused by one function.

The operator starts `loraplex serve --model URI --dtype T --port 8000` with its tuning knobs in a
ConfigMap (operator/resources.py), so every option also reads from the environment. Variables this
server does not know (LORAPLEX_MODEL_FORMAT, LORAPLEX_DATABASE_URL, ...) are ignored: the same
ConfigMap feeds other programs. A bad value in a variable it does know stops it at once, naming the variable.
"""

from __future__ import annotations

import json
import logging
import os
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any
from urllib.parse import unquote, urlparse

from pydantic import Field, SecretStr, ValidationInfo, create_model, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict
from pydantic_settings.sources import InitSettingsSource

from loraplex import wire
from loraplex.engine.config import ENGINE_OPTIONS, EngineConfig
from loraplex.engine.options import (
    ENV_PREFIX,
    Opt,
    OptionError,
    by_name,
    from_environment,
    options_of,
)
from loraplex.wire.shares import Shares

log = logging.getLogger("loraplex.engine.server")


_ENGINE_HINTS = typing.get_type_hints(EngineConfig, include_extras=True)
# Where `loraplex serve` (and `loraplex up`, which runs it) defaults otherwise than EngineConfig: the fastest
# setting the CPU supports (issue 30). EngineConfig itself keeps float32-exact defaults for code and tests
# that make engines directly; docs/configuration.md says how to get that exact mode from the CLI.
SERVE_DEFAULTS: dict[str, object] = {"quantization": "auto", "compile_decode": True}
if TYPE_CHECKING:
    # Type checkers see the two of the engine's options the server reads itself; the rest are read
    # through engine_config().

    class _EngineOptions(BaseSettings):
        model: str | None = None
        model_cache: str | None = None

else:
    # The engine's options as fields, declared by EngineConfig alone (pydantic's create_model makes them
    # from its annotations), so ServerSettings below declares only the server's own.
    _EngineOptions = create_model(
        "_EngineOptions",
        __base__=BaseSettings,
        __module__=__name__,
        **{o.name: (_ENGINE_HINTS[o.name], SERVE_DEFAULTS.get(o.name, o.default)) for o in ENGINE_OPTIONS},
    )


class ServerSettings(_EngineOptions):
    """The engine's options (from EngineConfig, above), then the server's own; and two settings that
    are not options: the internal token (a secret: variable only, never a flag that `ps` would show) and
    the start adapters (a list: `--adapter` repeated, or LORAPLEX_ADAPTERS as a JSON list)."""

    # Unknown keyword arguments are refused (a typo must not pass for a default); unknown variables are
    # never read (OptionEnvironment reads only the variables of known options).
    model_config = SettingsConfigDict(extra="forbid")

    served_model_name: Annotated[
        str | None,
        Opt(
            "the base model's id in the API",
            none="the model file's name without .gguf (org/name for hf://; the bundled SmolLM2: its HF id)",
        ),
    ] = None
    host: Annotated[str, Opt("address to listen on")] = "0.0.0.0"
    port: Annotated[int, Opt("port to listen on", minimum=0, maximum=65535)] = 8000
    max_queue: Annotated[int, Opt("requests waiting to be scheduled before new ones get 429", minimum=1)] = (
        256
    )
    # Each tenant's share of that queue (wire/shares.py; docs/security.md, "Shares").
    queue_tenant_floor: Annotated[
        int, Opt("requests each tenant may always have waiting while the queue is not full", minimum=0)
    ] = 4
    queue_reserve_fraction: Annotated[
        float,
        Opt(
            "the part of the queue kept for tenants below queue_tenant_floor, so that one tenant's flood "
            "leaves the others room",
            minimum=0,
            below=1,
        ),
    ] = 0.25
    # The artifact store (the control plane's setting too). Set, adapters are fetched from it only (other
    # URIs are refused), into adapter_cache_dir() for s3://; relative adapter URIs resolve under it.
    adapter_store: Annotated[
        str | None,
        Opt(
            "where adapters are fetched from: a directory, file://... or s3://bucket/prefix (the control "
            "plane's setting too); set, adapter URIs outside it are refused, relative ones resolve under it, "
            "and s3:// adapters are kept, verified, in <model_cache>/loraplex-adapters (else "
            "~/.cache/loraplex/adapters)",
            requirement="a directory, file:// or s3:// URI",
            none="none (any adapter path or URI)",
            metavar="URI",
        ),
    ] = None
    s3_endpoint_url: Annotated[
        str | None,
        Opt(
            "an S3-compatible service other than AWS (MinIO, Ceph RGW); credentials come from AWS_* "
            "variables",
            requirement="a URL",
            none="AWS",
            metavar="URL",
        ),
    ] = None
    drain_timeout_s: Annotated[
        float, Opt("seconds SIGTERM waits for running requests before cancelling them", minimum=0)
    ] = 30.0
    tenant_metrics: Annotated[
        bool,
        Opt(
            "count tokens per tenant on /metrics, each tenant under an opaque id (a keyed hash of it under "
            "the internal token, never its id or name)"
        ),
    ] = False
    tenant_label_limit: Annotated[
        int, Opt("tenants with a metrics label of their own (with tenant_metrics)", minimum=0)
    ] = 64
    internal_token: SecretStr | None = None
    adapters: list[str] = Field(default_factory=list, description="NAME=PATH_OR_URI[@SHA256] at start")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        given = init_settings.init_kwargs if isinstance(init_settings, InitSettingsSource) else {}
        return init_settings, OptionEnvironment(settings_cls, given)

    @model_validator(mode="before")
    @classmethod
    def _old_names(cls, values: Any) -> Any:
        """`pool_fraction=` as `gpu_memory_fraction=`; both at once is refused."""
        if not isinstance(values, dict):
            return values
        renamed: dict[str, Any] = {}
        for key, value in values.items():
            name = _BY_NAME[key].name if key in _BY_NAME else key
            if name in renamed:
                raise OptionError(f"{key} and {name} are one option ({name}); give it once")
            renamed[name] = value
        return renamed

    @field_validator("*", mode="before")
    @classmethod
    def _option_value(cls, value: Any, info: ValidationInfo) -> Any:
        option = _BY_NAME.get(info.field_name or "")
        return option.convert(value) if option is not None else value

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
        from loraplex.engine.model.sources import BUNDLED_MODEL_ID, served_name

        return BUNDLED_MODEL_ID if self.model is None else served_name(self.model)

    def queue_shares(self) -> Shares:
        return queue_shares_of(self.max_queue, self.queue_tenant_floor, self.queue_reserve_fraction)

    def start_adapters(self) -> list[wire.AdapterRegistration]:
        return [parse_adapter_arg(item) for item in self.adapters]

    def adapter_cache_dir(self) -> Path:
        """Where adapters fetched from an s3:// store are kept: in the model cache (LORAPLEX_MODEL_CACHE, a
        volume on a cluster), else ~/.cache/loraplex/adapters."""
        if self.model_cache is not None:
            return Path(self.model_cache) / "loraplex-adapters"
        return Path.home() / ".cache/loraplex/adapters"

    def resolve_adapter_uri(self, uri: str) -> str:
        """A relative path names a directory under the adapter store (when one is set)."""
        if self.adapter_store is None or urlparse(uri).scheme or Path(uri).is_absolute():
            return uri
        return f"{self.adapter_store.rstrip('/')}/{uri}"

    def engine_config(self) -> EngineConfig:
        values = {o.name: getattr(self, o.name) for o in ENGINE_OPTIONS}
        if self.model is not None:
            values["model"] = model_path(self.model)
        # The operator sets LORAPLEX_MAX_BATCH_TOKENS from its CR and max_num_seqs may come from extraArgs:
        # a pair the engine would refuse is settled here, towards the larger, rather than a pod that
        # cannot start (docs/server.md says so).
        if values["max_batch_tokens"] < values["max_num_seqs"]:
            log.warning(
                "max_batch_tokens %d is below max_num_seqs %d: raised to %d so every running request can "
                "decode in one step",
                values["max_batch_tokens"],
                values["max_num_seqs"],
                values["max_num_seqs"],
            )
            values["max_batch_tokens"] = values["max_num_seqs"]
        return EngineConfig(**values)


class OptionEnvironment(PydanticBaseSettingsSource):
    """LORAPLEX_<NAME> for every option (and its old names), through the option's own conversion, so a
    bad variable is refused with the same words as a bad flag, naming the variable. Options given as
    keyword arguments (flags) are not read: they win. LORAPLEX_INTERNAL_TOKEN and LORAPLEX_ADAPTERS (a
    JSON list) are read as they are."""

    def __init__(self, settings_cls: type[BaseSettings], given: dict[str, Any]):
        super().__init__(settings_cls)
        self.given = given

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # __call__ reads every variable at once

    def __call__(self) -> dict[str, Any]:
        given = {_BY_NAME[key].name if key in _BY_NAME else key for key in self.given}
        values = from_environment(ALL_OPTIONS, os.environ, skip=given)
        token = os.environ.get(f"{ENV_PREFIX}INTERNAL_TOKEN")
        if token and "internal_token" not in given:
            values["internal_token"] = token
        adapters = os.environ.get(f"{ENV_PREFIX}ADAPTERS", "").strip()
        if adapters and "adapters" not in given:
            values["adapters"] = _json_list(f"{ENV_PREFIX}ADAPTERS", adapters)
        return values


def _json_list(variable: str, text: str) -> list[str]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise OptionError(f'{variable} must be a JSON list of strings such as ["name=/path"], got {text!r}')
    return value


# The server's own options, as declared above (its fields less the engine's); then every option
# `loraplex serve` takes.
_ENGINE_NAMES = frozenset(o.name for o in ENGINE_OPTIONS)
SERVER_OPTIONS = tuple(o for o in options_of(ServerSettings) if o.name not in _ENGINE_NAMES)
ALL_OPTIONS = (*ENGINE_OPTIONS, *SERVER_OPTIONS)
_BY_NAME = by_name(ALL_OPTIONS)


def queue_shares_of(
    max_queue: int, floor: int | None = None, reserve_fraction: float | None = None
) -> Shares:
    """Each tenant's share of a waiting queue of `max_queue`: the options' defaults where not given."""
    fields = ServerSettings.model_fields
    return Shares.of(
        max_queue,
        fields["queue_tenant_floor"].default if floor is None else floor,
        fields["queue_reserve_fraction"].default if reserve_fraction is None else reserve_fraction,
        "requests waiting on this engine",
    )


def model_path(model: str) -> str:
    """A file:// URI as the path it names; anything else as given (the loader explains what it cannot use)."""
    parsed = urlparse(model)
    if parsed.scheme == "file":
        return unquote(parsed.path)
    return model


def parse_adapter_arg(item: str) -> wire.AdapterRegistration:
    """NAME=PATH_OR_URI, optionally @SHA256 at the end (else no digest)."""
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
    return wire.AdapterRegistration(name.strip(), uri.strip(), sha256)


if __name__ == "__main__":  # `python -m loraplex.engine.server.settings`: the table docs/server.md carries
    from loraplex.engine.options import markdown_table

    print(markdown_table(SERVER_OPTIONS), end="")

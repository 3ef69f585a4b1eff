"""The gateway ↔ engine wire contract: what the control plane sends an engine, and what an engine answers.

Both sides import these names and neither spells one of them itself, so the contract cannot drift:
- headers: the internal token that makes the engine trust the others, the tenant, and the adapter (its
  id, artifact URI and content digest), built by `request_headers` and read by `adapter_from_headers`;
- references: a tenant (`TenantRef`: its id and weight) and an adapter (`AdapterRef`: id, URI, digest) as
  one value each, wherever they travel;
- adapter names: an adapter the gateway routes is registered on the engine as `id:<adapter id>`, a name
  no engine flag and no tenant body can take (`adapter_name`, `adapter_id_of`);
- errors: OpenAI's error body (`WireError`, `error_body`, `parse_error`) with the codes that say whose
  fault a failure is: `adapter_failed` (422: the gateway marks the adapter failed), `adapter_unavailable`
  (503: the store could not be read, nothing is marked), `engine_error`, and the rest below;
- the engine's internal adapter endpoints: their paths and bodies (`ADAPTERS_PATH`, `adapter_path`,
  `AdapterRegistration`, `AdapterEntry`);
- what one request may ask (wire/limits.py: the caps both hops check) and each tenant's share of a queue
  (wire/shares.py).

Plain constants, dataclasses and pure functions: no torch, no pydantic, no web framework, so the control
plane imports it without the engine's dependencies (tests/test_wire.py proves it).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypedDict
from urllib.parse import quote

# -- headers ---------------------------------------------------------------------------------------------

INTERNAL_TOKEN_HEADER = "X-Loraplex-Internal-Token"
TENANT_HEADER = "X-Loraplex-Tenant"
# The tenant's share of a busy engine against other tenants (a positive number, default 1): the engine's
# fair scheduler serves a weight-2 tenant twice the tokens of a weight-1 one while both wait.
TENANT_WEIGHT_HEADER = "X-Loraplex-Tenant-Weight"
ADAPTER_ID_HEADER = "X-Loraplex-Adapter-Id"
ADAPTER_URI_HEADER = "X-Loraplex-Adapter-Uri"
ADAPTER_SHA256_HEADER = "X-Loraplex-Adapter-Sha256"
# What only the gateway may say: an engine refuses these without the right internal token.
GATEWAY_HEADERS = (
    TENANT_HEADER,
    TENANT_WEIGHT_HEADER,
    ADAPTER_ID_HEADER,
    ADAPTER_URI_HEADER,
    ADAPTER_SHA256_HEADER,
)

# -- error types (OpenAI's `type`) and codes (its `code`) --------------------------------------------------

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"
PERMISSION_ERROR = "permission_error"
RATE_LIMITED = "rate_limit_exceeded"

# Whose fault a failed adapter is; the gateway acts on these two.
ADAPTER_FAILED = "adapter_failed"  # the adapter itself: refused until other weights come, marked failed
ADAPTER_UNAVAILABLE = "adapter_unavailable"  # its store could not be read: retry later, nothing marked
ADAPTER_FAILED_STATUS = 422
ADAPTER_UNAVAILABLE_STATUS = 503
ENGINE_ERROR = "engine_error"  # the engine failed the request (or its stream broke off)
NOT_READY = "not_ready"  # loading or draining: 503 with Retry-After
QUEUE_FULL = "queue_full"  # 429 with Retry-After
# 429 with Retry-After: the tenant holds its share of an engine's queue or a gateway's upstream
# connections already (wire/shares.py); other tenants are still admitted.
TENANT_SHARE_EXCEEDED = "tenant_share_exceeded"
# 429 with Retry-After: the gateway's cap on one tenant's, or one API key's, requests in flight.
TOO_MANY_IN_FLIGHT = "too_many_requests_in_flight"
MODEL_NOT_FOUND = "model_not_found"
ADAPTER_NOT_READY = "adapter_not_ready"  # the caller's adapter is still being uploaded (409)
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # OpenAI's code: prompt and completion past the context
LIMIT_EXCEEDED = "limit_exceeded"  # a cap of wire/limits.py
REQUEST_TOO_LARGE = "request_too_large"  # the body (413), or more tokens than a quota could ever allow
RATE_LIMIT_EXCEEDED = "rate_limit_exceeded"  # a tenant's quota
INVALID_API_KEY = "invalid_api_key"
MISSING_INTERNAL_TOKEN = "missing_internal_token"
INVALID_INTERNAL_TOKEN = "invalid_internal_token"
INTERNAL_TOKEN_NOT_CONFIGURED = "internal_token_not_configured"
ADAPTER_URI_MISSING = "adapter_uri_missing"
ADAPTER_SHA256_INVALID = "adapter_sha256_invalid"
ADAPTER_FETCH_FAILED = "adapter_fetch_failed"  # registering: nothing usable at the URI (400)
ADAPTER_INVALID = "adapter_invalid"  # registering: the artifact fails validation or its digest (422)
ADAPTER_NOT_FOUND = "adapter_not_found"  # unregistering a name the engine does not hold
UNSUPPORTED_PARAMETER = "unsupported_parameter"  # a field OpenAI defines that this server cannot honour
UNKNOWN_PARAMETER = "unknown_parameter"  # a field OpenAI's API does not define (the Responses API refuses it)


@dataclass(frozen=True)
class WireError:
    """OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""

    message: str
    type: str = INVALID_REQUEST
    code: str | None = None
    param: str | None = None

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @classmethod
    def from_body(cls, body: object) -> WireError | None:
        """The error in a parsed JSON body (or SSE event), if it holds one; odd fields read as absent."""
        error = body.get("error") if isinstance(body, dict) else None
        if not isinstance(error, dict):
            return None

        def text(key: str) -> str | None:
            value = error.get(key)
            return value if isinstance(value, str) else None

        return cls(text("message") or "", text("type") or SERVER_ERROR, text("code"), text("param"))


def route_error(status: int, method: str, path: str) -> WireError:
    """What an OpenAI API answers for a path it does not serve (404) or a method it does not take there
    (405): OpenAI's error shape, not a web framework's `{"detail": ...}`."""
    if status == 405:
        return WireError(f"Method {method} is not allowed on {path[:200]}.", INVALID_REQUEST)
    return WireError(f"Invalid URL ({method} {path[:200]})", INVALID_REQUEST)


def model_not_found(model: str) -> WireError:
    """OpenAI's answer for a model id it does not know (404)."""
    return WireError(f"The model `{model[:256]}` does not exist.", INVALID_REQUEST, MODEL_NOT_FOUND, "model")


def error_body(message: str, kind: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    return WireError(message, kind, code, param).body()


def parse_error(content: bytes) -> WireError | None:
    """The error of an OpenAI error body as bytes, if it is one (anything else, broken JSON too: None)."""
    try:
        return WireError.from_body(json.loads(content))
    except (ValueError, RecursionError):
        return None


# -- adapters on the engine --------------------------------------------------------------------------------

# An adapter the gateway routes is registered on the engine under this prefix and its id: names are the
# engine's keys for registrations and failures, and no adapter given by a flag may take one.
ADAPTER_NAME_PREFIX = "id:"
MAX_ADAPTER_NAME_CHARS = 512
MAX_ADAPTER_URI_CHARS = 4096


def adapter_name(adapter_id: uuid.UUID | str) -> str:
    """The engine's name for the gateway's adapter `adapter_id`."""
    text = str(adapter_id)
    if not text:
        raise ValueError("an adapter id must not be empty")
    return ADAPTER_NAME_PREFIX + text


def adapter_id_of(name: str) -> str | None:
    """The adapter id in an engine name the gateway made; None for any other name."""
    if not name.startswith(ADAPTER_NAME_PREFIX) or len(name) == len(ADAPTER_NAME_PREFIX):
        return None
    return name[len(ADAPTER_NAME_PREFIX) :]


def is_gateway_adapter(name: str) -> bool:
    """Whether `name` is in the gateway's part of the engine's names (reserved, hidden from /v1/models)."""
    return name.startswith(ADAPTER_NAME_PREFIX)


def is_sha256(value: str) -> bool:
    """64 hex digits, checked without a regular expression a long header could slow down."""
    return len(value) == 64 and all(c in "0123456789abcdefABCDEF" for c in value)


@dataclass(frozen=True)
class AdapterRef:
    """An adapter as the gateway hands it to an engine: its id, where its artifact is, and its digest."""

    adapter_id: str
    uri: str
    sha256: str | None = None

    @property
    def name(self) -> str:
        return adapter_name(self.adapter_id)

    def registration(self) -> AdapterRegistration:
        """How the engine registers it: under its engine name (`id:<adapter id>`)."""
        return AdapterRegistration(self.name, self.uri, self.sha256)


@dataclass(frozen=True)
class TenantRef:
    """A tenant as the gateway hands it to an engine: its id (None: no tenant, as when an engine serves
    alone) and its weight, its share of a busy engine against other tenants (TENANT_WEIGHT_HEADER)."""

    tenant_id: str | None = None
    weight: float = 1.0


class BadHeaders(ValueError):
    """Gateway headers that break the contract: `code` is the error code an engine answers (400)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def request_headers(
    internal_token: str, tenant: TenantRef, adapter: AdapterRef | None = None
) -> dict[str, str]:
    """The headers the gateway sends with a request: trust, the tenant (its id and weight), and the
    adapter when there is one."""
    if tenant.tenant_id is None:
        raise ValueError("the gateway always names the tenant it sends a request for")
    headers = {
        INTERNAL_TOKEN_HEADER: internal_token,
        TENANT_HEADER: tenant.tenant_id,
        TENANT_WEIGHT_HEADER: repr(float(tenant.weight)),
    }
    if adapter is not None:
        headers[ADAPTER_ID_HEADER] = adapter.adapter_id
        headers[ADAPTER_URI_HEADER] = adapter.uri
        if adapter.sha256:
            headers[ADAPTER_SHA256_HEADER] = adapter.sha256
    return headers


def adapter_from_headers(headers: Mapping[str, str]) -> AdapterRef | None:
    """The adapter a request's headers name (None: none named); BadHeaders when they name it badly.

    Trust is the caller's check: read these only from a request that carried the internal token."""
    adapter_id = headers.get(ADAPTER_ID_HEADER)
    if not adapter_id:
        return None
    uri = headers.get(ADAPTER_URI_HEADER)
    if not uri:
        raise BadHeaders(ADAPTER_URI_MISSING, f"{ADAPTER_ID_HEADER} needs {ADAPTER_URI_HEADER} too")
    sha256 = headers.get(ADAPTER_SHA256_HEADER) or None
    if sha256 is not None and not is_sha256(sha256):
        raise BadHeaders(ADAPTER_SHA256_INVALID, f"{ADAPTER_SHA256_HEADER} must be 64 hex digits")
    return AdapterRef(adapter_id, uri, sha256)


# -- the engine's internal adapter endpoints ----------------------------------------------------------------
# GET ADAPTERS_PATH lists {"object": "list", "data": [AdapterEntry...]}; POST ADAPTERS_PATH with an
# AdapterRegistration registers (201 Registered); DELETE adapter_path(name) unregisters (200 Unregistered:
# {"name", "deleted": true, "draining": bool}; new requests for it are refused at once, and
# while requests still use it it drains, forgotten when the last ends; 404 adapter_not_found). All need the
# internal token.

ADAPTERS_PATH = "/internal/adapters"


def adapter_path(name: str) -> str:
    """The path of one registered adapter: its name percent-encoded whole (`id:` and all)."""
    return f"{ADAPTERS_PATH}/{quote(name, safe='')}"


@dataclass(frozen=True)
class AdapterRegistration:
    """POST ADAPTERS_PATH's body. The engine validates it with a pydantic model of these fields
    (engine/server/protocol.py), capped by MAX_ADAPTER_NAME_CHARS and MAX_ADAPTER_URI_CHARS."""

    name: str
    uri: str
    sha256: str | None = None

    def body(self) -> dict[str, Any]:
        return {"name": self.name, "uri": self.uri, "sha256": self.sha256}


class AdapterEntry(TypedDict):
    """One adapter in GET ADAPTERS_PATH's list."""

    name: str
    sha256: str
    resident: bool  # its weights are in the device pool now
    failed: str | None  # why the engine refuses these weights, if it does
    # Since it was registered on this engine: requests admitted with it, those of them that waited for its
    # weights to be loaded into the pool (a cold load on the request path), and its loads into the pool.
    admissions: int
    cold_admissions: int
    loads: int
    pinned: bool  # kept resident until unpinned (PINS_PATH)


class Registered(TypedDict):
    """POST ADAPTERS_PATH's answer: the digest of the weights the engine registered."""

    name: str
    sha256: str
    registered: bool


# POST PREWARM_PATH with an AdapterRegistration registers the adapter where needed (as a request's adapter
# headers would) and loads it before any request asks: a pod that joins an adapter's replica set takes its
# traffic only after this answers (200 Prewarmed). Errors as a request's: adapter_failed (the adapter is at
# fault), adapter_unavailable (its store did not answer).
PREWARM_PATH = "/internal/prewarm"


class Prewarmed(TypedDict):
    """POST PREWARM_PATH's answer. `level`: "device" (in the pool now) or "host" (the pool had no pages to
    spare without taking them from requests: its host copy is packed, a request pays only the copy in)."""

    name: str
    sha256: str
    level: str


# POST PINS_PATH with an AdapterRegistration registers the adapter where needed and pins it: kept resident,
# never evicted, until DELETE pin_path(name) (200 Unpinned; 404 adapter_not_found when not registered).
# Pins fit the engine's pin budget (the usable pool less one request at the full context): a pin past it is
# 409 POOL_FULL, naming the pool, and changes nothing. Errors otherwise as PREWARM_PATH's.
PINS_PATH = "/internal/pins"
POOL_FULL = "pool_full"  # a pin that would not fit the engine's pool (409)


def pin_path(name: str) -> str:
    return f"{PINS_PATH}/{quote(name, safe='')}"


class Pinned(TypedDict):
    """POST PINS_PATH's answer: `level` as Prewarmed's (a "host" pin becomes resident at its next use and
    stays)."""

    name: str
    sha256: str
    level: str
    pinned: bool


class Unpinned(TypedDict):
    name: str
    pinned: bool  # False: no longer pinned (whether or not it was)


class Unregistered(TypedDict):
    """DELETE adapter_path(name)'s answer; `draining`: requests still use it, it is forgotten after them."""

    name: str
    deleted: bool
    draining: bool

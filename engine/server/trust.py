"""Who is calling: the internal token, and the gateway headers only its holder may send.

With a token configured (LORAPLEX_INTERNAL_TOKEN, as on every cluster), nothing but /health and /ready
(kubelet's probes) is served without it: 401, compared in constant time (`InternalTokenGate`, before a
body is read). /metrics needs it too, and also reads `Authorization: Bearer` (Prometheus can send a bearer
token from a Secret but no header of ours). Without a token configured, the tenant and adapter headers and
the adapter-management endpoints are refused (`TrustGate`), and /v1/ serves the base model and the
adapters registered at start (`loraplex serve` alone).
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import SecretStr
from starlette.types import ASGIApp, Receive, Scope, Send

from loraplex import wire
from loraplex.wire.errors import OpenAIError

from .async_engine import NO_TENANT


@dataclass(frozen=True)
class Caller:
    trusted: bool  # presented the right internal token
    tenant: wire.TenantRef = NO_TENANT  # with its fair share of the engine, from the gateway


def tenant_weight(request: Request) -> float:
    """The gateway's tenant weight header (read only from the token's holder): a positive finite
    number, 1 when absent; anything else is the gateway's bug, refused with a 400 that says so."""
    raw = request.headers.get(wire.TENANT_WEIGHT_HEADER)
    if raw is None:
        return 1.0
    try:
        weight = float(raw)
    except ValueError:
        weight = float("nan")
    if not (0 < weight < float("inf")):
        raise OpenAIError(
            400, f"{wire.TENANT_WEIGHT_HEADER} must be a positive number, got {raw!r}", wire.INVALID_REQUEST
        )
    return weight


class TrustGate:
    """The routes' trust checks: who presented the internal token, and what they may send."""

    def __init__(self, token: SecretStr | None):
        self.token = token

    def presented_token(self, request: Request) -> bool:
        """True with the right internal token; False with none; a 401/403 with a wrong one."""
        presented = request.headers.get(wire.INTERNAL_TOKEN_HEADER)
        if presented is None:
            return False
        if self.token is None:
            raise OpenAIError(
                403,
                "internal headers are refused: this server has no internal token (LORAPLEX_INTERNAL_TOKEN)",
                wire.PERMISSION_ERROR,
                wire.INTERNAL_TOKEN_NOT_CONFIGURED,
            )
        if not token_matches(presented, self.token):
            raise OpenAIError(
                401, "the internal token is wrong", wire.INVALID_REQUEST, wire.INVALID_INTERNAL_TOKEN
            )
        return True

    def require_internal(self, request: Request) -> None:
        if self.token is None:
            raise OpenAIError(
                403,
                "adapter management is disabled: this server has no internal token (LORAPLEX_INTERNAL_TOKEN)",
                wire.PERMISSION_ERROR,
                wire.INTERNAL_TOKEN_NOT_CONFIGURED,
            )
        if not self.presented_token(request):
            raise OpenAIError(
                401,
                f"adapter management needs the {wire.INTERNAL_TOKEN_HEADER} header",
                wire.INVALID_REQUEST,
                wire.MISSING_INTERNAL_TOKEN,
            )

    def caller(self, request: Request) -> Caller:
        """Who is calling /v1/: with a token configured, only the holder of it (the gateway)."""
        trusted = self.presented_token(request)
        sent = [h for h in wire.GATEWAY_HEADERS if h in request.headers]
        if sent and not trusted:
            if self.token is None:
                raise OpenAIError(
                    403,
                    f"{', '.join(sent)} refused: this server has no internal token configured",
                    wire.PERMISSION_ERROR,
                    wire.INTERNAL_TOKEN_NOT_CONFIGURED,
                )
            raise OpenAIError(
                401,
                f"{', '.join(sent)} need a valid {wire.INTERNAL_TOKEN_HEADER}",
                wire.INVALID_REQUEST,
                wire.MISSING_INTERNAL_TOKEN,
            )
        if not trusted and self.token is not None:
            raise OpenAIError(
                401,
                f"this engine serves only the gateway: send the {wire.INTERNAL_TOKEN_HEADER} header",
                wire.INVALID_REQUEST,
                wire.MISSING_INTERNAL_TOKEN,
            )
        if not trusted:
            return Caller(False)
        return Caller(True, wire.TenantRef(request.headers.get(wire.TENANT_HEADER), tenant_weight(request)))


def token_matches(presented: str, token: SecretStr) -> bool:
    """Constant time in the token: a guess learns nothing from how long the answer takes."""
    return hmac.compare_digest(presented.encode(), token.get_secret_value().encode())


OPEN_PATHS = frozenset({"/health", "/ready"})  # kubelet's probes carry no token
# Behind the token like the API (it shows what each adapter and tenant is doing); Prometheus can send a
# bearer token from a Secret but no header of ours, so this path also reads `Authorization: Bearer`.
METRICS_PATH = "/metrics"


class InternalTokenGate:
    """With a token configured, every path but OPEN_PATHS answers 401 to a request without it before
    its body is read or parsed (the API, its OpenAPI document, adapter management, metrics): a stranger
    learns nothing of the API and costs the engine nothing."""

    def __init__(self, app: ASGIApp, token: SecretStr | None):
        self.app = app
        self.token = token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.token is None or scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        presented = headers.get(wire.INTERNAL_TOKEN_HEADER.lower().encode())
        metrics = scope["path"] == METRICS_PATH
        if presented is None and metrics:
            presented = bearer_token(headers.get(b"authorization"))
        if presented is not None and token_matches(presented.decode("latin-1"), self.token):
            await self.app(scope, receive, send)
            return
        missing = presented is None
        asked = f"the {wire.INTERNAL_TOKEN_HEADER} header" + (" or Authorization: Bearer" if metrics else "")
        body = wire.error_body(
            f"this engine serves only the gateway: send {asked}"
            if missing
            else "the internal token is wrong",
            wire.INVALID_REQUEST,
            wire.MISSING_INTERNAL_TOKEN if missing else wire.INVALID_INTERNAL_TOKEN,
        )
        await JSONResponse(body, 401)(scope, receive, send)


def bearer_token(authorization: bytes | None) -> bytes | None:
    """The token of an `Authorization: Bearer <token>` header (any case of the scheme); None without one."""
    if authorization is None:
        return None
    scheme, _, token = authorization.strip().partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" and token.strip() else None

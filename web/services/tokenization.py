"""The gateway's /tokenize and /detokenize (vLLM's shapes), free of HTTP: a tenant's body bounded by the
engine's caps, its `model` resolved as a completion's is (the base model or one of the tenant's own
adapters), and the request sent to one of that deployment's engines, whose answer comes back unchanged.

Every adapter of a deployment shares its base model's tokenizer, so any ready engine of the deployment
answers (the least loaded one first; the next one when a replica refuses the connection or is not serving),
and no adapter is loaded for it. Tokenizing generates nothing, so it is not metered against the token
quotas; it holds a place in flight like any request (the tenant's and the key's caps), so one tenant
cannot keep every upstream connection busy with it.

Results are completions.py's: `Completion` (the engine's JSON answer), or `Refused` / `EngineRefused`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi.concurrency import run_in_threadpool

from loraplex import wire
from loraplex.wire import limits

from ..db.session import Database
from . import gateway
from .completions import (
    NO_ANSWER,
    RETRY_AFTER_S,
    Completion,
    EngineRefused,
    Refused,
    bad_request,
    check_scope,
    not_served,
)
from .in_flight import Busy, InFlight, Ticket
from .keys import Principal
from .routing import Router
from .tenants import quota_of

log = logging.getLogger("loraplex.web.gateway")

TOKENIZE, DETOKENIZE = "tokenize", "detokenize"
TOKEN_ID = limits.Range(0, limits.MAX_TOKEN_ID, integer=True)


def check_caps(body: dict[str, Any], endpoint: str) -> None:
    """The engine's caps (wire/limits.py) on what this body holds, checked on the raw JSON before it is
    parsed further; BadRequest naming the field."""
    try:
        if endpoint == DETOKENIZE:
            tokens = body.get("tokens")
            if isinstance(tokens, list):
                limits.check_prompt_tokens("tokens", len(tokens))
                for token in tokens:
                    limits.check_number("tokens", token, TOKEN_ID)
        elif "messages" in body:
            messages = body.get("messages")
            if isinstance(messages, list):
                limits.check_chat_messages(len(messages))
            limits.check_prompt_chars("messages", gateway.content_chars(messages))
        elif isinstance(body.get("prompt"), str):
            limits.check_prompt_chars("prompt", len(body["prompt"]))
    except limits.LimitExceeded as exc:
        raise gateway.BadRequest(exc.param, str(exc), code=wire.LIMIT_EXCEEDED) from None


@dataclass(frozen=True)
class Tokenization:
    """What forwarding a tokenization needs: the database, the pooled client for the engines, the replica
    router, the engines' internal token and this replica's requests in flight."""

    db: Database
    http: httpx.AsyncClient
    router: Router
    engine_token: str
    in_flight: InFlight

    @classmethod
    def of(cls, state: Any) -> Tokenization:
        return cls(state.db, state.http, state.router, state.engine_token, state.in_flight)

    async def forward(self, principal: Principal, body: dict[str, Any], endpoint: str) -> Completion:
        """Answer `body` on `endpoint` (TOKENIZE or DETOKENIZE) for `principal`: the engine's answer, or
        Refused / EngineRefused."""
        try:
            check_caps(body, endpoint)
        except gateway.BadRequest as exc:
            raise bad_request(exc) from None
        model = body["model"]
        target, ticket = await run_in_threadpool(self._admit, principal, model)
        try:
            return await self._send(target, principal, endpoint, body)
        finally:
            ticket.release()

    def _admit(self, principal: Principal, model: str) -> tuple[gateway.Target, Ticket]:
        """The deployment `model` names for this tenant, and the request's place in flight."""
        with self.db.session() as session:
            target = gateway.resolve(session, principal.tenant_id, model)
            if target is None:  # another tenant's adapter reads exactly like a missing one
                raise Refused(404, wire.model_not_found(model))
            check_scope(principal.limits, target, model)  # a key calls only what its scope allows
            if isinstance(target, gateway.NotServed):
                raise not_served(target)
            try:
                return target, self.in_flight.enter(
                    principal, quota_of(session, principal.tenant_id).max_in_flight
                )
            except Busy as exc:
                raise Refused(429, exc.error, exc.retry_after) from None

    async def _send(
        self, target: gateway.Target, principal: Principal, endpoint: str, body: dict[str, Any]
    ) -> Completion:
        tenant = wire.TenantRef(str(principal.tenant_id), principal.fair_share_weight)
        # No adapter headers: the engine needs nothing of the adapter to tokenize, so none is loaded for it.
        headers = {**wire.request_headers(self.engine_token, tenant), "Content-Type": "application/json"}
        content = json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
        replicas = self.router.order(None, target.endpoints)
        for i, replica in enumerate(replicas):
            work = self.router.begin(replica, None)
            try:
                response = await self.http.post(f"{replica}/{endpoint}", content=content, headers=headers)
            except NO_ANSWER as exc:  # tokenizing is idempotent: the next replica may answer
                log.warning("engine replica unreachable", extra={"replica": replica, "error": repr(exc)})
                self.router.mark_down(replica)
                continue
            except httpx.TimeoutException:
                raise Refused(504, _error("The engine did not answer in time; retry later.")) from None
            except httpx.HTTPError:
                raise Refused(502, _error("The engine's answer broke off; retry later.")) from None
            finally:
                work.done()
            error = wire.parse_error(response.content) if response.status_code >= 400 else None
            if error is not None and error.code == wire.NOT_READY and i + 1 < len(replicas):
                self.router.mark_down(replica)  # loading or draining: the next replica answers
                continue
            self.router.mark_up(replica)
            media = response.headers.get("content-type", "application/json")
            if response.status_code >= 400:
                raise EngineRefused(response.status_code, response.content, media, error)
            return Completion(response.content, response.status_code, media)
        raise Refused(
            503, _error(f"No engine replica of {target.base_model} is reachable; retry later."), RETRY_AFTER_S
        )


def _error(message: str) -> wire.WireError:
    return wire.WireError(message, wire.SERVER_ERROR)

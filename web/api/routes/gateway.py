"""The OpenAI-compatible gateway's routes: key → tenant, the body bounded and validated, then the completion
service (web/services/completions.py) does the rest, and its result is answered in OpenAI's shapes."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError

from loraplex import wire
from loraplex.wire.errors import OpenAIError

from ...db.session import Database
from ...schemas import PRINTABLE
from ...services import gateway
from ...services.completions import EngineRefused, Gateway, Refused, bad_request
from ...services.keys import Principal
from ..deps import Credentials, principal_of
from ..openai_http import engine_refused, field_of, refused, respond
from ..openai_http import install_error_handlers as install_error_handlers  # create_app installs them

router = APIRouter(prefix="/v1", tags=["gateway"])


async def gateway_principal(request: Request, credentials: Credentials) -> Principal:
    principal = await run_in_threadpool(principal_of, request, credentials)
    if principal is None:
        raise OpenAIError(
            401,
            "Incorrect or missing API key: send `Authorization: Bearer lpx_...`.",
            wire.INVALID_REQUEST,
            wire.INVALID_API_KEY,
            headers={"WWW-Authenticate": "Bearer"},
        )
    return principal


GatewayTenant = Annotated[Principal, Depends(gateway_principal)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str = Field(
        min_length=1, max_length=256, pattern=PRINTABLE, description="An adapter of yours, or a base model."
    )
    stream: bool = False


class ChatCompletionRequest(_Request):
    messages: list[dict[str, Any]] = Field(min_length=1, max_length=gateway.limits.MAX_CHAT_MESSAGES)
    max_tokens: int | None = Field(default=None, ge=1, le=gateway.limits.MAX_COMPLETION_TOKENS)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=gateway.limits.MAX_COMPLETION_TOKENS)


class CompletionRequest(_Request):
    # OpenAI's four forms, as the engine takes them: a text, token ids, or a list of either. Strict, so a
    # list of numbers stays token ids and a list of texts stays texts (no coercion between them).
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]] = Field(
        union_mode="left_to_right"
    )
    # 0 only with echo (the prompt's logprobs alone, as lm-eval asks): the caps (limits.check_numbers) decide.
    max_tokens: int | None = Field(default=None, ge=0, le=gateway.limits.MAX_COMPLETION_TOKENS)


class ResponseRequest(_Request):
    """OpenAI's Responses API, stateless: checked by its chat translation (wire/responses.py) and forwarded
    to the engine's /v1/responses as sent."""

    input: StrictStr | list[dict[str, Any]]
    max_output_tokens: int | None = Field(default=None, ge=1, le=gateway.limits.MAX_COMPLETION_TOKENS)


def _documented(model: type[BaseModel]) -> dict[str, Any]:
    """The body's schema for /openapi.json: the route reads the body itself (to bound it first)."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


async def _body(request: Request, model: type[_Request]) -> dict[str, Any]:
    """The tenant's JSON, bounded and strictly parsed (no NaN, no inf), validated by `model`; what is
    forwarded is the validated dump, so a "5" for max_tokens reaches the engine as 5."""
    try:
        raw = gateway.parse_body(await request.body())
        parsed = model.model_validate(raw)
    except gateway.BadRequest as exc:
        raise refused(bad_request(exc)) from None
    except ValidationError as exc:
        first = exc.errors()[0]
        where = field_of(first) or "body"
        raise OpenAIError(400, f"{where}: {first.get('msg')}", wire.INVALID_REQUEST, param=where) from None
    return parsed.model_dump(exclude_unset=True)


@router.get("/models")
async def list_models(request: Request, principal: GatewayTenant) -> dict[str, Any]:
    db: Database = request.app.state.db

    def load() -> list[dict[str, Any]]:
        with db.session() as session:
            return gateway.list_models(session, principal.tenant_id, principal.limits)

    return {"object": "list", "data": await run_in_threadpool(load)}


@router.get("/models/{model:path}")
async def retrieve_model(model: str, request: Request, principal: GatewayTenant) -> dict[str, Any]:
    db: Database = request.app.state.db

    def load() -> dict[str, Any] | None:
        with db.session() as session:
            return gateway.find_model(session, principal.tenant_id, model, principal.limits)

    found = await run_in_threadpool(load)
    if found is None:  # another tenant's adapter (or one the key may not call) reads as a missing one
        raise OpenAIError.of(404, wire.model_not_found(model))
    return found


@router.post("/chat/completions", response_model=None, openapi_extra=_documented(ChatCompletionRequest))
async def chat_completions(request: Request, principal: GatewayTenant) -> Response:
    body = await _body(request, ChatCompletionRequest)
    return await answer(request, principal, body, "chat/completions")


@router.post("/completions", response_model=None, openapi_extra=_documented(CompletionRequest))
async def completions(request: Request, principal: GatewayTenant) -> Response:
    body = await _body(request, CompletionRequest)
    return await answer(request, principal, body, "completions")


@router.post("/responses", response_model=None, openapi_extra=_documented(ResponseRequest))
async def create_response(request: Request, principal: GatewayTenant) -> Response:
    body = await _body(request, ResponseRequest)
    return await answer(request, principal, body, gateway.RESPONSES)


async def answer(request: Request, principal: Principal, body: dict[str, Any], endpoint: str) -> Response:
    """Serve one OpenAI request for `principal` through the completion service, answered over HTTP: the
    engine's answer or stream, or an error in OpenAI's shape."""
    try:
        result = await Gateway.of(request.app.state).create(principal, body, endpoint)
    except Refused as exc:
        raise refused(exc) from None
    except EngineRefused as exc:
        return engine_refused(exc)
    return respond(result)

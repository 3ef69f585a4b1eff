"""vLLM's `POST /tokenize` and `POST /detokenize` through the gateway, per tenant model: key → tenant, the
body bounded and validated, then the tokenization service (web/services/tokenization.py) asks an engine of
the deployment `model` names. At the root, where vLLM serves them, so clients built for vLLM find them."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from loraplex import wire
from loraplex.wire import limits
from loraplex.wire.errors import OpenAIError

from ...schemas import PRINTABLE
from ...services import gateway, tokenization
from ...services.completions import EngineRefused, Refused, bad_request
from ...services.keys import Principal
from ..openai_http import completion, engine_refused, field_of, refused
from .gateway import GatewayTenant, _documented

router = APIRouter(tags=["gateway"])


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str = Field(
        min_length=1, max_length=256, pattern=PRINTABLE, description="An adapter of yours, or a base model."
    )


class TokenizeRequest(_Request):
    """A text (`prompt`), or a conversation (`messages`) rendered with the model's chat template."""

    prompt: StrictStr | None = None
    messages: list[dict[str, Any]] | None = Field(
        default=None, min_length=1, max_length=limits.MAX_CHAT_MESSAGES
    )
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool | None = None
    return_token_strs: StrictBool | None = None


class DetokenizeRequest(_Request):
    tokens: list[StrictInt] = Field(max_length=limits.MAX_PROMPT_TOKENS)


async def _body(request: Request, model: type[_Request], endpoint: str) -> dict[str, Any]:
    """The tenant's JSON, bounded by the engine's caps before it is validated by `model`."""
    try:
        raw = gateway.parse_body(await request.body())
        tokenization.check_caps(raw, endpoint)
        parsed = model.model_validate(raw)
    except gateway.BadRequest as exc:
        raise refused(bad_request(exc)) from None
    except ValidationError as exc:
        first = exc.errors()[0]
        where = field_of(first) or "body"
        raise OpenAIError(400, f"{where}: {first.get('msg')}", wire.INVALID_REQUEST, param=where) from None
    body = parsed.model_dump(exclude_unset=True)
    if endpoint == tokenization.TOKENIZE and ("prompt" in body) == ("messages" in body):
        raise OpenAIError(400, "send either prompt or messages", wire.INVALID_REQUEST, param="prompt")
    return body


@router.post("/tokenize", response_model=None, openapi_extra=_documented(TokenizeRequest))
async def tokenize(request: Request, principal: GatewayTenant) -> Response:
    body = await _body(request, TokenizeRequest, tokenization.TOKENIZE)
    return await _answer(request, principal, body, tokenization.TOKENIZE)


@router.post("/detokenize", response_model=None, openapi_extra=_documented(DetokenizeRequest))
async def detokenize(request: Request, principal: GatewayTenant) -> Response:
    body = await _body(request, DetokenizeRequest, tokenization.DETOKENIZE)
    return await _answer(request, principal, body, tokenization.DETOKENIZE)


async def _answer(request: Request, principal: Principal, body: dict[str, Any], endpoint: str) -> Response:
    try:
        result = await tokenization.Tokenization.of(request.app.state).forward(principal, body, endpoint)
    except Refused as exc:
        raise refused(exc) from None
    except EngineRefused as exc:
        return engine_refused(exc)
    return completion(result)

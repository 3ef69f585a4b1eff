"""`POST /tokenize` and `POST /detokenize` in vLLM's shapes, so benchmark clients and token counters that
ask a vLLM server for its token ids ask this one the same way.

- /tokenize takes a text (`prompt`, with `add_special_tokens`, default true) or a conversation
  (`messages`, rendered with the model's chat template: `add_generation_prompt`, default true;
  `add_special_tokens`, default false, since the template writes its own) and answers
  `{"count", "max_model_len", "tokens", "token_strs"}` (token_strs only when `return_token_strs`).
- /detokenize takes `{"tokens": [...]}` and answers `{"prompt": text}` (special tokens kept, as vLLM's).

`model` is optional, as in vLLM: the base model, or an adapter this engine serves; every adapter shares the
base model's tokenizer, so the answer is the same for each. Every field is bounded by the numbers of
wire/limits.py before any work is done (400 naming it); tokenizing is CPU work done off the event loop.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from loraplex import wire
from loraplex.wire import limits
from loraplex.wire.errors import OpenAIError

from .protocol import ChatMessage, bad_request

if TYPE_CHECKING:
    from loraplex.engine.tokenizer import Tokenizer

    from .app import ServerState
    from .async_engine import AsyncEngine

TOKENIZE_PATH = "/tokenize"
DETOKENIZE_PATH = "/detokenize"
TOKEN_ID = limits.Range(0, limits.MAX_TOKEN_ID, integer=True)


class _TokenizationRequest(BaseModel):
    # Unknown fields are ignored, as on the generation endpoints.
    model_config = ConfigDict(extra="ignore")
    model: str | None = Field(default=None, min_length=1, max_length=512)
    return_token_strs: bool = False


class TokenizeCompletionRequest(_TokenizationRequest):
    prompt: str
    add_special_tokens: bool = True

    @field_validator("prompt", mode="before")
    @classmethod
    def _bounded_prompt(cls, value: Any) -> Any:
        if isinstance(value, str):
            limits.check_prompt_chars("prompt", len(value))
        return value


class TokenizeChatRequest(_TokenizationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    # vLLM's per-request template and tools: refused (below), never rendered silently without them.
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None

    @field_validator("messages", mode="before")
    @classmethod
    def _bounded_messages(cls, value: Any) -> Any:
        if isinstance(value, list):
            limits.check_chat_messages(len(value))
        return value

    @model_validator(mode="after")
    def _bounded_conversation(self) -> TokenizeChatRequest:
        limits.check_prompt_chars("messages", sum(m.content_chars for m in self.messages))
        return self

    def refuse_unsupported(self) -> None:
        for name in ("chat_template", "chat_template_kwargs", "tools"):
            if getattr(self, name) is not None:
                raise bad_request(
                    f"{name} is not supported by this server; the model's own template is", name
                )
        if self.continue_final_message:
            raise bad_request(
                "continue_final_message is not supported by this server", "continue_final_message"
            )


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = Field(default=None, min_length=1, max_length=512)
    tokens: list[int]

    @field_validator("tokens", mode="before")
    @classmethod
    def _bounded_tokens(cls, value: Any) -> Any:
        # Counted and range-checked on the raw JSON, before pydantic converts (and pays for) each element.
        if isinstance(value, list):
            limits.check_prompt_tokens("tokens", len(value))
            for token in value:
                limits.check_number("tokens", token, TOKEN_ID)
        return value


Parsed = TypeVar("Parsed", bound=BaseModel)


def parsed(model: type[Parsed], body: Any) -> Parsed:
    """`body` validated by `model`; its errors answered as the app answers a route's own (a cap of
    wire/limits.py as a 400 naming the field)."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None


def tokenize_request(body: Any) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """The body as one of vLLM's two forms: a conversation when it holds `messages`, else a text."""
    if isinstance(body, dict) and "messages" in body:
        return parsed(TokenizeChatRequest, body)
    return parsed(TokenizeCompletionRequest, body)


def add_routes(app: FastAPI, state: ServerState) -> None:
    """The two routes on the engine's app, behind its trust checks."""

    @app.post(TOKENIZE_PATH, response_model=None)
    async def tokenize(request: Request) -> dict[str, Any]:
        caller = state.trust.caller(request)
        body = tokenize_request(await _json(request))
        engine = state.serving()
        _check_model(state, engine, body.model, caller.trusted)
        tokenizer = _tokenizer_of(engine)
        if isinstance(body, TokenizeChatRequest):
            body.refuse_unsupported()
            messages = [m.for_template(i) for i, m in enumerate(body.messages)]
            try:
                text = await asyncio.to_thread(
                    tokenizer.apply_chat_template, messages, body.add_generation_prompt
                )
            except Exception as exc:  # the template refused the conversation
                raise bad_request(f"messages: {exc}", "messages") from exc
        else:
            text = body.prompt
        ids = await asyncio.to_thread(tokenizer.encode, text, body.add_special_tokens)
        strings = None
        if body.return_token_strs:
            strings = [tokenizer.backend.id_to_token(i) or "" for i in ids]
        return {
            "count": len(ids),
            "max_model_len": engine.max_model_len,
            "tokens": ids,
            "token_strs": strings,
        }

    @app.post(DETOKENIZE_PATH, response_model=None)
    async def detokenize(request: Request) -> dict[str, Any]:
        caller = state.trust.caller(request)
        body = parsed(DetokenizeRequest, await _json(request))
        engine = state.serving()
        _check_model(state, engine, body.model, caller.trusted)
        tokenizer = _tokenizer_of(engine)
        vocab = tokenizer.vocab_size
        for i, token in enumerate(body.tokens):
            if token >= vocab:
                raise bad_request(
                    f"tokens[{i}] is {token}, not a token id of this model (its vocabulary has {vocab})",
                    "tokens",
                )
        text = await asyncio.to_thread(tokenizer.decode, body.tokens, False)
        return {"prompt": text}


async def _json(request: Request) -> Any:
    """The body as JSON (the app's BodySizeLimit has bounded it already); a 400 when it is not JSON."""
    try:
        return await request.json()
    except ValueError:
        raise bad_request("the request body is not valid JSON") from None


def _check_model(state: ServerState, engine: AsyncEngine, model: str | None, trusted: bool) -> None:
    """`model` names what this engine serves: nothing (the base model), the base model, an adapter
    registered here, or, from the gateway (trusted), whatever name it resolved for its tenant."""
    if model is None or trusted or state.registrar.is_base_model(model):
        return
    if not wire.is_gateway_adapter(model) and engine.adapter(model) is not None:
        return
    raise OpenAIError.of(404, wire.model_not_found(model))


def _tokenizer_of(engine: AsyncEngine) -> Tokenizer:
    if engine.tokenizer is None:
        raise bad_request("this model has no tokenizer, so it cannot tokenize text")
    return engine.tokenizer

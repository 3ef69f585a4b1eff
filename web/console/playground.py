"""The playground: chat with the base model or one of the tenant's adapters, tokens streaming in.

It calls the gateway's completion service (web/services/completions.py), with the signed-in user's tenant
as the principal: the same model resolution, quotas, adapter routing, streaming relay and usage record
as `/v1/chat/completions` — only authenticated by the console session (plus its CSRF token) instead
of an API key, so the browser never holds a key. Its usage rows have no key (`api_key_id` is empty).

With JavaScript the page posts JSON to /console/playground/stream and reads the server-sent events;
without it, the form posts to /console/playground and the answer arrives whole with the page.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Form, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response
from pydantic import BaseModel, Field, ValidationError

from ..api.deps import SessionDep
from ..api.openai_http import engine_refused, refused, respond
from ..services import gateway
from ..services.completions import EngineRefused, Gateway, Refused
from ..services.keys import Principal
from ..services.users import UserView
from .forms import GuardedRoute
from .rendering import render
from .security import Member, verify_csrf


class PlaygroundRoute(GuardedRoute):
    """A chat's body may be as large as the gateway accepts from any client (its body cap): a larger one
    could not be forwarded anyway."""

    max_body_bytes = gateway.MAX_REQUEST_BODY_BYTES


router = APIRouter(
    tags=["console"],
    include_in_schema=False,
    dependencies=[Depends(verify_csrf)],
    route_class=PlaygroundRoute,
)
CHAT = "chat/completions"  # the gateway endpoint the playground talks to


class Message(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str = Field(max_length=32_000)


class PlaygroundChat(BaseModel):
    model: str = Field(min_length=1, max_length=256)
    messages: list[Message] = Field(min_length=1, max_length=200)
    temperature: float = Field(default=0.7, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    max_tokens: int = Field(default=256, ge=1, le=4096)

    def openai_body(self, stream: bool) -> dict[str, Any]:
        body = self.model_dump()
        body["stream"] = stream
        if stream:  # the page shows the reply's token counts from the stream's usage chunk
            body["stream_options"] = {"include_usage": True}
        return body


def principal_of(user: UserView) -> Principal:
    assert user.tenant_id is not None and user.tenant_name is not None
    # No API key is involved: the usage record's key is left empty, which marks console traffic.
    return Principal(
        tenant_id=user.tenant_id,
        tenant_name=user.tenant_name,
        key_id=None,
        fair_share_weight=user.tenant_fair_share_weight,
    )


def _models(session: SessionDep, user: UserView) -> list[dict[str, Any]]:
    assert user.tenant_id is not None
    return gateway.list_models(session, user.tenant_id)


def _page(
    request: Request, session: SessionDep, user: UserView, status_code: int = 200, **extra: Any
) -> Response:
    models = _models(session, user)
    base = [m["id"] for m in models if m["owned_by"] != "tenant"]
    own = [m["id"] for m in models if m["owned_by"] == "tenant"]
    context = {
        "title": "Playground",
        "active": "playground",
        "base_models": base,
        "adapters": own,
        "chosen": request.query_params.get("model") or (own[0] if own else base[0] if base else ""),
        "params": {"temperature": 0.7, "top_p": 1.0, "max_tokens": 256, "system": ""},
        "history": [],
    }
    return render(request, "playground.html", {**context, **extra}, status_code)


@router.get("/console/playground")
def playground_page(request: Request, session: SessionDep, user: Member) -> Response:
    return _page(request, session, user)


@router.post("/console/playground/stream", response_model=None)
async def playground_stream(body: PlaygroundChat, request: Request, user: Member) -> Response:
    """Server-sent events exactly as the gateway relays them (OpenAI chat.completion.chunk objects)."""
    gateway_service = Gateway.of(request.app.state)
    try:
        stream = await gateway_service.stream(principal_of(user), body.openai_body(stream=True), CHAT)
    except Refused as exc:
        raise refused(exc) from None
    except EngineRefused as exc:
        return engine_refused(exc)
    return respond(stream)


@router.post("/console/playground")
async def playground_post(
    request: Request,
    user: Member,
    model: Annotated[str, Form()] = "",
    message: Annotated[str, Form()] = "",
    system: Annotated[str, Form()] = "",
    history: Annotated[str, Form()] = "[]",
    temperature: Annotated[str, Form()] = "0.7",
    top_p: Annotated[str, Form()] = "1.0",
    max_tokens: Annotated[str, Form()] = "256",
) -> Response:
    """The page without JavaScript: one turn at a time, the conversation carried in a hidden field."""
    params = {"temperature": temperature, "top_p": top_p, "max_tokens": max_tokens, "system": system}
    try:
        previous = [Message.model_validate(m) for m in json.loads(history or "[]")]
    except (ValueError, TypeError):
        previous = []
    conversation = [m for m in previous if m.role != "system"]
    if message.strip():
        conversation.append(Message(role="user", content=message))
    error = None
    try:
        chat = PlaygroundChat(
            model=model,
            messages=([Message(role="system", content=system)] if system.strip() else []) + conversation,
            temperature=float(temperature or 0.7),
            top_p=float(top_p or 1.0),
            max_tokens=int(max_tokens or 256),
        )
    except (ValidationError, ValueError):
        chat, error = None, "Choose a model, write a message, and keep the parameters within their ranges."
    if chat is not None:
        try:
            answer = await Gateway.of(request.app.state).complete(
                principal_of(user), chat.openai_body(stream=False), CHAT
            )
            content = answer.json()["choices"][0]["message"]["content"] or ""
            conversation.append(Message(role="assistant", content=content))
        except Refused as exc:
            error = exc.error.message
        except EngineRefused as exc:
            error = str(exc)  # the engine's own message, or the status it answered
        except (ValueError, KeyError, IndexError, TypeError):
            error = "The engine's answer could not be read."

    db = request.app.state.db

    def page() -> Response:
        with db.session() as session:
            return _page(
                request,
                session,
                user,
                400 if error else 200,
                chosen=model,
                params=params,
                history=[m.model_dump() for m in conversation],
                history_json=json.dumps([m.model_dump() for m in conversation]),
                error=error,
            )

    return await run_in_threadpool(page)

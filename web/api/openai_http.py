"""The gateway's answers over HTTP, in OpenAI's shapes: its errors, and the completion service's results as
responses. The gateway's route and the console's playground both answer through it."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler, request_validation_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from loraplex import wire
from loraplex.wire.errors import OpenAIError

from ..services.completions import Completion, CompletionStream, EngineRefused, Refused


def _error_response(
    status: int, message: str, kind: str, code: str | None = None, param: str | None = None, **kw: Any
) -> JSONResponse:
    return JSONResponse(wire.error_body(message, kind, code, param), status_code=status, **kw)


async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def field_of(error: Any) -> str:
    """The dotted field a pydantic error names, without the `body` root."""
    return ".".join(str(p) for p in error.get("loc", ()) if p != "body")


async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
    if _is_openai_path(request.url.path):
        first = exc.errors()[0] if exc.errors() else {"msg": "invalid request", "loc": ()}
        where = field_of(first)
        return _error_response(400, f"{where}: {first.get('msg')}", wire.INVALID_REQUEST, param=where)
    return await request_validation_exception_handler(request, exc)


# vLLM's tokenization endpoints sit at the root, beside /v1: their errors are OpenAI's shape too.
_TOKENIZATION_PATHS = frozenset({"/tokenize", "/detokenize"})


def _is_openai_path(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/") or path in _TOKENIZATION_PATHS


async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    """Under /v1 even the framework's answers (no such route: 404, a method it does not take: 405) are in
    OpenAI's shape, so an OpenAI client reads them; the other APIs keep FastAPI's `{"detail": ...}`."""
    if _is_openai_path(request.url.path) and exc.status_code in (404, 405):
        error = wire.route_error(exc.status_code, request.method, request.url.path)
        return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)
    return await http_exception_handler(request, exc)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(OpenAIError, _openai_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]


def _retry_headers(retry_after: int | None) -> dict[str, str] | None:
    return {"Retry-After": str(retry_after)} if retry_after is not None else None


def refused(exc: Refused) -> OpenAIError:
    """The gateway's verdict as the error the app's handler answers."""
    error = exc.error
    return OpenAIError(
        exc.status, error.message, error.type, error.code, error.param, _retry_headers(exc.retry_after)
    )


def engine_refused(exc: EngineRefused) -> Response:
    """The engine's error answer, its bytes unchanged, under the status the gateway gives it."""
    headers = _retry_headers(exc.retry_after)
    return Response(exc.content, status_code=exc.status, media_type=exc.media_type, headers=headers)


def completion(result: Completion) -> Response:
    return Response(result.content, status_code=result.status, media_type=result.media_type)


class Relay(StreamingResponse):
    """A completion stream passed on chunk by chunk as it arrives; closed (and so settled) when the
    response ends, however it ends: done, engine gone, client gone, or cancelled."""

    def __init__(self, stream: CompletionStream):
        self.stream = stream
        super().__init__(
            stream,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.stream.close()


def respond(result: Completion | CompletionStream) -> Response:
    return Relay(result) if isinstance(result, CompletionStream) else completion(result)

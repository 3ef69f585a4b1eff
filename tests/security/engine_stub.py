"""An engine stand-in for gateway attacks: it reads the completion limit exactly as the real engine does
(engine/server/protocol.py), produces that many tokens (the context when none is given), and can be
told to hold tokens back, die mid-stream, or refuse an adapter."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from loraplex.web.services.gateway import estimate_tokens, prompt_text

CONTEXT = 2048  # what a request without a limit may produce on the real engine


def engine_limit(body: dict[str, Any], path: str) -> int:
    """The real engine's reading: chat takes max_completion_tokens, else max_tokens; completions only
    max_tokens; neither: the rest of the context."""
    if path.endswith("/chat/completions"):
        return int(body.get("max_completion_tokens") or body.get("max_tokens") or CONTEXT)
    return int(body.get("max_tokens") or CONTEXT)


def error_body(code: str, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}


@dataclass
class Engine:
    # Tokens released so far to every stream (None: no holding back).
    allowed: int | None = None
    die_after: int | None = None  # drop the connection after this many tokens
    refuse: tuple[int, str, str] | None = None  # (status, code, message) before any token
    fail_after: tuple[int, str] | None = None  # (tokens, message): adapter_failed mid-stream
    received: list[dict[str, Any]] = field(default_factory=list)
    produced: int = 0

    def app(self) -> FastAPI:
        app = FastAPI()

        async def answer(request: Request) -> Response:
            body = await request.json()
            self.received.append({"path": request.url.path, "headers": dict(request.headers), "body": body})
            if self.refuse is not None:
                status, code, message = self.refuse
                return JSONResponse(error_body(code, message), status_code=status)
            limit = engine_limit(body, request.url.path)
            prompt = estimate_tokens(prompt_text(body))
            if body.get("stream"):
                return StreamingResponse(self._stream(body, limit, prompt), media_type="text/event-stream")
            while self.allowed is not None:  # a plain answer waits until tokens are released
                await anyio.sleep(0.01)
            self.produced += limit
            usage = {"prompt_tokens": prompt, "completion_tokens": limit, "total_tokens": prompt + limit}
            return JSONResponse(
                {
                    "id": "x",
                    "object": "text_completion",
                    "model": body["model"],
                    "usage": usage,
                    "choices": [],
                }
            )

        app.post("/v1/chat/completions")(answer)
        app.post("/v1/completions")(answer)
        return app

    async def _stream(self, body: dict[str, Any], limit: int, prompt: int) -> AsyncIterator[bytes]:
        for i in range(limit):
            while self.allowed is not None and i >= self.allowed:
                await anyio.sleep(0.01)
            if self.die_after is not None and i >= self.die_after:
                raise RuntimeError("the pod died")  # uvicorn drops the connection mid-body
            if self.fail_after is not None and i >= self.fail_after[0]:
                yield f"data: {json.dumps(error_body('adapter_failed', self.fail_after[1]))}\n\n".encode()
                yield b"data: [DONE]\n\n"
                return
            chunk = {"object": "text_completion", "choices": [{"index": 0, "text": f"t{i} "}]}
            self.produced += 1
            yield f"data: {json.dumps(chunk)}\n\n".encode()
        usage = {"prompt_tokens": prompt, "completion_tokens": limit, "total_tokens": prompt + limit}
        yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
        yield b"data: [DONE]\n\n"


class Clock:
    """A wall clock the test moves: the gateway reads `app.state.clock`."""

    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now

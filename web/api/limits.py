"""A cap on request bodies, enforced while they stream in (Content-Length alone can be absent or lie)."""

from __future__ import annotations

import json

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

DEFAULT_LIMIT = 8 * 1024 * 1024  # JSON bodies: prompts and admin requests


class _TooLarge(HTTPException):
    """An HTTPException, so body parsers pass it through as a 413 rather than a parse error."""

    def __init__(self, limit: int):
        super().__init__(413, _message(limit))


def _message(limit: int) -> str:
    return f"request body is larger than the {limit}-byte limit"


class BodySizeLimit:
    def __init__(
        self, app: ASGIApp, upload_paths: tuple[str, ...], upload_bytes: int, other_bytes: int = DEFAULT_LIMIT
    ):
        self.app = app
        self.upload_paths = upload_paths
        self.upload_bytes = upload_bytes
        self.other_bytes = other_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.upload_bytes if scope["path"] in self.upload_paths else self.other_bytes
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await _refuse(send, limit)
            return
        received = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise _TooLarge(limit)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _TooLarge:
            if not started:
                await _refuse(send, limit)


async def _refuse(send: Send, limit: int) -> None:
    body = json.dumps({"detail": _message(limit)}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 413,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})

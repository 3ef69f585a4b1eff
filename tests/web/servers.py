"""Real HTTP servers for gateway tests: any ASGI app on a 127.0.0.1 port, a stub engine, and a pod that hangs
up on every request (what a replica shutting down does to a kept-alive connection)."""

from __future__ import annotations

import json
import socket
import socketserver
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

import anyio
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .conftest import free_port


@contextmanager
def serve(app: Any) -> Iterator[str]:
    """Run `app` under uvicorn in a thread; yields its base URL; stops it on exit."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("test server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@dataclass
class StubEngine:
    """An OpenAI-compatible engine that records what it receives and streams `tokens` SSE chunks.

    With `gate` cleared, a stream stops after its first chunk (and a plain answer waits) until it is set.
    """

    name: str
    tokens: int = 4
    send_usage: bool = True
    delay_s: float = 0.0
    gate: threading.Event = field(default_factory=threading.Event)
    received: list[dict[str, Any]] = field(default_factory=list)
    chunks_sent: int = 0
    # Shutting down: every request gets the engine's 503 not_ready, as a draining `loraplex serve` answers.
    draining: bool = False

    def __post_init__(self) -> None:
        self.gate.set()

    def app(self) -> FastAPI:
        app = FastAPI()

        async def answer(request: Request) -> Response:
            body = await request.json()
            self.received.append({"path": request.url.path, "headers": dict(request.headers), "body": body})
            if self.draining:
                error = {"message": "not ready: draining", "type": "server_error", "code": "not_ready"}
                return JSONResponse({"error": error}, status_code=503, headers={"Retry-After": "1"})
            if body.get("stream"):
                return StreamingResponse(self._stream(body), media_type="text/event-stream")
            await anyio.sleep(self.delay_s)
            await anyio.to_thread.run_sync(self.gate.wait, 20)
            usage = {"prompt_tokens": 5, "completion_tokens": self.tokens, "total_tokens": 5 + self.tokens}
            return JSONResponse(
                {
                    "id": "x",
                    "object": "chat.completion",
                    "created": 0,
                    "model": body["model"],
                    "served_by": self.name,
                    "usage": usage,
                    "choices": [
                        {
                            "index": 0,
                            "finish_reason": "stop",
                            "message": {"role": "assistant", "content": "hi"},
                        }
                    ],
                }
            )

        app.post("/v1/chat/completions")(answer)
        app.post("/v1/completions")(answer)
        return app

    async def _stream(self, body: dict[str, Any]) -> AsyncIterator[bytes]:
        for i in range(self.tokens):
            chunk = {
                "id": "x",
                "object": "chat.completion.chunk",
                "created": 0,
                "model": body["model"],
                "choices": [{"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}],
            }
            # Counted before it is handed over: the client may read it before this generator resumes.
            self.chunks_sent += 1
            yield f"data: {json.dumps(chunk)}\n\n".encode()
            if i == 0:
                await anyio.to_thread.run_sync(self.gate.wait, 20)
        include = (body.get("stream_options") or {}).get("include_usage")
        if include and self.send_usage:
            usage = {"prompt_tokens": 5, "completion_tokens": self.tokens, "total_tokens": 5 + self.tokens}
            final = {
                "id": "x",
                "object": "chat.completion.chunk",
                "created": 0,
                "model": body["model"],
                "choices": [],
                "usage": usage,
            }
            yield f"data: {json.dumps(final)}\n\n".encode()
        yield b"data: [DONE]\n\n"


class HangUp(socketserver.ThreadingTCPServer):
    """Accepts a connection, reads the request and closes it without a byte of answer: httpx reports
    "Server disconnected without sending a response" (RemoteProtocolError), as it does when a pod that is
    going away drops a kept-alive connection the gateway just sent on."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        self.connections = 0

        class Handler(socketserver.BaseRequestHandler):
            def handle(inner) -> None:  # the handler's self; `self` is the server's
                self.connections += 1
                inner.request.settimeout(5)
                with suppress(OSError):
                    inner.request.recv(65536)
                inner.request.shutdown(socket.SHUT_RDWR)

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def close(self) -> None:
        self.shutdown()
        self.server_close()

"""From engine outputs to HTTP: whole OpenAI responses, SSE streams, and engine failures as errors.

A request's outputs arrive on its RequestStream. A whole answer waits for the last one; a stream sends a
chunk per output. Either way the client may hang up first: `unless_disconnected` notices while nothing
has been sent, `AbortingStreamingResponse` once streaming, and both abort the engine request so its
pages go back to the pool at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from loraplex.wire import TenantRef
from loraplex.wire.errors import OpenAIError, answer_code, failure_error

from . import protocol
from .async_engine import AsyncEngine, RequestStream

if TYPE_CHECKING:
    from loraplex.engine.request import RequestOutput, TokenLogprob
    from loraplex.engine.sampling_params import SamplingParams

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before its answer was ready; its request was aborted."""


@dataclass(frozen=True)
class Job:
    """One generation request, tokenized and resolved, ready for the engine."""

    chat: bool
    model: str  # echoed in responses: what the client asked for
    adapter: str | None  # engine adapter name; None: the base model
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    tenant: TenantRef  # with its share of a busy engine (the gateway's weight header)


def output_failure(output: RequestOutput, job: Job) -> OpenAIError | None:
    """A request the engine finished with an error: its adapter at fault (it would not load or verify,
    or failed a step on its own), its adapter's store unreachable, or the engine's own failure."""
    if output.finish_reason != "error":
        return None
    message = output.error or "the engine could not run this request"
    code = getattr(output, "error_code", None)  # engine.FailedOutput says whose fault it was
    return answer_code(code, message)


async def until_disconnected(request: Request) -> None:
    """Returns when the client hangs up (the body is read already, so receive() waits for that)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, or ClientGone as soon as the client disconnects (then `work` is cancelled)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled() or not task.done():
        raise ClientGone()
    return task.result()


class Delivery:
    """Turns a request's outputs into OpenAI responses: whole, or as stream chunks."""

    def __init__(self, job: Job, text_of: Callable[[int], str]):
        self.job = job
        self.text_of = text_of
        self.logprobs_sent = 0
        self.text_offset = 0

    def new_logprobs(self, output: RequestOutput) -> dict[str, Any] | None:
        entries = output.logprobs
        if self.job.params.logprobs is None or entries is None:
            return None
        fresh = entries[self.logprobs_sent :]
        self.logprobs_sent = len(entries)
        return self.format_logprobs(fresh)

    def format_logprobs(self, entries: list[TokenLogprob]) -> dict[str, Any]:
        if self.job.chat:
            return protocol.chat_logprobs(entries, self.text_of)
        body, self.text_offset = protocol.completion_logprobs(entries, self.text_of, self.text_offset)
        return body

    def whole(self, output: RequestOutput) -> dict[str, Any]:
        counted = protocol.usage(
            len(output.prompt_token_ids), len(output.token_ids), output.num_cached_tokens
        )
        entries = output.logprobs
        logprobs = self.format_logprobs(entries) if self.job.params.logprobs is not None and entries else None
        build = protocol.chat_response if self.job.chat else protocol.completion_response
        request_id = protocol.new_id("chatcmpl" if self.job.chat else "cmpl")
        return build(request_id, self.job.model, output.text, output.finish_reason, counted, logprobs)

    async def events(self, first: RequestOutput, stream: RequestStream) -> AsyncIterator[bytes]:
        chunks = protocol.ChunkMaker(self.job.chat, self.job.model, self.job.include_usage)
        if self.job.chat:
            yield protocol.sse(chunks.role())
        output = first
        while True:
            logprobs = self.new_logprobs(output)
            if output.new_text or logprobs is not None:
                yield protocol.sse(chunks.text(output.new_text, logprobs))
            if output.finished:
                break
            try:
                output = await stream.next()
            except Exception as exc:
                error = failure_error(exc)
                yield protocol.sse(error.body())
                return
            broken = output_failure(output, self.job)
            if broken is not None:
                yield protocol.sse(broken.body())
                return
        yield protocol.sse(chunks.text("", None, output.finish_reason or "stop"))
        if self.job.include_usage:
            counted = protocol.usage(
                len(output.prompt_token_ids), len(output.token_ids), output.num_cached_tokens
            )
            yield protocol.sse(chunks.usage(counted))
        yield protocol.SSE_DONE


class AbortingStreamingResponse(StreamingResponse):
    """A stream that aborts its engine request however it ends early: the client hanging up (the
    task is cancelled), a send failing, or the server giving up at the end of a drain."""

    def __init__(self, content: AsyncIterator[bytes], stream: RequestStream, engine: AsyncEngine):
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.request_stream, self.engine = stream, engine

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.request_stream.done:
                self.engine.abort(self.request_stream.request_id)


async def last_output(stream: RequestStream) -> RequestOutput:
    output = await stream.next()
    while not output.finished:
        output = await stream.next()
    return output

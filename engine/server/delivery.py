"""From engine outputs to HTTP: whole OpenAI responses, SSE streams, and engine failures as errors.

A request's sequences (choices.py: one per prompt and choice) each have a RequestStream. A whole answer
waits for every last output; a stream sends a chunk per output of any sequence, each chunk naming its
choice's index, and ends when all have finished. Either way the client may hang up first:
`unless_disconnected` notices while nothing has been sent, `AbortingStreamingResponse` once streaming, and
both abort the engine requests so their pages go back to the pool at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from loraplex.wire.errors import OpenAIError, answer_code, failure_error

from . import protocol
from .async_engine import AsyncEngine, RequestStream
from .choices import ChoiceText, Job, best_first, usage

if TYPE_CHECKING:
    from loraplex.engine.request import RequestOutput

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before its answer was ready; its request was aborted."""


def output_failure(output: RequestOutput, job: Job | None = None) -> OpenAIError | None:
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
    """Turns a request's sequences' outputs into OpenAI responses: whole, or as stream chunks."""

    def __init__(self, job: Job, streams: Sequence[RequestStream], text_of: Callable[[int], str]):
        if len(streams) != job.num_sequences:
            raise ValueError(f"{len(streams)} streams for {job.num_sequences} sequences")
        self.job, self.streams, self.text_of = job, list(streams), text_of

    def prompt_of(self, sequence: int) -> int:
        return sequence // self.job.best_of

    def whole(self, outputs: Sequence[RequestOutput]) -> dict[str, Any]:
        """The answer from every sequence's last output (in submission order): each prompt's returned
        choices (best_of's best n), indexed prompt * n + rank."""
        job = self.job
        groups = [list(outputs[p * job.best_of : (p + 1) * job.best_of]) for p in range(len(job.prompts))]
        choices = []
        for p, (prompt, group) in enumerate(zip(job.prompts, groups, strict=True)):
            for rank, i in enumerate(best_first(group, job.n)):
                choices.append(ChoiceText(job, prompt, p * job.n + rank, self.text_of).whole(group[i]))
        build = protocol.chat_response if job.chat else protocol.completion_response
        request_id = protocol.new_id("chatcmpl" if job.chat else "cmpl")
        return build(request_id, job.model, choices, usage(job, groups))

    async def events(self, first: tuple[int, Any], merged: Merged) -> AsyncIterator[bytes]:
        """The SSE stream: `first` (the first item `merged` gave), then the rest of `merged`. Streaming
        returns every sequence (best_of equals n: protocol.py refuses the rest), sequence i as choice i."""
        job = self.job
        chunks = protocol.ChunkMaker(job.chat, job.model, job.include_usage)
        texts = [
            ChoiceText(job, job.prompts[self.prompt_of(i)], i, self.text_of) for i in range(len(self.streams))
        ]
        last: list[RequestOutput | None] = [None] * len(self.streams)
        if job.chat:
            for i in range(len(self.streams)):
                yield protocol.sse(chunks.role(i))
        item = first
        while True:
            i, output = item
            broken = failure_event(output)
            if broken is not None:
                yield protocol.sse(broken.body())
                return
            if job.tools is not None:  # a reply is known to be a tool call only once whole: held till then
                if output.finished:
                    last[i] = output
                    reason = texts[i].finish_reason(output) or "stop"
                    for chunk in job.tools.final_chunks(chunks, output.text, reason, i):
                        yield protocol.sse(chunk)
                if all(o is not None for o in last):
                    break
                item = await merged.get()
                continue
            text, logprobs = texts[i].delta(output)
            if text or logprobs is not None:
                yield protocol.sse(chunks.text(text, logprobs, index=i))
            if output.finished:
                last[i] = output
                yield protocol.sse(chunks.text("", None, texts[i].finish_reason(output) or "stop", index=i))
            if all(o is not None for o in last):
                break
            item = await merged.get()
        if job.include_usage:
            finals = [o for o in last if o is not None]
            groups = [finals[p * job.best_of : (p + 1) * job.best_of] for p in range(len(job.prompts))]
            yield protocol.sse(chunks.usage(usage(job, groups)))
        yield protocol.SSE_DONE


def failure_event(item: RequestOutput | BaseException) -> OpenAIError | None:
    """The error a stream item reports (a failed output, or the stream's exception); None: none."""
    if isinstance(item, BaseException):
        return failure_error(item)
    return output_failure(item)


class Merged:
    """Every sequence's outputs as one queue of (sequence, output or exception), in arrival order: a
    task per stream copies its items over until its last (finished, or an exception)."""

    def __init__(self, streams: Sequence[RequestStream]):
        self.queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self.tasks = [asyncio.ensure_future(self._pump(i, s)) for i, s in enumerate(streams)]

    async def _pump(self, index: int, stream: RequestStream) -> None:
        while True:
            try:
                output = await stream.next()
            except Exception as exc:
                self.queue.put_nowait((index, exc))
                return
            self.queue.put_nowait((index, output))
            if output.finished:
                return

    async def get(self) -> tuple[int, Any]:
        return await self.queue.get()

    def close(self) -> None:
        for task in self.tasks:
            task.cancel()


class AbortingStreamingResponse(StreamingResponse):
    """A stream that aborts its engine requests however it ends early: the client hanging up (the
    task is cancelled), a send failing, or the server giving up at the end of a drain."""

    def __init__(
        self,
        content: AsyncIterator[bytes],
        streams: Sequence[RequestStream],
        engine: AsyncEngine,
        merged: Merged | None = None,
    ):
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.request_streams, self.engine, self.merged = list(streams), engine, merged

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self.merged is not None:
                self.merged.close()
            abort_unfinished(self.engine, self.request_streams)


def abort_unfinished(engine: AsyncEngine, streams: Sequence[RequestStream]) -> None:
    for stream in streams:
        if not stream.done:
            engine.abort(stream.request_id)


async def last_output(stream: RequestStream) -> RequestOutput:
    output = await stream.next()
    while not output.finished:
        output = await stream.next()
    return output


async def last_outputs(streams: Sequence[RequestStream]) -> list[RequestOutput]:
    """Every stream's last output, in order; the first exception as soon as one raises (the other waits
    are cancelled then, and when this is)."""
    tasks = [asyncio.ensure_future(last_output(s)) for s in streams]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            if task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        return [task.result() for task in tasks]
    finally:
        for task in tasks:
            task.cancel()

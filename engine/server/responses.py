"""`POST /v1/responses`: OpenAI's Responses API, stateless, on the chat path.

The body is read as the chat request it means (loraplex.wire.responses: input items as messages, function
tools, text.format as response_format; refusals and caps named by Responses field), runs as a chat job (the
same tools machinery, grammars and adapters), and its one choice is written back as a Response object:
a `message` item with `output_text`, or a `function_call` item when the reply is a call of an offered
tool. Streams are the typed events the openai SDK reads, each with its `sequence_number`: response.created,
response.in_progress, then per item output_item.added, content_part.added, output_text.delta...,
output_text.done, content_part.done, output_item.done (a call: function_call_arguments.delta and .done),
and response.completed, or response.incomplete when max_output_tokens cut the answer (as OpenAI ends it).
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from loraplex import wire
from loraplex.wire import limits
from loraplex.wire import responses as wire_responses
from loraplex.wire.responses import responses_param

from . import protocol
from .choices import ChoiceText, Job, usage
from .delivery import Delivery, Merged, failure_event
from .protocol import bad_request

if TYPE_CHECKING:
    from loraplex.engine.request import RequestOutput

    from .async_engine import RequestStream


def chat_request(body: dict[str, Any]) -> protocol.ChatCompletionRequest:
    """The chat request a Responses body means; a 400 naming the Responses field otherwise."""
    try:
        return protocol.ChatCompletionRequest.model_validate(wire_responses.to_chat(body))
    except wire_responses.Refused as exc:
        raise bad_request(str(exc), exc.param, exc.code) from None
    except limits.LimitExceeded as exc:
        raise bad_request(str(exc), wire_responses.responses_param(exc.param), wire.LIMIT_EXCEEDED) from None
    except ValidationError as exc:
        first = exc.errors()[0]
        context = first.get("ctx")
        cause = context.get("error") if isinstance(context, dict) else None
        if isinstance(cause, limits.LimitExceeded):
            param = wire_responses.responses_param(cause.param)
            raise bad_request(str(cause), param, wire.LIMIT_EXCEEDED) from None
        where = wire_responses.responses_param(".".join(str(p) for p in first.get("loc", ()))) or None
        raise bad_request(f"{where}: {first.get('msg')}" if where else str(first.get("msg")), where) from None


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesDelivery(Delivery):
    """A chat job's one sequence written as a Response: whole, or as the Responses stream events."""

    def __init__(
        self,
        body: dict[str, Any],
        job: Job,
        streams: Sequence[RequestStream],
        text_of: Callable[[int], str],
    ):
        super().__init__(job, streams, text_of)
        self.body = body
        self.id = _id("resp")
        self.created_at = int(time.time())
        self.message_id = _id("msg")

    @classmethod
    def of(
        cls, body: dict[str, Any]
    ) -> Callable[[Job, Sequence[RequestStream], Callable[[int], str]], Delivery]:
        return lambda job, streams, text_of: cls(body, job, streams, text_of)

    # -- the Response object -------------------------------------------------------------------------

    def response(
        self, status: str, output: list[dict[str, Any]], counted: dict[str, Any] | None
    ) -> dict[str, Any]:
        """The Response: what was asked echoed (OpenAI's defaults where it was not), and what came out."""
        body = self.body
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "max_tool_calls": None,
            "model": self.job.model,
            "output": output,
            "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None},
            "service_tier": "default",
            "store": False,
            "temperature": 1.0 if body.get("temperature") is None else body["temperature"],
            "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
            "tool_choice": body.get("tool_choice") or "auto",
            "tools": [self._tool(t) for t in body.get("tools") or []],
            "top_p": 1.0 if body.get("top_p") is None else body["top_p"],
            "truncation": "disabled",
            "usage": wire_responses.usage_of(counted) if counted is not None else None,
            "user": body.get("user"),
            "metadata": body.get("metadata") or {},
        }

    @staticmethod
    def _tool(tool: dict[str, Any]) -> dict[str, Any]:
        return {"description": None, "parameters": None, "strict": True, **tool}

    def message(self, text: str, status: str) -> dict[str, Any]:
        content = [self.text_part(text)] if status != "in_progress" else []
        return {
            "id": self.message_id,
            "type": "message",
            "status": status,
            "role": "assistant",
            "content": content,
        }

    @staticmethod
    def text_part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    @staticmethod
    def function_call(call: dict[str, Any]) -> dict[str, Any]:
        """A chat tool call (tools.py) as a function_call item: its id is the call_id a
        function_call_output answers."""
        function = call["function"]
        return {
            "id": _id("fc"),
            "type": "function_call",
            "status": "completed",
            "call_id": call["id"],
            "name": function["name"],
            "arguments": function["arguments"],
        }

    def outcome(self, text: str, reason: str | None) -> tuple[str, list[dict[str, Any]] | None]:
        """The Response's status and, when the reply is a call of an offered tool, its tool calls."""
        status = "incomplete" if reason == "length" else "completed"
        tools = self.job.tools
        return status, (tools.parse(text) if tools is not None and status == "completed" else None)

    def whole(self, outputs: Sequence[RequestOutput]) -> dict[str, Any]:
        output = outputs[0]
        status, calls = self.outcome(output.text, output.finish_reason)
        if calls is not None:
            items = [self.function_call(call) for call in calls]
        else:
            items = [self.message(output.text, status)]
        return self.response(status, items, usage(self.job, [[output]]))

    # -- the stream ------------------------------------------------------------------------------------

    async def events(self, first: tuple[int, Any], merged: Merged) -> AsyncIterator[bytes]:
        """The Responses events of the job's one sequence. A tool job's reply is known to be a call only
        once whole, so its text is held back until then (as chat streams hold it)."""
        numbers = itertools.count()

        def event(kind: str, **fields: Any) -> bytes:
            return protocol.sse({"type": kind, "sequence_number": next(numbers), **fields})

        start = self.response("in_progress", [], None)
        yield event("response.created", response=start)
        yield event("response.in_progress", response=start)
        choice = ChoiceText(self.job, self.job.prompts[0], 0, self.text_of)
        at = {"item_id": self.message_id, "output_index": 0}
        text, opened = "", False
        item = first
        while True:
            _, output = item
            broken = failure_event(output)
            if broken is not None:  # an `error` event the SDK raises on (its `error` object) and ends
                error = broken.body()["error"]
                yield event(
                    "error",
                    code=error["code"],
                    message=error["message"],
                    param=error["param"],
                    **broken.body(),
                )
                return
            if self.job.tools is None:
                delta, _ = choice.delta(output)
                if delta:
                    if not opened:
                        opened = True
                        for chunk in self._open_message(event):
                            yield chunk
                    text += delta
                    yield event("response.output_text.delta", **at, content_index=0, delta=delta, logprobs=[])
            if output.finished:
                break
            item = await merged.get()
        status, calls = self.outcome(output.text, output.finish_reason)
        if calls is not None:
            items = [self.function_call(call) for call in calls]
            for index, done in enumerate(items):
                for chunk in self._call_events(event, done, index):
                    yield chunk
        else:
            if self.job.tools is not None:
                text = output.text
            if not opened:
                for chunk in self._open_message(event):
                    yield chunk
                if text:
                    yield event("response.output_text.delta", **at, content_index=0, delta=text, logprobs=[])
            yield event("response.output_text.done", **at, content_index=0, text=text, logprobs=[])
            yield event("response.content_part.done", **at, content_index=0, part=self.text_part(text))
            items = [self.message(text, status)]
            yield event("response.output_item.done", output_index=0, item=items[0])
        final = self.response(status, items, usage(self.job, [[output]]))
        yield event("response.completed" if status == "completed" else "response.incomplete", response=final)

    def _open_message(self, event: Callable[..., bytes]) -> list[bytes]:
        return [
            event("response.output_item.added", output_index=0, item=self.message("", "in_progress")),
            event(
                "response.content_part.added",
                item_id=self.message_id,
                output_index=0,
                content_index=0,
                part=self.text_part(""),
            ),
        ]

    def _call_events(self, event: Callable[..., bytes], done: dict[str, Any], index: int) -> list[bytes]:
        at = {"item_id": done["id"], "output_index": index}
        return [
            event(
                "response.output_item.added",
                output_index=index,
                item={**done, "status": "in_progress", "arguments": ""},
            ),
            event("response.function_call_arguments.delta", **at, delta=done["arguments"]),
            event(
                "response.function_call_arguments.done", **at, arguments=done["arguments"], name=done["name"]
            ),
            event("response.output_item.done", output_index=index, item=done),
        ]


__all__ = ["ResponsesDelivery", "chat_request", "responses_param"]

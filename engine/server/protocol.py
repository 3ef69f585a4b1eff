"""OpenAI's API shapes: request bodies as pydantic models, responses and stream chunks as builders.

Field names, nesting and `object` values follow OpenAI's API exactly, so its client libraries (and the
control plane's gateway, which reads `usage` from the final chunk) work unchanged. Parameters this
engine cannot honour are refused with a 400 naming them rather than silently ignored.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from loraplex import wire
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.structured_output import StructuredOutput, from_response_format
from loraplex.wire import limits
from loraplex.wire.errors import OpenAIError

from .tools import ToolCalls

if TYPE_CHECKING:
    from loraplex.engine.request import TokenLogprob

# JSON has no -inf; OpenAI reports impossible tokens at this floor too.
LOGPROB_FLOOR = -9999.0


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, wire.INVALID_REQUEST, code, param)


# -- requests ---------------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _GenerationRequest(BaseModel):
    # Unknown fields (user, metadata, store, ...) are ignored, as OpenAI ignores what does not apply.
    model_config = ConfigDict(extra="ignore")

    # Numbers: each range is in limits.NUMBER_FIELDS, checked by _bounded_number on the raw JSON value.
    model: str = Field(min_length=1, max_length=512)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(default=None, description="0 or -1: no limit (an extension, as in vLLM)")
    min_p: float | None = Field(default=None, description="an extension, as in vLLM")
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # an extension (vLLM's): generate exactly max_tokens
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = Field(default=None, description="an extension, as in vLLM (1: none)")
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None  # structured outputs: engine/structured_output.py
    # An extension (loraplex's): draft tokens per step with speculative decoding, 0 turns it off for this
    # request; absent: the engine's num_speculative_tokens (docs/api.md).
    num_speculative_tokens: int | None = None

    # The caps of wire/limits.py, checked on the raw JSON before pydantic converts (and so pays for) every
    # element; a LimitExceeded reaches the client as a 400 naming the field (see app.py).
    # max_tokens is each endpoint's own: completions with echo may ask for 0.
    @field_validator(
        "temperature", "top_p", "top_k", "min_p", "seed", "n", "presence_penalty",
        "frequency_penalty", "repetition_penalty", "num_speculative_tokens", mode="before",
    )  # fmt: skip
    @classmethod
    def _bounded_number(cls, value: Any, info: ValidationInfo) -> Any:
        # A JSON number within its range, nothing pydantic would coerce ("5", true, 5.0 for an integer).
        assert info.field_name is not None
        limits.check_number(info.field_name, value)
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _bounded_stop(cls, value: Any) -> Any:
        limits.check_stop(value)
        return value

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bounded_logit_bias(cls, value: Any) -> Any:
        if value is not None and not isinstance(value, dict):
            raise limits.LimitExceeded("logit_bias", "logit_bias must be an object of token ids to numbers")
        limits.check_logit_bias(value)
        return value

    @field_validator("response_format", mode="before")
    @classmethod
    def _bounded_response_format(cls, value: Any) -> Any:
        limits.check_response_format(value)
        return value

    def structured_output(self) -> StructuredOutput | None:
        """The grammar the reply follows (None: free text)."""
        return from_response_format(self.response_format)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """What the engine is asked for: this body's fields (checked against wire/limits.py already) in the
        engine's terms, OpenAI's defaults for those not given. ValueError (a LimitExceeded naming the
        field) if they break SamplingParams' own checks."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=sampling_temperature(self.temperature),
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(0, self.top_k or 0),  # -1 is vLLM's spelling of 0: no limit
            min_p=self.min_p or 0.0,
            seed=self.seed,
            stop=self.stop_strings(),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            # JSON's keys are strings; checked as token ids (decimal digits) by _bounded_logit_bias.
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            structured=self.structured_output(),
            num_speculative_tokens=self.num_speculative_tokens,
        )

    def refuse_unsupported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")


def sampling_temperature(requested: float | None) -> float:
    """OpenAI's default is 1; a temperature too small to divide by safely means greedy."""
    if requested is None:
        return 1.0
    return 0.0 if requested < limits.MIN_SAMPLING_TEMPERATURE else requested


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="before")
    @classmethod
    def _bounded_max_tokens(cls, data: Any) -> Any:
        # Before the fields are parsed, so it sees `echo`: with it, max_tokens 0 scores the prompt only.
        if isinstance(data, dict):
            echo = data.get("echo") is True
            bound = limits.ECHO_COMPLETION_TOKENS if echo else limits.COMPLETION_TOKENS
            limits.check_number("max_tokens", data.get("max_tokens"), bound)
        return data

    @field_validator("logprobs", "best_of", mode="before")
    @classmethod
    def _bounded_completion_number(cls, value: Any, info: ValidationInfo) -> Any:
        assert info.field_name is not None
        limits.check_number(
            info.field_name, value, limits.LOGPROBS if info.field_name == "logprobs" else None
        )
        return value

    @field_validator("prompt", mode="before")
    @classmethod
    def _bounded_prompt(cls, value: Any) -> Any:
        limits.check_prompt(value)  # what parsing would cost; the form is the field's type
        return value

    @model_validator(mode="after")
    def _bounded_choices(self) -> CompletionRequest:
        limits.check_choices(limits.prompt_count(self.prompt), self.n, self.best_of)
        return self

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.suffix:
            raise bad_request("suffix is not supported by this server", "suffix")
        if self.stream and self.sequences_per_prompt > self.choices_per_prompt:
            raise bad_request("best_of must equal n when streaming: only the n returned stream", "best_of")

    @property
    def choices_per_prompt(self) -> int:
        return self.n or 1

    @property
    def sequences_per_prompt(self) -> int:
        """best_of: the sequences generated per prompt, of which the n most likely are returned."""
        return self.best_of or self.choices_per_prompt

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the prompt (and its logprobs) is the whole answer."""
        return self.echo and self.max_tokens == 0

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of this request, a text or token ids, in order (the choices' indices count them)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise bad_request("prompt is empty", "prompt")
        if isinstance(prompt[0], int):
            return [[int(t) for t in prompt]]
        return [p if isinstance(p, str) else [int(t) for t in p] for p in prompt]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str = Field(min_length=1, max_length=64)
    content: str | list[dict[str, Any]] | None = None
    name: str | None = Field(default=None, max_length=256)

    @property
    def content_chars(self) -> int:
        if isinstance(self.content, str):
            return len(self.content)
        if isinstance(self.content, list):
            return sum(len(p["text"]) for p in self.content if isinstance(p.get("text"), str))
        return 0

    def for_template(self, index: int) -> dict[str, Any]:
        """The message as a chat template expects it: role and plain-text content."""
        content = self.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad_request(
                        f"messages[{index}].content: only text parts are supported, got {part.get('type')!r}",
                        f"messages[{index}].content",
                    )
                texts.append(part["text"])
            content = "".join(texts)
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content or ""}


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[Any] | None = None

    @field_validator("max_tokens", "max_completion_tokens", "top_logprobs", mode="before")
    @classmethod
    def _bounded_chat_number(cls, value: Any, info: ValidationInfo) -> Any:
        assert info.field_name is not None
        limits.check_number(info.field_name, value)
        return value

    @field_validator("messages", mode="before")
    @classmethod
    def _bounded_messages(cls, value: Any) -> Any:
        if isinstance(value, list):
            limits.check_chat_messages(len(value))
        return value

    @model_validator(mode="after")
    def _bounded_conversation(self) -> ChatCompletionRequest:
        limits.check_prompt_chars("messages", sum(m.content_chars for m in self.messages))
        limits.check_choices(1, self.n)
        limits.check_tools(self.tools, self.tool_choice)
        return self

    @property
    def tool_calls(self) -> ToolCalls | None:
        """The tools offered and how (engine/server/tools.py); None: none."""
        return ToolCalls.of(self.tools, self.tool_choice)

    def structured_output(self) -> StructuredOutput | None:
        calls = self.tool_calls
        forced = calls.structured() if calls is not None else None
        return forced or super().structured_output()

    @property
    def choices_per_prompt(self) -> int:
        return self.n or 1

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.functions:
            raise bad_request("functions is deprecated and not supported: send tools instead", "functions")
        calls = self.tool_calls
        if calls is not None and calls.choice != "auto" and super().structured_output() is not None:
            raise bad_request(
                "response_format and a required tool call cannot both shape the reply", "response_format"
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def logprobs_wanted(self) -> int | None:
        """How many alternatives per token the engine should report (None: no logprobs at all)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.for_template(i) for i, m in enumerate(self.messages)]


class AdapterRegistration(BaseModel):
    """wire.AdapterRegistration, validated: the fields of the contract's dataclass, in its order."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=wire.MAX_ADAPTER_NAME_CHARS)
    uri: str = Field(min_length=1, max_length=wire.MAX_ADAPTER_URI_CHARS)
    sha256: str | None = Field(default=None, pattern=r"^[0-9a-fA-F]{64}$")

    def registration(self) -> wire.AdapterRegistration:
        return wire.AdapterRegistration(self.name, self.uri, self.sha256)


# -- responses ----------------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage; `cached_tokens`: prompt tokens served from the prefix cache, not computed."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def finish_reason(reason: str | None) -> str | None:
    """OpenAI knows stop and length; an aborted request reads as stopped."""
    if reason is None:
        return None
    return "length" if reason == "length" else "stop"


def _logprob(value: float) -> float:
    return value if math.isfinite(value) else LOGPROB_FLOOR


TokenText = Callable[[int], str]


def chat_logprobs(entries: Sequence[TokenLogprob], text_of: TokenText) -> dict[str, Any]:
    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = text_of(token_id)
        return {"token": text, "logprob": _logprob(logprob), "bytes": list(text.encode())}

    content = [
        {**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(
    entries: Sequence[TokenLogprob], text_of: TokenText, offset: int = 0, unscored: Sequence[int] = ()
) -> tuple[dict[str, Any], int]:
    """The legacy completions logprobs object, and the text offset after its tokens. `unscored`: tokens
    before `entries` that have no logprob (echo's first prompt token): null logprob and alternatives."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for token_id in unscored:
        text = text_of(token_id)
        tokens.append(text)
        token_logprobs.append(None)
        top.append(None)
        offsets.append(offset)
        offset += len(text)
    for entry in entries:
        text = text_of(entry.token_id)
        tokens.append(text)
        token_logprobs.append(_logprob(entry.logprob))
        top.append({text_of(t): _logprob(lp) for t, lp in entry.top})
        offsets.append(offset)
        offset += len(text)
    body = {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}
    return body, offset


def completion_choice(
    index: int, text: str, reason: str | None, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason(reason)}


def chat_choice(
    index: int, text: str, reason: str | None, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {
        "index": index,
        "message": {"role": "assistant", "content": text, "refusal": None},
        "logprobs": logprobs,
        "finish_reason": finish_reason(reason),
    }


def completion_response(
    request_id: str, model: str, choices: list[dict[str, Any]], counted: dict[str, Any]
) -> dict[str, Any]:
    """A whole answer: `choices` from completion_choice, in index order."""
    return {
        "id": request_id,
        "object": "text_completion",
        "created": now(),
        "model": model,
        "choices": choices,
        "usage": counted,
    }


def chat_response(
    request_id: str, model: str, choices: list[dict[str, Any]], counted: dict[str, Any]
) -> dict[str, Any]:
    """A whole answer: `choices` from chat_choice, in index order."""
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": now(),
        "model": model,
        "choices": choices,
        "usage": counted,
    }


class ChunkMaker:
    """Stream chunks of one response: same id, created and model in each, `usage: null` on every
    chunk but the last when the client asked for usage (as OpenAI does)."""

    def __init__(self, chat: bool, model: str, include_usage: bool):
        self.chat, self.model, self.include_usage = chat, model, include_usage
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = now()
        self.object = "chat.completion.chunk" if chat else "text_completion"

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def role(self, index: int = 0) -> dict[str, Any]:
        """Chat streams open with the assistant role and empty content (per choice)."""
        return self._chunk(
            [
                {
                    "index": index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ]
        )

    def text(
        self, text: str, logprobs: dict[str, Any] | None = None, reason: str | None = None, index: int = 0
    ) -> dict[str, Any]:
        """A chunk of choice `index`: its next text (and logprobs), or its end (`reason`)."""
        choice: dict[str, Any]
        if self.chat:
            delta = {"content": text} if text or reason is None else {}
            choice = {
                "index": index,
                "delta": delta,
                "logprobs": logprobs,
                "finish_reason": finish_reason(reason),
            }
        else:
            choice = completion_choice(index, text, reason, logprobs)
        return self._chunk([choice])

    def usage(self, counted: dict[str, Any]) -> dict[str, Any]:
        return {**self._chunk([]), "usage": counted}


def sse(event: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"

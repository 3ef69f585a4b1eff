"""From a parsed request to the engine: its sampling parameters, with the context checks a client can act
on, and its submission, with the engine's refusals answered as HTTP errors."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from loraplex import wire
from loraplex.wire import limits
from loraplex.wire.errors import (
    AdapterUnavailable,
    EngineUnavailable,
    OverShare,
    QueueFull,
    RefusedAdapterError,
    UnknownAdapterError,
    answer,
    failure_error,
)

from . import protocol
from .async_engine import AsyncEngine, RequestStream, new_request_id
from .choices import Job
from .protocol import bad_request

if TYPE_CHECKING:
    from loraplex.engine.sampling_params import SamplingParams


def sampling_params(
    engine: AsyncEngine,
    body: protocol._GenerationRequest,
    prompt_len: int,
    limit: int | None,
    logprobs: int | None,
    adapter: str | None = None,
) -> SamplingParams:
    """Sampling parameters, with the context checks a client can act on (400s naming the limits)."""
    context = engine.max_model_len
    if prompt_len >= context:
        raise bad_request(
            f"This model's maximum context length is {context} tokens, and the prompt has {prompt_len} "
            "tokens: it must be shorter to leave room for the completion.",
            code=wire.CONTEXT_LENGTH_EXCEEDED,
        )
    if limit is not None and prompt_len + limit > context:
        raise bad_request(
            f"This model's maximum context length is {context} tokens. However, you requested "
            f"{prompt_len + limit} tokens ({prompt_len} in the prompt, {limit} for the completion). "
            "Please reduce the prompt or the completion length.",
            "max_tokens",
            wire.CONTEXT_LENGTH_EXCEEDED,
        )
    if limit is None:  # as much as the context (and the pool, less the adapter's pages) leaves
        known = engine.adapter(adapter) if adapter is not None else None
        pool_tokens = engine.pool_tokens - (known.pages if known else 0) * engine.page_size
        limit = max(1, min(context, pool_tokens, limits.MAX_COMPLETION_TOKENS) - prompt_len)
    try:
        return body.sampling_params(limit, logprobs)
    except ValueError as exc:  # limits.LimitExceeded among them: it names the field
        raise bad_request(str(exc), getattr(exc, "param", None), limit_code(exc)) from exc


def check_room(engine: AsyncEngine, job: Job) -> None:
    """A request whose sequences could never all be queued here is a 400, not a retry that cannot help."""
    if job.num_sequences > engine.max_queue:
        param = "best_of" if job.best_of > job.n else ("n" if job.n > 1 else "prompt")
        raise bad_request(
            f"this request makes {job.num_sequences} sequences ({len(job.prompts)} prompt(s) x "
            f"{job.best_of}); this engine queues at most {engine.max_queue}: send fewer prompts or choices",
            param,
            wire.LIMIT_EXCEEDED,
        )


async def submit(engine: AsyncEngine, job: Job) -> list[RequestStream]:
    """Every sequence of the job into the engine at once (they batch), in order: per prompt its first
    sequence, then the others, which wait in the engine for its prefill (choices.py). All or none: when
    the engine refuses one, those already queued are aborted and the refusal is answered."""
    adds = []
    for prompt in job.prompts:
        first = new_request_id()
        for copy in range(job.best_of):
            adds.append(
                engine.add_request(
                    prompt.ids,
                    job.sequence_params(prompt, copy),
                    job.adapter,
                    job.tenant,
                    request_id=first if copy == 0 else None,
                    prompt_logprobs=job.prompt_logprobs,
                    shares_prompt_with=first if copy else None,
                    adapter_sha256=job.adapter_sha256,
                )
            )
    results = await asyncio.gather(*adds, return_exceptions=True)
    streams = [r for r in results if isinstance(r, RequestStream)]
    refusal = next((r for r in results if isinstance(r, BaseException)), None)
    if refusal is None:
        return streams
    for stream in streams:
        engine.abort(stream.request_id)
    raise refused(job, refusal)


def refused(job: Job, exc: BaseException) -> BaseException:
    """The HTTP error for the engine's refusal to queue a sequence of `job`."""
    # OverShare: other tenants still get in; AdapterUnavailable (AdapterChanged): a retry registers it again
    if isinstance(exc, QueueFull | OverShare | EngineUnavailable | AdapterUnavailable):
        return failure_error(exc)
    if isinstance(exc, UnknownAdapterError):  # these two before ValueError: each is one
        return answer(UnknownAdapterError, f"The model `{job.model}` does not exist.")
    if isinstance(exc, RefusedAdapterError):
        return answer(RefusedAdapterError, f"adapter {job.model!r}: {exc}")
    if isinstance(exc, ValueError):  # the engine's own checks (pool size, vocabulary) name the limit
        return bad_request(str(exc), getattr(exc, "param", None), limit_code(exc))
    return exc


def limit_code(exc: ValueError) -> str | None:
    """The error code of a refused value: limit_exceeded for a bound of wire/limits.py, none for the rest."""
    return wire.LIMIT_EXCEEDED if isinstance(exc, limits.LimitExceeded) else None

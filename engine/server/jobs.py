"""From a parsed request to the engine: its sampling parameters, with the context checks a client can act
on, and its submission, with the engine's refusals answered as HTTP errors."""

from __future__ import annotations

from typing import TYPE_CHECKING

from loraplex import wire
from loraplex.wire import limits
from loraplex.wire.errors import (
    EngineUnavailable,
    OverShare,
    QueueFull,
    RefusedAdapterError,
    UnknownAdapterError,
    answer,
    failure_error,
)

from . import protocol
from .async_engine import AsyncEngine, RequestStream
from .delivery import Job
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


async def submit(engine: AsyncEngine, job: Job) -> RequestStream:
    try:
        return await engine.add_request(job.prompt_ids, job.params, job.adapter, job.tenant)
    except (QueueFull, OverShare, EngineUnavailable) as exc:  # OverShare: other tenants still get in
        raise failure_error(exc) from exc
    except UnknownAdapterError as exc:  # these two before ValueError: each is one
        raise answer(UnknownAdapterError, f"The model `{job.model}` does not exist.") from exc
    except RefusedAdapterError as exc:
        raise answer(RefusedAdapterError, f"adapter {job.model!r}: {exc}") from exc
    except ValueError as exc:  # the engine's own checks (pool size, vocabulary) name the limit
        raise bad_request(str(exc), getattr(exc, "param", None), limit_code(exc)) from exc


def limit_code(exc: ValueError) -> str | None:
    """The error code of a refused value: limit_exceeded for a bound of wire/limits.py, none for the rest."""
    return wire.LIMIT_EXCEEDED if isinstance(exc, limits.LimitExceeded) else None

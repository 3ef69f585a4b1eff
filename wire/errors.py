"""Errors as the wire carries them: OpenAI's error answer (`OpenAIError`), the failures an engine reports,
and the one table (`ANSWERS`) of the code, HTTP status and OpenAI type each failure is answered with.

Each failure has one name from the engine's offline API to the gateway: the engine raises it, the server
answers it through the table, and the gateway reads its code back from the body (wire.parse_error). A
route that means something narrower (an unregister of an unknown name is `adapter_not_found`, not
`model_not_found`) builds its own OpenAIError, and says why there.

Plain exceptions and a dict: no torch, no web framework, so both sides import it (tests/test_wire.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from . import (
    ADAPTER_FAILED,
    ADAPTER_FAILED_STATUS,
    ADAPTER_UNAVAILABLE,
    ADAPTER_UNAVAILABLE_STATUS,
    ENGINE_ERROR,
    INVALID_REQUEST,
    MODEL_NOT_FOUND,
    NOT_READY,
    QUEUE_FULL,
    RATE_LIMITED,
    SERVER_ERROR,
    TENANT_SHARE_EXCEEDED,
    WireError,
    error_body,
)

# Seconds a client is told to wait (Retry-After) before it retries a failure worth a retry.
RETRY_AFTER_S = 1


class OpenAIError(Exception):
    """Answered as OpenAI's error JSON, {"error": {"message", "type", "param", "code"}} (wire.WireError),
    with `status` and `headers`. The engine's server and the gateway both raise it; each app installs a
    handler that answers `body()`."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = INVALID_REQUEST,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind
        self.code, self.param, self.headers = code, param, headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.kind, self.code, self.param)

    @classmethod
    def of(cls, status: int, error: WireError, headers: dict[str, str] | None = None) -> OpenAIError:
        return cls(status, error.message, error.type, error.code, error.param, headers)


# -- the failures ------------------------------------------------------------------------------------------


class UnknownAdapterError(ValueError):
    """A request named an adapter that is not registered (never, or not any more)."""


class RefusedAdapterError(ValueError):
    """The adapter is at fault (it cannot be verified or loaded, or failed a step on its own): refused,
    with the reason, until it is registered with other weights."""


class AdapterUnavailable(RuntimeError):
    """The adapter's store could not be read: not the adapter's fault, worth a retry."""


class AdapterChanged(AdapterUnavailable):
    """The engine's adapter of that name now has other weights than the digest the request was routed
    with (registered again meanwhile): the request is not run on them. Not the adapter's fault (nothing is
    marked failed); a retry registers the routed version again."""


class StepError(RuntimeError):
    """A step failure no adapter explains. The engine raises it after one retry with the `cause` and the
    `outputs` the step produced before it gave up (requests ended for a guilty adapter): deliver them, then
    fail the rest. The server fails each request the step held with one that carries only a message (the
    cause may quote other tenants' requests: it goes to the log)."""

    def __init__(self, cause: Exception | str, outputs: Sequence[Any] = ()):
        super().__init__(cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}")
        self.cause = None if isinstance(cause, str) else cause
        self.outputs = list(outputs)


class EngineUnavailable(RuntimeError):
    """The engine loop is not running (still loading, stopped, or dead): retry on another replica."""


class QueueFull(RuntimeError):
    def __init__(self, waiting: int, limit: int):
        super().__init__(f"{waiting} requests are already waiting (the limit is {limit}); retry shortly")


class OverShare(RuntimeError):
    """The tenant holds its share of the waiting queue already (wire/shares.py); others are admitted."""


# -- the table -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    """How a failure is answered: HTTP status, OpenAI's `type`, the contract's `code`, and whether the
    client is told when to retry (Retry-After: RETRY_AFTER_S)."""

    status: int
    kind: str
    code: str
    retry: bool = False

    def error(self, message: str) -> OpenAIError:
        headers = {"Retry-After": str(RETRY_AFTER_S)} if self.retry else None
        return OpenAIError(self.status, message, self.kind, self.code, headers=headers)


ENGINE_FAILED = Answer(500, SERVER_ERROR, ENGINE_ERROR)
ANSWERS: dict[type[Exception], Answer] = {
    RefusedAdapterError: Answer(ADAPTER_FAILED_STATUS, INVALID_REQUEST, ADAPTER_FAILED),
    AdapterUnavailable: Answer(ADAPTER_UNAVAILABLE_STATUS, SERVER_ERROR, ADAPTER_UNAVAILABLE, retry=True),
    StepError: ENGINE_FAILED,
    UnknownAdapterError: Answer(404, INVALID_REQUEST, MODEL_NOT_FOUND),
    EngineUnavailable: Answer(503, SERVER_ERROR, NOT_READY, retry=True),
    QueueFull: Answer(429, RATE_LIMITED, QUEUE_FULL, retry=True),
    OverShare: Answer(429, RATE_LIMITED, TENANT_SHARE_EXCEEDED, retry=True),
}
# A request the engine ended with an error carries only the code (engine.FailedOutput): read back here.
BY_CODE: dict[str, Answer] = {answer.code: answer for answer in ANSWERS.values()}


def answer(failure: type[Exception], message: str) -> OpenAIError:
    """The error a client sees for `failure` (a class of ANSWERS), with `message`."""
    return ANSWERS[failure].error(message)


def answer_code(code: str | None, message: str) -> OpenAIError:
    """The error for a request the engine ended with `code` (engine_error for a code this table lacks)."""
    return BY_CODE.get(code or "", ENGINE_FAILED).error(message)


def failure_error(exc: BaseException) -> OpenAIError:
    """The error a client sees when its request failed inside the engine with `exc`: its row of ANSWERS
    with its own message, or engine_error naming the exception for anything else."""
    for failure, row in ANSWERS.items():
        if isinstance(exc, failure):
            return row.error(str(exc))
    return ENGINE_FAILED.error(f"{type(exc).__name__}: {exc}")

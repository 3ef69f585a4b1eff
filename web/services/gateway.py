"""The gateway's parts, free of HTTP: which engine serves a `model`, what a body may hold, what to reserve,
what was used, and the engine's verdict on an adapter. completions.py puts them together per request."""

from __future__ import annotations

import json
import math
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from loraplex import wire
from loraplex.wire import limits, responses

from ..db.models import Adapter, AdapterName, AdapterStatus, Deployment
from .adapters import find_adapter, find_version
from .scopes import KeyLimits
from .traffic import choose_version, split_salt

# `model: "<adapter>@<version>"` addresses one version of an adapter; adapter names cannot hold "@", and
# the version is bounded so it always fits the database's integer.
VERSIONED_MODEL = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._:-]{0,127})@(?P<version>[1-9][0-9]{0,8})$")


@dataclass(frozen=True)
class Target:
    """Where a request goes: a deployment's replicas, with the adapter (if any) they should load."""

    model: str
    base_model: str
    # As the deployment stores them: engine URLs and kubernetes://<namespace>/<name> targets, which
    # Router.order turns into the ready pods discovery sees at that moment (web/services/discovery.py).
    endpoints: list[str]
    # The adapter's name without a version (what a key's adapter list names); None: the base model.
    adapter_name: str | None = None
    adapter_version: int | None = None  # which version serves it (usage is recorded per version)
    adapter_id: uuid.UUID | None = None
    adapter_uri: str | None = None
    adapter_sha256: str | None = None
    # The adapter's stored bytes: the router counts them against the pods' adapter capacity.
    adapter_bytes: int = 0

    @property
    def affinity_key(self) -> str | None:
        return f"adapter:{self.adapter_sha256}" if self.adapter_sha256 else None

    @property
    def adapter(self) -> wire.AdapterRef | None:
        """The adapter as the engine is told of it (None: the base model alone)."""
        if self.adapter_id is None:
            return None
        return wire.AdapterRef(str(self.adapter_id), self.adapter_uri or "", self.adapter_sha256)


@dataclass(frozen=True)
class NotServed:
    """The tenant's own adapter `model` exists but is not served: failed (with the reason the tenant can
    act on) or still being uploaded. Told as such, not as a missing model: it is the caller's adapter."""

    model: str
    status: AdapterStatus
    error: str | None
    adapter_name: str = ""


def split_model(model: str) -> tuple[str, int | None]:
    """`model` as an adapter name and the version it asks for (None: the active version)."""
    versioned = VERSIONED_MODEL.match(model)
    if versioned is None:
        return model, None
    return versioned["name"], int(versioned["version"])


def find_model_adapter(
    session: Session, tenant_id: uuid.UUID, model: str, caller: str | None = None
) -> Adapter | None:
    """The adapter version `model` addresses: "<name>@<version>" that version; "<name>" the version its
    traffic split gives this request (`caller`: OpenAI's `user`, for a sticky split), else the active one."""
    name, version = split_model(model)
    if version is not None:
        return find_version(session, tenant_id, name, version)
    named = session.get(AdapterName, (tenant_id, model))
    if named is not None and named.traffic:
        chosen = choose_version(named.traffic, named.sticky, caller, split_salt(tenant_id, model))
        return find_version(session, tenant_id, model, chosen)
    return find_adapter(session, tenant_id, model)


def resolve(
    session: Session, tenant_id: uuid.UUID, model: str, caller: str | None = None
) -> Target | NotServed | None:
    """This tenant's ready adapter version `model` addresses (NotServed if it is not ready), else a
    deployment of base model `model`, else None. `caller`: the request's `user`, for a sticky split."""
    adapter = find_model_adapter(session, tenant_id, model, caller)
    if adapter is not None and adapter.status == AdapterStatus.READY:
        return _adapter_target(adapter, model)
    if adapter is not None:
        return NotServed(model, adapter.status, adapter.error, adapter.name)
    deployment = session.scalar(
        select(Deployment).where(Deployment.base_model == model).order_by(Deployment.name).limit(1)
    )
    if deployment is None:
        return None
    return Target(model=model, base_model=deployment.base_model, endpoints=list(deployment.endpoints))


def _adapter_target(adapter: Adapter, model: str) -> Target:
    return Target(
        model=model,
        base_model=adapter.deployment.base_model,
        endpoints=list(adapter.deployment.endpoints),
        adapter_name=adapter.name,
        adapter_version=adapter.version,
        adapter_id=adapter.id,
        adapter_uri=adapter.storage_uri,
        adapter_sha256=adapter.sha256,
        adapter_bytes=adapter.bytes or 0,
    )


def list_models(
    session: Session, tenant_id: uuid.UUID, limits: KeyLimits | None = None
) -> list[dict[str, Any]]:
    """OpenAI model objects with vLLM's `root` and `parent`: every deployment's base model (its own root,
    no parent), then this tenant's adapters whose active version is ready (root and parent: the base model
    they fit); of those, what `limits` (a key's scope) lets its key call."""
    limits = limits or KeyLimits()
    models: dict[str, dict[str, Any]] = {}
    if limits.base_model:
        for deployment in session.scalars(select(Deployment).order_by(Deployment.name)):
            models.setdefault(
                deployment.base_model, _model(deployment.base_model, deployment.created_at, "loraplex", None)
            )
    adapters = session.scalars(
        select(Adapter)
        .join(
            AdapterName,
            (AdapterName.tenant_id == Adapter.tenant_id)
            & (AdapterName.name == Adapter.name)
            & (AdapterName.active_version == Adapter.version),
        )
        .where(Adapter.tenant_id == tenant_id, Adapter.status == AdapterStatus.READY)
        .order_by(Adapter.name)
    )
    for adapter in adapters:
        if limits.may_use(adapter.name):
            models[adapter.name] = _model(
                adapter.name, adapter.created_at, "tenant", adapter.deployment.base_model
            )
    return list(models.values())


def find_model(
    session: Session, tenant_id: uuid.UUID, model: str, limits: KeyLimits | None = None
) -> dict[str, Any] | None:
    """The model object `GET /v1/models/{model}` answers: one of list_models', or a ready version as
    "<name>@<version>" (None: not this tenant's, or not the key's to call)."""
    name, version = split_model(model)
    if version is None:
        return next((m for m in list_models(session, tenant_id, limits) if m["id"] == model), None)
    adapter = find_version(session, tenant_id, name, version)
    if adapter is None or adapter.status != AdapterStatus.READY or not (limits or KeyLimits()).may_use(name):
        return None
    return _model(model, adapter.created_at, "tenant", adapter.deployment.base_model)


def _model(name: str, created: Any, owner: str, parent: str | None) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": int(created.timestamp()),
        "owned_by": owner,
        "root": parent or name,
        "parent": parent,
    }


def upstream_headers(target: Target, tenant: wire.TenantRef, internal_token: str) -> dict[str, str]:
    return wire.request_headers(internal_token, tenant, target.adapter)


# -- what a tenant's request body may hold --------------------------------------------------------------
# The caps are the engine's own (wire/limits.py, torch-free), so a tenant meets the same limit at
# the gateway as at the engine, and the gateway refuses before it spends a quota reservation on a request
# the engine would refuse anyway.

MAX_REQUEST_BODY_BYTES = limits.MAX_REQUEST_BODY_BYTES


class BadRequest(Exception):
    """A request the gateway refuses before forwarding it: `param` names the field (OpenAI's `param`)."""

    def __init__(self, param: str | None, message: str, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.message, self.status, self.code = param, message, status, code


def _refuse_constant(token: str) -> Any:
    raise ValueError(f"{token} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 parses to inf
        raise ValueError(f"{text[:32]} is not a finite number")
    return value


def parse_body(raw: bytes, limit: int = MAX_REQUEST_BODY_BYTES) -> dict[str, Any]:
    """The JSON object a tenant sent, refusing what Python's json would let through: NaN, Infinity,
    numbers that overflow to inf, nesting deep enough to recurse out, and bodies over `limit` bytes."""
    if len(raw) > limit:
        too_large = f"request body is {len(raw)} bytes; at most {limit} are allowed"
        raise BadRequest(None, too_large, 413, wire.REQUEST_TOO_LARGE)
    try:
        body = json.loads(raw, parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError:
        raise BadRequest(None, "request body is nested too deeply to be a request") from None
    except ValueError as exc:  # JSONDecodeError, bad UTF-8, NaN, int past 4300 digits
        raise BadRequest(None, f"request body is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(body, dict):
        raise BadRequest(None, "request body must be a JSON object")
    return body


RESPONSES = "responses"  # the Responses API: checked by its chat translation, forwarded as sent


def completion_limit(body: dict[str, Any], endpoint: str) -> int | None:
    """The field that limits completion length on `endpoint`, exactly as the engine reads it
    (engine/server/protocol.py): chat takes `max_completion_tokens`, else `max_tokens`; the legacy
    completions endpoint only `max_tokens`; the Responses API `max_output_tokens`."""
    if endpoint == RESPONSES:
        value = body.get("max_output_tokens")
    elif endpoint == "chat/completions":
        value = body.get("max_completion_tokens") or body.get("max_tokens")
    else:
        value = body.get("max_tokens")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def check_caps(body: dict[str, Any], endpoint: str) -> None:
    """Every cap of wire/limits.py on the fields this body holds; BadRequest naming the field. A Responses
    body is checked as the chat body it means (wire/responses.py), its errors named by its own fields."""
    if endpoint == RESPONSES:
        try:
            check_caps(responses.to_chat(body), "chat/completions")
        except responses.Refused as exc:
            raise BadRequest(exc.param, str(exc), code=exc.code) from None
        except limits.LimitExceeded as exc:
            raise BadRequest(responses.responses_param(exc.param), str(exc)) from None
        except BadRequest as exc:
            exc.param = responses.responses_param(exc.param)
            raise
        return
    try:
        limits.check_stop(body.get("stop"))
        bias = body.get("logit_bias")
        if bias is not None and not isinstance(bias, dict):
            raise limits.LimitExceeded("logit_bias", "logit_bias must be an object of token ids to numbers")
        limits.check_logit_bias(bias)
        limits.check_response_format(body.get("response_format"))  # structured outputs: bounded schemas
        # Every number the sampler sees (top_k, temperature, seed, ...), as the engine checks it.
        limits.check_numbers(body, completions=endpoint == "completions")
        if endpoint == "completions":  # chat's logprobs is a boolean, its count top_logprobs
            limits.check_number("logprobs", body.get("logprobs"), limits.LOGPROBS)
        if endpoint == "completions" and body.get("max_completion_tokens") is not None:
            raise limits.LimitExceeded(
                "max_completion_tokens",
                "max_completion_tokens is a chat parameter; /v1/completions is limited by max_tokens",
            )
        if endpoint == "chat/completions":
            messages = body.get("messages") or []
            limits.check_chat_messages(len(messages))
            limits.check_prompt_chars("messages", content_chars(messages))
            limits.check_choices(1, body.get("n"))
            limits.check_tools(body.get("tools"), body.get("tool_choice"))
        else:
            # The engine's bounds on each form (a text, token ids, a list of either) and on the choices
            # all its prompts make (prompts x best_of sequences).
            limits.check_prompt(body.get("prompt"))
            limits.check_choices(limits.prompt_count(body.get("prompt")), body.get("n"), body.get("best_of"))
    except limits.LimitExceeded as exc:
        raise BadRequest(exc.param, str(exc)) from None


def content_chars(messages: Any) -> int:
    """Characters of text in chat messages, counted as the engine counts them (string contents and the
    text of content parts)."""
    total = 0
    for message in messages if isinstance(messages, list) else []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(
                len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
            )
    return total


def set_completion_limit(body: dict[str, Any], endpoint: str, default: int) -> int:
    """The most completion tokens this request can produce: its limit per sequence times its sequences
    (each prompt's best_of, else n). A request that names no limit is given `default` explicitly, so the
    engine stops where the gateway's reservation ends."""
    limit = completion_limit(body, endpoint)
    if limit is None:
        body["max_output_tokens" if endpoint == RESPONSES else "max_tokens"] = limit = default
    return limit * sequences(body, endpoint)


def sequences(body: dict[str, Any], endpoint: str) -> int:
    """The sequences the engine generates for this (checked) body: prompts x max(n, best_of)."""

    def count(field: str) -> int:
        value = body.get(field)
        return value if isinstance(value, int) and not isinstance(value, bool) else 1

    if endpoint == RESPONSES:  # one answer per request
        return 1
    prompts = 1 if endpoint == "chat/completions" else max(1, limits.prompt_count(body.get("prompt")))
    per_prompt = max(count("n"), count("best_of") if endpoint == "completions" else 1)
    return prompts * per_prompt


def estimate_tokens(text: str) -> int:
    """Prompt tokens, estimated without the tokenizer: about four ASCII characters a token, and a token
    for every other character (tokenizers split scripts outside ASCII much finer). The engine's exact
    count replaces it when the request ends."""
    if not text:
        return 0
    ascii_chars = len(text.encode("ascii", "ignore"))  # C speed on a 256k-character prompt
    return max(1, (ascii_chars + 3) // 4 + len(text) - ascii_chars)


def estimate_prompt_tokens(body: dict[str, Any]) -> int:
    """The prompt tokens of a request before the engine counts them: token ids exactly, text estimated."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt)  # one prompt of token ids
    if isinstance(prompt, list):
        ids = sum(len(p) for p in prompt if isinstance(p, list))
        return ids + sum(estimate_tokens(p) for p in prompt if isinstance(p, str))
    return estimate_tokens(prompt_text(body))


def prompt_text(body: dict[str, Any]) -> str:
    if "input" in body:  # a Responses body (checked already): its instructions and input items as chat's
        messages = responses.messages(body)
        calls = [c["function"]["arguments"] for m in messages for c in m.get("tool_calls") or []]
        return "\n".join([*(m["content"] or "" for m in messages), *calls])
    if "messages" in body:
        parts = []
        for message in body.get("messages") or []:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                parts.extend(str(p.get("text", "")) for p in content if isinstance(p, dict))
        return "\n".join(parts)
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        return "\n".join(p for p in prompt if isinstance(p, str))
    return prompt if isinstance(prompt, str) else ""


# Bytes of an SSE line the meter keeps while waiting for its end; the engine's lines are far shorter.
_MAX_PENDING = 1 << 20


class UsageChunkFilter:
    """Passes an SSE stream through event by event, less the usage-only chunk (`"choices": []` with a
    `usage`), which the gateway asks the engine for to meter and a client that did not ask must not see.
    Holds back only an event's bytes until its blank line; a stream that is not SSE passes unchanged."""

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, data: bytes) -> bytes:
        self._pending += data
        *events, self._pending = self._pending.split(b"\n\n")
        if len(self._pending) > _MAX_PENDING:  # no event boundary in sight: not ours to hold
            events.append(self._pending)
            self._pending = b""
            return b"\n\n".join(e for e in events if not _usage_only(e))
        return b"".join(e + b"\n\n" for e in events if not _usage_only(e))

    def rest(self) -> bytes:
        rest, self._pending = self._pending, b""
        return b"" if _usage_only(rest) else rest


def _usage_only(event: bytes) -> bool:
    payload = event.strip()
    if not payload.startswith(b"data:") or b"\n" in payload:
        return False
    try:
        body = json.loads(payload[5:].strip())
    except (ValueError, RecursionError):
        return False
    return isinstance(body, dict) and body.get("choices") == [] and isinstance(body.get("usage"), dict)


@dataclass
class Meter:
    """Reads the engine's SSE stream as it passes: the final usage when sent, else a count of chunks,
    and an error event (the engine reports an adapter's failure mid-stream that way)."""

    prompt_estimate: int
    usage: dict[str, int] | None = None
    chunks: int = 0
    error: wire.WireError | None = None
    _pending: bytes = field(default=b"", repr=False)

    def feed(self, data: bytes) -> None:
        self._pending += data
        *lines, self._pending = self._pending.split(b"\n")
        if len(self._pending) > _MAX_PENDING:
            self._pending = b""
        for line in lines:
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                continue
            try:
                event = json.loads(payload)
            except (ValueError, RecursionError):
                continue
            if isinstance(event, dict):
                self._count(event)

    def _count(self, event: dict[str, Any]) -> None:
        error = wire.WireError.from_body(event)
        if error is not None:
            self.error = error
        kind = event.get("type")
        if isinstance(kind, str) and kind.startswith("response."):  # the Responses API's typed events
            self._count_response_event(kind, event)
            return
        usage = event.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self.usage = usage
        for choice in event.get("choices") or []:
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta") or {}
            text = delta.get("content") if isinstance(delta, dict) else None
            if text or choice.get("text"):
                self.chunks += 1  # engines send about one token a chunk

    def _count_response_event(self, kind: str, event: dict[str, Any]) -> None:
        """A delta (about a token) or the last event, whose Response carries the exact usage."""
        if kind in ("response.output_text.delta", "response.function_call_arguments.delta"):
            self.chunks += 1
        elif kind in ("response.completed", "response.incomplete"):
            response = event.get("response")
            usage = responses.chat_usage(response.get("usage") if isinstance(response, dict) else None)
            if usage is not None:
                self.usage = usage

    def totals(self) -> tuple[int, int, bool]:
        """(prompt tokens, completion tokens, exact)."""
        if self.usage is not None:
            prompt = self.usage.get("prompt_tokens", 0)
            return (prompt if isinstance(prompt, int) else 0), int(self.usage["completion_tokens"]), True
        return self.prompt_estimate, self.chunks, False


def cached_tokens(usage: dict[str, Any] | None) -> int:
    """The prompt tokens the engine took from its prefix cache (OpenAI's
    usage.prompt_tokens_details.cached_tokens); 0 when the engine does not say."""
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if isinstance(cached, int) and cached >= 0 else 0


def usage_of_body(content: bytes) -> dict[str, int] | None:
    """A whole answer's usage in chat's terms (a Response's input/output tokens read as such)."""
    try:
        usage = json.loads(content).get("usage")
    except (ValueError, AttributeError, RecursionError):
        return None
    if isinstance(usage, dict) and "input_tokens" in usage:
        usage = responses.chat_usage(usage)
    if not isinstance(usage, dict) or not all(
        isinstance(usage.get(k), int) for k in ("prompt_tokens", "completion_tokens")
    ):
        return None
    return usage

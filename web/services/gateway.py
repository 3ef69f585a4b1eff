"""The gateway's logic, free of HTTP: which engine serves a `model`, what to reserve, what was used."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from ..db.models import Adapter, AdapterStatus, Deployment
from .adapters import find_adapter

INTERNAL_TOKEN_HEADER = "X-Loraplex-Internal-Token"


@dataclass(frozen=True)
class Target:
    """Where a request goes: a deployment's replicas, with the adapter (if any) they should load."""

    model: str
    base_model: str
    endpoints: list[str]
    adapter_id: uuid.UUID | None = None
    adapter_uri: str | None = None
    adapter_sha256: str | None = None

    @property
    def affinity_key(self) -> str | None:
        return f"adapter:{self.adapter_sha256}" if self.adapter_sha256 else None


def resolve(session: Session, tenant_id: uuid.UUID, model: str) -> Target | None:
    """This tenant's ready adapter named `model`, else a deployment of base model `model`, else None."""
    adapter = find_adapter(session, tenant_id, model)
    if adapter is not None and adapter.status == AdapterStatus.READY:
        return _adapter_target(adapter)
    if adapter is not None:
        return None
    deployment = session.scalar(
        select(Deployment).where(Deployment.base_model == model).order_by(Deployment.name).limit(1)
    )
    if deployment is None:
        return None
    return Target(model=model, base_model=deployment.base_model, endpoints=list(deployment.endpoints))


def _adapter_target(adapter: Adapter) -> Target:
    return Target(
        model=adapter.name,
        base_model=adapter.deployment.base_model,
        endpoints=list(adapter.deployment.endpoints),
        adapter_id=adapter.id,
        adapter_uri=adapter.storage_uri,
        adapter_sha256=adapter.sha256,
    )


def list_models(session: Session, tenant_id: uuid.UUID) -> list[dict[str, Any]]:
    """OpenAI model objects: every deployment's base model, then this tenant's ready adapters."""
    models: dict[str, dict[str, Any]] = {}
    for deployment in session.scalars(select(Deployment).order_by(Deployment.name)):
        models.setdefault(
            deployment.base_model, _model(deployment.base_model, deployment.created_at, "loraplex")
        )
    adapters = session.scalars(
        select(Adapter)
        .where(Adapter.tenant_id == tenant_id, Adapter.status == AdapterStatus.READY)
        .order_by(Adapter.name)
    )
    for adapter in adapters:
        models[adapter.name] = _model(adapter.name, adapter.created_at, "tenant")
    return list(models.values())


def _model(name: str, created: Any, owner: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": int(created.timestamp()), "owned_by": owner}


def upstream_headers(target: Target, tenant_id: uuid.UUID, internal_token: str) -> dict[str, str]:
    headers = {INTERNAL_TOKEN_HEADER: internal_token, "X-Loraplex-Tenant": str(tenant_id)}
    if target.adapter_id is not None:
        headers["X-Loraplex-Adapter-Id"] = str(target.adapter_id)
        headers["X-Loraplex-Adapter-Uri"] = target.adapter_uri or ""
        headers["X-Loraplex-Adapter-Sha256"] = target.adapter_sha256 or ""
    return headers


def estimate_tokens(text: str) -> int:
    """About four characters a token: what we count when the engine reports no usage."""
    return max(1, (len(text) + 3) // 4) if text else 0


def prompt_text(body: dict[str, Any]) -> str:
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


def reservation(body: dict[str, Any], default_max_tokens: int) -> int:
    """Tokens to hold against tokens-per-minute while the request runs."""
    limit = body.get("max_completion_tokens") or body.get("max_tokens") or default_max_tokens
    limit = limit if isinstance(limit, int) and limit > 0 else default_max_tokens
    return estimate_tokens(prompt_text(body)) + limit


@dataclass
class Meter:
    """Reads the engine's SSE stream as it passes: the final usage when sent, else a count of chunks."""

    prompt_estimate: int
    usage: dict[str, int] | None = None
    chunks: int = 0
    _pending: bytes = field(default=b"", repr=False)

    def feed(self, data: bytes) -> None:
        self._pending += data
        *lines, self._pending = self._pending.split(b"\n")
        for line in lines:
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                continue
            try:
                event = json.loads(payload)
            except ValueError:
                continue
            if isinstance(event, dict):
                self._count(event)

    def _count(self, event: dict[str, Any]) -> None:
        usage = event.get("usage")
        if isinstance(usage, dict) and "completion_tokens" in usage:
            self.usage = usage
        for choice in event.get("choices") or []:
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta") or {}
            text = delta.get("content") if isinstance(delta, dict) else None
            if text or choice.get("text"):
                self.chunks += 1  # engines send about one token a chunk

    def totals(self) -> tuple[int, int, bool]:
        """(prompt tokens, completion tokens, exact)."""
        if self.usage is not None:
            return int(self.usage.get("prompt_tokens", 0)), int(self.usage.get("completion_tokens", 0)), True
        return self.prompt_estimate, self.chunks, False


def usage_of_body(content: bytes) -> dict[str, int] | None:
    try:
        usage = json.loads(content).get("usage")
    except (ValueError, AttributeError):
        return None
    return usage if isinstance(usage, dict) else None

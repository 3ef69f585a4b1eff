"""API keys: create (the secret shown once), list with prefix and last use, revoke after confirming."""

from __future__ import annotations

import datetime as dt
import re
import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Form, Request
from fastapi.responses import Response

from ..api.deps import SessionDep
from ..db.models import KeyScope, utcnow
from ..schemas import KeyCreated, KeyPublic
from ..services import keys
from ..services.errors import ServiceError
from .forms import GuardedRoute
from .rendering import redirect, render
from .security import Member, verify_csrf

router = APIRouter(
    tags=["console"],
    include_in_schema=False,
    dependencies=[Depends(verify_csrf)],
    route_class=GuardedRoute,
)
EXPIRY_CHOICES = [("", "Never"), ("7", "In 7 days"), ("30", "In 30 days"), ("90", "In 90 days")]
SCOPE_CHOICES = [
    ("all", "Everything: manage adapters, read usage, call models"),
    ("inference", "Inference only: call models"),
    ("read", "Read only: listings and usage"),
]
OVERLAP_CHOICES = [
    ("0", "None: the old key stops now"),
    ("3600", "1 hour"),
    ("86400", "1 day"),
    ("604800", "7 days"),
]
ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


def key_state(key: KeyPublic, now: dt.datetime) -> str:
    if key.revoked_at is not None:
        return "revoked"
    if key.expires_at is not None and key.expires_at <= now:
        return "expired"
    return "active"


def _page(
    request: Request,
    session: SessionDep,
    user: Member,
    status_code: int = 200,
    **extra: Any,
) -> Response:
    assert user.tenant_id is not None
    now = utcnow()
    rows = [(k, key_state(k, now)) for k in reversed(keys.list_keys(session, user.tenant_id))]
    context = {
        "title": "API keys",
        "active": "keys",
        "rows": rows,
        "expiry_choices": EXPIRY_CHOICES,
        "scope_choices": SCOPE_CHOICES,
        "overlap_choices": OVERLAP_CHOICES,
    }
    return render(request, "keys.html", {**context, **extra}, status_code)


@router.get("/console/keys")
def keys_page(request: Request, session: SessionDep, user: Member) -> Response:
    return _page(request, session, user)


@router.post("/console/keys")
def create_key(
    request: Request,
    session: SessionDep,
    user: Member,
    name: Annotated[str, Form()] = "",
    expires_in_days: Annotated[str, Form()] = "",
    scope: Annotated[str, Form()] = "all",
    adapter_list: Annotated[str, Form()] = "",
    base_model: Annotated[str, Form()] = "",
) -> Response:
    assert user.tenant_id is not None
    name = name.strip()
    if not name or len(name) > 128 or any(ord(c) < 32 or ord(c) == 127 for c in name):
        error = "Give the key a name of 1 to 128 printable characters, e.g. where it will be used."
        return _page(request, session, user, 422, name_error=error, name=name)
    if expires_in_days not in {value for value, _ in EXPIRY_CHOICES}:
        return _page(
            request, session, user, 422, expiry_error="Choose one of the offered expiries.", name=name
        )
    expires_at = utcnow() + dt.timedelta(days=int(expires_in_days)) if expires_in_days else None
    # Scope (services/scopes.py): what the key may do, which adapters, whether the base models.
    if scope not in {s.value for s in KeyScope}:
        return _page(request, session, user, 422, scope_error="Choose one of the offered scopes.", name=name)
    names = [n.strip() for n in adapter_list.replace("\n", ",").split(",") if n.strip()]
    bad = next((n for n in names if not ADAPTER_NAME.match(n)), None)
    if bad is not None or len(names) > 256:
        error = f"“{bad[:40]}” is not an adapter name." if bad else "At most 256 adapters."
        return _page(request, session, user, 422, adapters_error=error, name=name)
    try:
        created: KeyCreated = keys.create_key(
            session,
            user.tenant_id,
            name,
            request.app.state.pepper,
            expires_at,
            scope=KeyScope(scope),
            adapters=names or None,
            base_model=(base_model == "on") if names else None,
        )
    except ServiceError as exc:
        return _page(request, session, user, exc.status_code, name_error=exc.message, name=name)
    # Rendered in this response, never redirected: the secret must not travel in a URL or a cookie.
    return _page(request, session, user, 201, created=created)


@router.post("/console/keys/{key_id}/rotate")
def rotate_key(
    key_id: uuid.UUID,
    request: Request,
    session: SessionDep,
    user: Member,
    overlap_seconds: Annotated[str, Form()] = "0",
) -> Response:
    """A new key with the old one's name, scope and expiry; the old one keeps working for the overlap."""
    assert user.tenant_id is not None
    if overlap_seconds not in {value for value, _ in OVERLAP_CHOICES}:
        return redirect(request, "/console/keys", flash="Choose one of the offered overlaps.")
    try:
        created = keys.rotate_key(
            session,
            user.tenant_id,
            key_id,
            dt.timedelta(seconds=int(overlap_seconds)),
            request.app.state.pepper,
        )
    except ServiceError as exc:
        return redirect(request, "/console/keys", flash=exc.message)
    return _page(request, session, user, 201, created=created, rotated=True)


@router.post("/console/keys/{key_id}/revoke")
def revoke_key(
    key_id: uuid.UUID,
    request: Request,
    session: SessionDep,
    user: Member,
    confirm: Annotated[str, Form()] = "",
) -> Response:
    assert user.tenant_id is not None
    found = next((k for k in keys.list_keys(session, user.tenant_id) if k.id == key_id), None)
    if found is None:
        return redirect(request, "/console/keys", flash="That key no longer exists.")
    if confirm != "yes":  # without JavaScript, the confirmation is a page of its own
        return render(
            request,
            "confirm.html",
            {
                "title": "Revoke key",
                "active": "keys",
                "question": f"Revoke the key “{found.name}” ({found.prefix}…)?",
                "consequence": "Requests with it fail from the next one on. This cannot be undone.",
                "action": f"/console/keys/{key_id}/revoke",
                "confirm_label": "Revoke key",
                "back": "/console/keys",
            },
        )
    keys.revoke_key(session, user.tenant_id, key_id)
    return redirect(request, "/console/keys", flash=f"Key “{found.name}” revoked.")

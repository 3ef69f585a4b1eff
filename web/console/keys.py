"""API keys: create (the secret shown once), list with prefix and last use, revoke after confirming."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Form, Request
from fastapi.responses import Response

from ..api.deps import SessionDep
from ..db.models import utcnow
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
    context = {"title": "API keys", "active": "keys", "rows": rows, "expiry_choices": EXPIRY_CHOICES}
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
    try:
        created: KeyCreated = keys.create_key(
            session, user.tenant_id, name, request.app.state.pepper, expires_at
        )
    except ServiceError as exc:
        return _page(request, session, user, exc.status_code, name_error=exc.message, name=name)
    # Rendered in this response, never redirected: the secret must not travel in a URL or a cookie.
    return _page(request, session, user, 201, created=created)


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

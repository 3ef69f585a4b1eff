"""Signing in and out, and where each kind of user lands."""

from __future__ import annotations

import datetime as dt
import logging
from typing import Annotated

from fastapi import APIRouter, Depends, Form, Request
from fastapi.responses import RedirectResponse, Response

from ..api.deps import SessionDep, SettingsDep
from ..services import console_sessions, sign_in_throttle, users
from ..services.client_address import client_address as client_address_of
from ..settings import Settings
from .forms import SignInFormRoute
from .rendering import redirect, render
from .security import current_user, security_of, verify_csrf

log = logging.getLogger("loraplex.web.console")
router = APIRouter(
    tags=["console"],
    include_in_schema=False,
    dependencies=[Depends(verify_csrf)],
    route_class=SignInFormRoute,
)


def landing(user: users.UserView) -> str:
    """Members start on their tenant's overview; admins without a tenant on the admin pages."""
    return "/console" if user.tenant_id is not None else "/console/admin/tenants"


def safe_next(target: str | None) -> str | None:
    """Only paths inside the console: never another site (`//evil`, `https://...`, `/\\evil`)."""
    if not target or not target.startswith("/console") or "\\" in target or target.startswith("//"):
        return None
    return target


@router.get("/")
def root() -> RedirectResponse:
    return RedirectResponse("/console", status_code=303)


@router.get("/console/sign-in")
async def sign_in_page(request: Request, next: str | None = None) -> Response:
    user = await current_user(request)
    if user is not None:
        return RedirectResponse(safe_next(next) or landing(user), status_code=303)
    return render(request, "sign_in.html", {"title": "Sign in", "next": safe_next(next) or ""})


def client_address(request: Request, settings: Settings) -> str | None:
    """The signing-in client's address, through the trusted proxies' header when the peer is one."""
    peer = request.client.host if request.client else None
    forwarded = ",".join(request.headers.getlist(settings.client_address_header))
    return client_address_of(peer, forwarded, settings.trusted_networks())


@router.post("/console/sign-in")
def sign_in(
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
    email: Annotated[str, Form(max_length=320)],
    password: Annotated[str, Form(max_length=1024)],
    next: Annotated[str, Form(max_length=2048)] = "",
) -> Response:
    policy = sign_in_throttle.Policy(
        settings.sign_in_max_failures, dt.timedelta(seconds=settings.sign_in_window_s)
    )
    address = client_address(request, settings)
    limits = sign_in_throttle.subjects(email, address, policy)
    context = {"title": "Sign in", "next": safe_next(next) or "", "email": email}

    # The attempt is counted before the password is checked, so parallel guesses cannot all pass.
    wait = sign_in_throttle.reserve(session, limits, policy)
    if wait is not None:
        log.warning("console sign-in throttled", extra={"email": email[:320], "address": address})
        minutes = max(1, round(wait / 60))
        error = f"Too many failed sign-ins. Try again in about {minutes} minute{'s' if minutes > 1 else ''}."
        locked = render(request, "sign_in.html", {**context, "error": error}, 429)
        locked.headers["Retry-After"] = str(wait)
        return locked

    user = users.verify(session, email, password)
    session.commit()  # ends verify's read, so the throttle's next write starts a fresh transaction
    if user is None:
        log.info("console sign-in failed", extra={"email": email[:320], "address": address})
        # One message for an unknown email and a wrong password: the form does not reveal who has an account.
        return render(request, "sign_in.html", {**context, "error": "Wrong email or password."}, 401)
    sign_in_throttle.succeeded(session, limits)
    if not user.can_sign_in:
        error = "This account is disabled" + (" (its tenant is disabled)" if user.tenant_disabled else "")
        return render(request, "sign_in.html", {**context, "error": error + ". Ask an admin."}, 403)

    token = console_sessions.start(session, user.id, security_of(request).lifetime)
    response = RedirectResponse(safe_next(next) or landing(user), status_code=303)
    security_of(request).set_session(request, response, token)
    return response


@router.post("/console/sign-out")
def sign_out(request: Request, session: SessionDep) -> Response:
    security = security_of(request)
    token = security.session_token(request)
    if token is not None:
        console_sessions.end(session, token)
    response = redirect(request, "/console/sign-in", flash="You are signed out.")
    security.clear_session(request, response)
    return response

"""The console's cookies, CSRF tokens and who-is-signed-in dependencies.

- Session: `lpx_session` holds a random token, signed (itsdangerous, with a timestamp) so tampered or
  stale cookies are refused before the database is asked; the server keeps the token's hash
  (services.console_sessions), so signing out ends the session for good.
- CSRF: every browser gets a random `lpx_csrf` cookie; the token that forms carry (field `csrf_token`,
  or header `X-CSRF-Token` for fetch) is HMAC(secret, that cookie). Another site can neither read the
  token nor set the cookie, so its forms fail. Cross-site requests (`Sec-Fetch-Site: cross-site`) are
  refused outright. Signing in starts a new CSRF cookie.
- All cookies are HttpOnly, SameSite=Lax, limited to /console, and Secure over https.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import secrets
from typing import Annotated

from fastapi import Depends, Request
from fastapi.concurrency import run_in_threadpool
from itsdangerous import BadSignature, TimestampSigner, URLSafeTimedSerializer
from starlette.responses import Response

from ..db.session import Database
from ..services import console_sessions
from ..services.users import UserView
from ..settings import Settings

SESSION_COOKIE = "lpx_session"
CSRF_COOKIE = "lpx_csrf"
FLASH_COOKIE = "lpx_flash"
COOKIE_PATH = "/console"
CSRF_FIELD = "csrf_token"
CSRF_HEADER = "X-CSRF-Token"
SAFE_METHODS = {"GET", "HEAD", "OPTIONS"}


class SignInRequired(Exception):
    """Raised by page dependencies; answered with a redirect to the sign-in page."""


class ConsoleForbidden(Exception):
    """Raised when the signed-in user may not see a page; answered with a 403 page."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class CsrfRefused(Exception):
    """A state-changing request without a valid CSRF token (or from another site)."""


class ConsoleSecurity:
    """Signs and checks the console's cookies; one per app, made from the settings."""

    def __init__(self, settings: Settings):
        self.secret = settings.console_secret()
        self.lifetime = dt.timedelta(hours=settings.session_hours)
        self.secure = settings.secure_cookies
        self._session_signer = TimestampSigner(self.secret, salt="loraplex.console.session")
        self._csrf_signer = TimestampSigner(self.secret, salt="loraplex.console.csrf")
        # Notices hold any text: serialized (JSON, base64) so the cookie stays ASCII.
        self._flash_signer = URLSafeTimedSerializer(self.secret, salt="loraplex.console.flash")

    # -- cookies ---------------------------------------------------------------------------------

    def _secure(self, request: Request) -> bool:
        return self.secure if self.secure is not None else request.url.scheme == "https"

    def _set(self, request: Request, response: Response, name: str, value: str, max_age: int | None) -> None:
        response.set_cookie(
            name,
            value,
            max_age=max_age,
            path=COOKIE_PATH,
            httponly=True,
            samesite="lax",
            secure=self._secure(request),
        )

    def _clear(self, request: Request, response: Response, name: str) -> None:
        response.delete_cookie(
            name, path=COOKIE_PATH, httponly=True, samesite="lax", secure=self._secure(request)
        )

    # -- sessions --------------------------------------------------------------------------------

    def session_token(self, request: Request) -> str | None:
        signed = request.cookies.get(SESSION_COOKIE)
        if not signed:
            return None
        try:
            max_age = int(self.lifetime.total_seconds())
            return self._session_signer.unsign(signed, max_age=max_age).decode()
        except BadSignature:  # also expired signatures
            return None

    def set_session(self, request: Request, response: Response, token: str) -> None:
        signed = self._session_signer.sign(token).decode()
        self._set(request, response, SESSION_COOKIE, signed, int(self.lifetime.total_seconds()))
        # A fresh CSRF seed with every sign-in: a seed planted before it is worth nothing after.
        self._set(request, response, CSRF_COOKIE, self._new_csrf_seed(), None)

    def clear_session(self, request: Request, response: Response) -> None:
        self._clear(request, response, SESSION_COOKIE)

    # -- CSRF ------------------------------------------------------------------------------------

    def _new_csrf_seed(self) -> str:
        return self._csrf_signer.sign(secrets.token_urlsafe(32)).decode()

    def _csrf_seed(self, request: Request) -> str | None:
        signed = request.cookies.get(CSRF_COOKIE)
        if not signed:
            return None
        try:
            self._csrf_signer.unsign(signed)
        except BadSignature:
            return None
        return signed

    def csrf_token(self, request: Request) -> str:
        """The token for this browser's forms; makes its seed cookie (set by `finish`) if needed."""
        seed = self._csrf_seed(request) or getattr(request.state, "new_csrf_seed", None)
        if seed is None:
            seed = self._new_csrf_seed()
            request.state.new_csrf_seed = seed
        return hmac.new(self.secret, b"csrf:" + seed.encode(), hashlib.sha256).hexdigest()

    def csrf_valid(self, request: Request, submitted: str | None) -> bool:
        seed = self._csrf_seed(request)
        if seed is None or not submitted:
            return False
        expected = hmac.new(self.secret, b"csrf:" + seed.encode(), hashlib.sha256).hexdigest()
        return hmac.compare_digest(expected, submitted)

    # -- flash messages --------------------------------------------------------------------------

    def flash(self, request: Request, response: Response, message: str) -> None:
        """A one-line notice shown on the next page (after a redirect)."""
        self._set(request, response, FLASH_COOKIE, self._flash_signer.dumps(message[:300]), 60)

    def take_flash(self, request: Request) -> str | None:
        signed = request.cookies.get(FLASH_COOKIE)
        if not signed:
            return None
        request.state.flash_taken = True
        try:
            message = self._flash_signer.loads(signed, max_age=60)
        except BadSignature:
            return None
        return message if isinstance(message, str) else None

    # -- every console response ------------------------------------------------------------------

    def finish(self, request: Request, response: Response) -> None:
        """Cookies this request started or used up, and headers every console page carries."""
        seed = getattr(request.state, "new_csrf_seed", None)
        if seed is not None and CSRF_COOKIE not in _set_cookie_names(response):
            self._set(request, response, CSRF_COOKIE, seed, None)
        if getattr(request.state, "flash_taken", False):
            self._clear(request, response, FLASH_COOKIE)
        for name, value in SECURITY_HEADERS.items():
            response.headers.setdefault(name, value)


# Pages carry secrets (a new key is shown once): never cached. Scripts and styles come from this
# server only; nothing inline, so an injected <script> would not run.
SECURITY_HEADERS = {
    "Cache-Control": "no-store",
    "Content-Security-Policy": (
        "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
        "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
}


def _set_cookie_names(response: Response) -> set[str]:
    names = set()
    for key, value in response.raw_headers:
        if key == b"set-cookie":
            names.add(value.split(b"=", 1)[0].decode())
    return names


def security_of(request: Request) -> ConsoleSecurity:
    security: ConsoleSecurity = request.app.state.console
    return security


async def current_user(request: Request) -> UserView | None:
    """The signed-in user, looked up once per request."""
    if hasattr(request.state, "user"):
        user: UserView | None = request.state.user
        return user
    token = security_of(request).session_token(request)
    user = None
    if token is not None:
        db: Database = request.app.state.db

        def load() -> UserView | None:
            with db.session() as session:
                return console_sessions.user_of(session, token)

        user = await run_in_threadpool(load)
    request.state.user = user
    return user


async def verify_csrf(request: Request) -> None:
    """Refuses a state-changing request whose CSRF token is missing or wrong, or that another site sent."""
    if request.method in SAFE_METHODS:
        return
    if request.headers.get("sec-fetch-site") == "cross-site":
        raise CsrfRefused()
    submitted = request.headers.get(CSRF_HEADER)
    if submitted is None:
        form = await request.form()
        value = form.get(CSRF_FIELD)
        submitted = value if isinstance(value, str) else None
    if not security_of(request).csrf_valid(request, submitted):
        raise CsrfRefused()


async def require_user(request: Request) -> UserView:
    user = await current_user(request)
    if user is None:
        raise SignInRequired()
    return user


async def require_member(request: Request) -> UserView:
    user = await require_user(request)
    if user.tenant_id is None:
        raise ConsoleForbidden(
            "This account belongs to no tenant, so it has no keys, adapters or usage. "
            "Admins manage tenants under Admin."
        )
    return user


async def require_admin(request: Request) -> UserView:
    user = await require_user(request)
    if not user.is_admin:
        raise ConsoleForbidden("Only platform admins may open this page.")
    return user


SignedIn = Annotated[UserView, Depends(require_user)]
Member = Annotated[UserView, Depends(require_member)]
Admin = Annotated[UserView, Depends(require_admin)]

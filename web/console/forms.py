"""Console request bodies: none is read before its sender is known, and never much of one.

FastAPI reads a route's form before any of its dependencies run, and Starlette spools a multipart part
over 1 MiB to disk, so a router-wide CSRF dependency used to take (and write to disk) a whole body of any
size before refusing it, from anyone. Every console route is made by `GuardedRoute` (a FastAPI route
class, set on each console router), which for every state-changing request, before the route reads a byte:

1. authenticates: no signed-in user is SignInRequired (the sign-in form, whose sender has no session yet,
   skips this step: `SignInFormRoute`);
2. applies what of CSRF needs no body: a cross-site request, or an `X-CSRF-Token` header that is wrong,
   is refused;
3. bounds the body: a Content-Length over the route's limit is refused unread (413); otherwise the body
   is read into memory, counted as it streams (chunked bodies too), and refused once past the limit.

The route then parses its form from that memory (no part can reach the spool's disk threshold) and
`verify_csrf` checks the form's token. The adapter upload streams its own multipart body with its own
bounds (services/multipart.py) and takes steps 1 and 2 only (`StreamedBodyRoute`).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.types import Message, Receive

from .security import CSRF_HEADER, SAFE_METHODS, CsrfRefused, SignInRequired, current_user, security_of

# Every console form is a few short fields (names, numbers, a password, the CSRF token): 64 KiB is far
# above the longest, and small enough to hold in memory for a request that is refused.
FORM_MAX_BYTES = 64 * 1024

Handler = Callable[[Request], Coroutine[Any, Any, Response]]


class FormTooLarge(Exception):
    """A console request body over its route's limit (answered 413, the rest of the body unread)."""

    def __init__(self, limit: int):
        super().__init__(f"the form is larger than {limit} bytes")
        self.limit = limit


class GuardedRoute(APIRoute):
    """A console route: sign-in, CSRF header, then a bounded body, before the route reads its body."""

    authenticate = True
    # None: the route reads its own body, bounded on its own terms.
    max_body_bytes: int | None = FORM_MAX_BYTES

    def get_route_handler(self) -> Handler:
        handler = super().get_route_handler()
        authenticate, limit = self.authenticate, self.max_body_bytes

        async def guarded(request: Request) -> Response:
            if request.method in SAFE_METHODS:
                return await handler(request)
            if authenticate and await current_user(request) is None:
                raise SignInRequired()
            _check_csrf_header(request)
            if limit is None:
                return await handler(request)
            body = await read_bounded(request, limit)
            return await handler(Request(request.scope, _replay(body, request.receive)))

        return guarded


class SignInFormRoute(GuardedRoute):
    """The sign-in form (and signing out): no session to check yet, the same bound on the body."""

    authenticate = False


class StreamedBodyRoute(GuardedRoute):
    """A route that streams its own body (the adapter upload): sign-in and CSRF header only."""

    max_body_bytes = None


def _check_csrf_header(request: Request) -> None:
    """CSRF's checks that need no body; a form's token field is checked later by `verify_csrf`."""
    if request.headers.get("sec-fetch-site") == "cross-site":
        raise CsrfRefused()
    header = request.headers.get(CSRF_HEADER)
    if header is not None and not security_of(request).csrf_valid(request, header):
        raise CsrfRefused()


async def read_bounded(request: Request, limit: int) -> bytes:
    """The whole body, or FormTooLarge: by its Content-Length before a byte is read, else once more than
    `limit` bytes have arrived (the rest is never read)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:  # a malformed length is left to the count below
        raise FormTooLarge(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise FormTooLarge(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """An ASGI `receive` that hands the route the body already read, then what the client sends next
    (a disconnect, which streaming responses listen for)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay

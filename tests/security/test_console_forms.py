"""Console forms read nothing before their sender is known, and never much (issue 29, item 4).

The router-wide CSRF check awaited `request.form()` before anyone was authenticated, and FastAPI reads a
route's form before its dependencies anyway: an unauthenticated 7 MiB POST to /console/keys,
/console/admin/tenants or /console/sign-in was read whole and about 7 MiB spooled to disk before the 403.
Measured here: the body chunks pulled from the client (an ASGI `receive` that counts) and the bytes this
process wrote (the kernel's count, /proc/self/io).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from loraplex.web.console.forms import FORM_MAX_BYTES
from loraplex.web.db.models import UserRole
from loraplex.web.services.gateway import MAX_REQUEST_BODY_BYTES
from tests.security.test_uploads import MULTIPART, CountingBody, call, form_body, written_bytes
from tests.web.conftest import (  # noqa: F401  (fixtures)
    app_factory,
    pg_admin_url,
    pg_template,
    pg_url,
)
from tests.web.console_client import csrf_of, make_user, post_form, sign_in

MiB = 1024 * 1024
BIG = 7 * MiB  # what the review sent
# What a refusal may write: log lines, nothing of the body. The kernel counts the whole process, and under
# `pytest -n 2` other threads of the worker write too (86 KiB once during one POST); a body read to disk
# writes at least BIG - 1 MiB (Starlette spools a file part past 1 MiB), far above this.
WRITE_SLACK = 1 * MiB
# Forms behind a session (the review's two, and one of each other console router that takes a form).
SIGNED_IN_FORMS = [
    "/console/keys",
    "/console/admin/tenants",
    "/console/adapters/a1/delete",
    "/console/playground",
    "/console/sign-out",
]


@pytest.fixture
def console(
    pg_url: str,  # noqa: F811
    app_factory: Callable[..., FastAPI],  # noqa: F811
) -> Iterator[FastAPI]:
    app = app_factory(pg_url)
    with TestClient(app):  # runs the app's start-up (database, console secret)
        yield app


def big_form(token: str = "") -> bytes:
    """A form whose file part Starlette would spool to disk past 1 MiB, the CSRF field first."""
    return form_body({"csrf_token": token, "name": "k"}, [("x.json", bytes(BIG))])


def post(
    app: FastAPI, path: str, body: CountingBody, declared: bool, headers: dict[str, str] | None = None
) -> tuple[int, int]:
    """(status, bytes this process wrote) of one raw POST; `declared`: with a Content-Length."""
    before = written_bytes()
    status, _ = call(app, path, {**MULTIPART, **(headers or {})}, body, body.total if declared else None)
    return status, written_bytes() - before


def session_cookies(app: FastAPI, email: str, role: UserRole = UserRole.MEMBER) -> tuple[str, str]:
    """(cookie header, CSRF token) of a signed-in browser."""
    make_user(app, email, role=role, tenant=None if role == UserRole.ADMIN else "acme")
    browser = TestClient(app)
    assert sign_in(browser, email).status_code == 303
    token = csrf_of(browser.get("/console/keys" if role == UserRole.MEMBER else "/console/admin/tenants"))
    return "; ".join(f"{k}={v}" for k, v in browser.cookies.items()), token


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_an_unauthenticated_big_form_is_not_read(console: FastAPI, declared: bool) -> None:
    for path in ["/console/keys", "/console/admin/tenants", "/console/adapters/a1/delete"]:
        body = CountingBody(big_form())
        status, wrote = post(console, path, body, declared)
        assert status == 303, path  # sent to sign in, having sent nothing
        assert body.pulled == 0, path
        assert wrote < WRITE_SLACK, (path, wrote)


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_a_big_sign_in_form_is_cut_off_at_the_small_limit(console: FastAPI, declared: bool) -> None:
    """Signing in has no session to check: the small limit comes before reading."""
    body = CountingBody(big_form())
    status, wrote = post(console, "/console/sign-in", body, declared)
    assert status == 413
    if declared:
        assert body.pulled == 0
    else:
        assert body.pulled * body.chunk <= FORM_MAX_BYTES + body.chunk  # the rest is never read
    assert wrote < WRITE_SLACK, wrote


def test_a_signed_in_big_form_is_refused_by_csrf_then_by_size(console: FastAPI) -> None:
    cookies, token = session_cookies(console, "ada@acme.test")
    admin_cookies, admin_token = session_cookies(console, "root@platform.test", UserRole.ADMIN)
    for path in SIGNED_IN_FORMS:
        jar, good = (admin_cookies, admin_token) if "/admin/" in path else (cookies, token)
        # A wrong token in the header, or a cross-site sender: refused before a byte of the body.
        for headers in ({"x-csrf-token": "0" * 64}, {"sec-fetch-site": "cross-site"}):
            body = CountingBody(big_form(good))
            status, _ = post(console, path, body, True, {"cookie": jar, **headers})
            assert (status, body.pulled) == (403, 0), (path, headers)
        # Past CSRF's header check, the size: declared, refused unread; undeclared, cut off at the limit.
        for declared in (True, False):
            body = CountingBody(big_form(good))
            status, wrote = post(console, path, body, declared, {"cookie": jar, "x-csrf-token": good})
            limit = MAX_REQUEST_BODY_BYTES if path == "/console/playground" else FORM_MAX_BYTES
            assert status == 413, (path, declared)
            assert body.pulled * body.chunk <= (0 if declared else limit + body.chunk), (path, declared)
            assert wrote < WRITE_SLACK, (path, declared, wrote)


def test_console_forms_still_work(console: FastAPI) -> None:
    make_user(console, "ada@acme.test", tenant="acme")
    make_user(console, "root@platform.test", role=UserRole.ADMIN)
    member, admin = TestClient(console), TestClient(console)
    assert sign_in(member, "ada@acme.test").status_code == 303
    made = post_form(member, "/console/keys", "/console/keys", {"name": "ci"})
    assert made.status_code == 201 and "lpx_" in made.text
    # The token in the header instead of the form, as the page's scripts send it.
    token = csrf_of(member.get("/console/keys"))
    scripted = member.post("/console/keys", data={"name": "ci2"}, headers={"X-CSRF-Token": token})
    assert scripted.status_code == 201 and "lpx_" in scripted.text
    # A form without its token is still refused, now from memory.
    assert member.post("/console/keys", data={"name": "ci3"}).status_code == 403
    assert sign_in(admin, "root@platform.test").status_code == 303
    tenant = post_form(admin, "/console/admin/tenants", "/console/admin/tenants", {"name": "globex"})
    assert tenant.status_code in (200, 303) and "globex" in admin.get("/console/admin/tenants").text
    signed_out = post_form(member, "/console/keys", "/console/sign-out", {}, follow_redirects=False)
    assert signed_out.status_code == 303

"""Helpers for console tests without a browser: users made through the services, forms posted with
the page's CSRF token the way a browser would."""

from __future__ import annotations

import re
import uuid

from fastapi import FastAPI
from fastapi.testclient import TestClient
from httpx import Response

from loraplex.web.db.models import UserRole
from loraplex.web.services import tenants, users

PASSWORD = "correct horse battery"
CSRF = re.compile(r'name="csrf_token" value="([^"]+)"')


def make_user(
    app: FastAPI, email: str, role: UserRole = UserRole.MEMBER, tenant: str | None = None
) -> users.UserView:
    """A user (and its tenant, made if missing) straight through the services."""
    with app.state.db.session() as session:
        tenant_id: uuid.UUID | None = None
        if tenant is not None:
            found = [t for t in tenants.list_tenants(session) if t.name == tenant]
            tenant_id = found[0].id if found else tenants.create_tenant(session, tenant).id
        return users.create_user(session, email, PASSWORD, role, tenant_id)


def csrf_of(page: Response) -> str:
    match = CSRF.search(page.text)
    assert match, f"no CSRF token on {page.url}"
    return match.group(1)


def post_form(
    client: TestClient, page_path: str, action: str, data: dict[str, str], **kw: object
) -> Response:
    """Open `page_path`, then post `data` to `action` with the token that page carries."""
    token = csrf_of(client.get(page_path))
    return client.post(action, data={**data, "csrf_token": token}, **kw)  # type: ignore[arg-type]


def sign_in(client: TestClient, email: str, password: str = PASSWORD) -> Response:
    return post_form(
        client,
        "/console/sign-in",
        "/console/sign-in",
        {"email": email, "password": password},
        follow_redirects=False,
    )

"""Request dependencies as Annotated aliases: SessionDep, AdminDep, CurrentTenant (any key of the tenant),
its scoped forms Reader, Manager and KeyManager (services/scopes.py), SettingsDep."""

from __future__ import annotations

import hmac
from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from ..db.session import Database
from ..services import scopes
from ..services.keys import Principal, authenticate
from ..settings import Settings

bearer = HTTPBearer(auto_error=False, description="An API key (lpx_...) or, for /admin, the admin token.")
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]


def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def get_database(request: Request) -> Database:
    db: Database = request.app.state.db
    return db


def get_session(request: Request) -> Iterator[Session]:
    with get_database(request).session() as session:
        yield session


SettingsDep = Annotated[Settings, Depends(get_settings)]
DatabaseDep = Annotated[Database, Depends(get_database)]
SessionDep = Annotated[Session, Depends(get_session)]


def _unauthorized(message: str) -> HTTPException:
    return HTTPException(status.HTTP_401_UNAUTHORIZED, message, headers={"WWW-Authenticate": "Bearer"})


def require_admin(settings: SettingsDep, credentials: Credentials) -> None:
    if settings.admin_token is None:
        raise HTTPException(status.HTTP_403_FORBIDDEN, "the admin API is off: set LORAPLEX_ADMIN_TOKEN")
    expected = settings.admin_token.get_secret_value().encode()
    given = credentials.credentials.encode() if credentials else b""
    if not hmac.compare_digest(given, expected):
        raise _unauthorized("a valid admin token is required as `Authorization: Bearer <token>`")


AdminDep = Annotated[None, Depends(require_admin)]


def principal_of(request: Request, credentials: HTTPAuthorizationCredentials | None) -> Principal | None:
    if credentials is None:
        return None
    with get_database(request).session() as session:
        return authenticate(session, credentials.credentials, request.app.state.pepper)


def current_tenant(request: Request, credentials: Credentials) -> Principal:
    principal = principal_of(request, credentials)
    if principal is None:
        raise _unauthorized("a valid API key is required as `Authorization: Bearer lpx_...`")
    return principal


CurrentTenant = Annotated[Principal, Depends(current_tenant)]


def reader(principal: CurrentTenant) -> Principal:
    scopes.require_read(principal.limits, "read listings or usage")
    return principal


def manager(principal: CurrentTenant) -> Principal:
    scopes.require_manage(principal.limits, "change adapters")
    return principal


def key_manager(principal: CurrentTenant) -> Principal:
    scopes.require_full(principal.limits, "manage API keys")
    return principal


# A key that may read listings and usage (scope read or all).
Reader = Annotated[Principal, Depends(reader)]
# A key that may change adapters (scope all; its adapter list still limits which).
Manager = Annotated[Principal, Depends(manager)]
# A key that may make, rotate and revoke keys (everything: scope all, every adapter, the base models).
KeyManager = Annotated[Principal, Depends(key_manager)]

"""Admin pages: tenants and their quotas, users, deployments and the health of their replicas."""

from __future__ import annotations

import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Form, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import RedirectResponse, Response
from pydantic import ValidationError
from sqlalchemy import func, select

from ..api.deps import SessionDep
from ..db.models import AdapterName, UserRole
from ..schemas import DeploymentCreate, QuotaUpdate, TenantUpdate
from ..services import console_sessions, deployments, tenants, users
from ..services.errors import ServiceError
from ..shapes import KNOWN_SHAPES
from . import replicas
from .forms import GuardedRoute
from .rendering import redirect, render
from .security import Admin, verify_csrf

router = APIRouter(
    tags=["console"],
    include_in_schema=False,
    dependencies=[Depends(verify_csrf)],
    route_class=GuardedRoute,
)
QUOTA_FIELDS = {
    "requests_per_minute": "Requests per minute",
    "tokens_per_minute": "Tokens per minute",
    "max_adapters": "Adapters at most",
    "max_adapter_bytes": "Bytes per adapter at most",
    "max_storage_bytes": "Bytes of all adapters at most",
    "max_pinned_adapters": "Pinned adapter versions at most",
}


@router.get("/console/admin")
def admin_home(_: Admin) -> RedirectResponse:
    return RedirectResponse("/console/admin/tenants", status_code=303)


# -- tenants -------------------------------------------------------------------------------------


def _tenants_page(request: Request, session: SessionDep, status_code: int = 200, **extra: Any) -> Response:
    # Adapters by name, as max_adapters counts them (an adapter's versions are one adapter).
    adapter_counts = dict(
        session.execute(select(AdapterName.tenant_id, func.count()).group_by(AdapterName.tenant_id)).all()
    )
    user_counts: dict[uuid.UUID, int] = {}
    for user in users.list_users(session):
        if user.tenant_id is not None:
            user_counts[user.tenant_id] = user_counts.get(user.tenant_id, 0) + 1
    rows = [(t, adapter_counts.get(t.id, 0), user_counts.get(t.id, 0)) for t in tenants.list_tenants(session)]
    context = {"title": "Tenants", "active": "admin-tenants", "rows": rows, "quota_fields": QUOTA_FIELDS}
    return render(request, "admin_tenants.html", {**context, **extra}, status_code)


@router.get("/console/admin/tenants")
def tenants_page(request: Request, session: SessionDep, _: Admin) -> Response:
    return _tenants_page(request, session)


@router.post("/console/admin/tenants")
def create_tenant(
    request: Request, session: SessionDep, _: Admin, name: Annotated[str, Form()] = ""
) -> Response:
    name = name.strip()
    try:
        TenantUpdate(name=name)  # the API's rule for names
        created = tenants.create_tenant(session, name)
    except ValidationError:
        error = "Use 1 to 128 letters, digits or . _ : - (starting with a letter or digit)."
        return _tenants_page(request, session, 422, name_error=error, name=name)
    except ServiceError as exc:
        return _tenants_page(request, session, exc.status_code, name_error=exc.message, name=name)
    return redirect(request, f"/console/admin/tenants/{created.id}", flash=f"Tenant “{name}” created.")


def _tenant_page(
    request: Request, session: SessionDep, tenant_id: uuid.UUID, status_code: int = 200, **extra: Any
) -> Response:
    try:
        tenant = tenants.get_tenant(session, tenant_id)
    except ServiceError:
        return redirect(request, "/console/admin/tenants", flash="That tenant no longer exists.")
    context = {
        "title": f"Tenant {tenant.name}",
        "active": "admin-tenants",
        "tenant": tenant,
        "members": users.list_users(session, tenant_id),
        "quota_fields": QUOTA_FIELDS,
        "quota_values": {
            f: ("" if getattr(tenant.quota, f) is None else str(getattr(tenant.quota, f)))
            for f in QUOTA_FIELDS
        },
    }
    return render(request, "admin_tenant.html", {**context, **extra}, status_code)


@router.get("/console/admin/tenants/{tenant_id}")
def tenant_page(tenant_id: uuid.UUID, request: Request, session: SessionDep, _: Admin) -> Response:
    return _tenant_page(request, session, tenant_id)


@router.post("/console/admin/tenants/{tenant_id}/quota")
async def set_quota(tenant_id: uuid.UUID, request: Request, _: Admin) -> Response:
    form = await request.form()
    values: dict[str, str] = {f: str(form.get(f, "")).strip() for f in QUOTA_FIELDS}
    errors: dict[str, str] = {}
    parsed: dict[str, int | None] = {}
    for field, raw in values.items():
        if raw == "":
            parsed[field] = None  # blank: unlimited
        elif raw.isdigit():
            parsed[field] = int(raw)
        else:
            errors[field] = "A whole number of 0 or more, or blank for unlimited."
    db = request.app.state.db

    def apply() -> Response:
        with db.session() as session:
            if not errors:
                try:
                    # Limits the form does not show (max_in_flight: the admin API's) are kept as they are.
                    kept = tenants.quota_of(session, tenant_id).model_dump(
                        include=set(QuotaUpdate.model_fields)
                    )
                    tenants.set_quota(session, tenant_id, QuotaUpdate(**{**kept, **parsed}))
                except ValidationError as exc:  # name the byte field that was too large
                    field = next((str(e["loc"][0]) for e in exc.errors() if e["loc"]), "max_adapter_bytes")
                    errors[field] = "A value is too large."
                except ServiceError as exc:
                    return redirect(request, "/console/admin/tenants", flash=exc.message)
                else:
                    return redirect(request, f"/console/admin/tenants/{tenant_id}", flash="Quota saved.")
            return _tenant_page(request, session, tenant_id, 422, quota_errors=errors, quota_values=values)

    return await run_in_threadpool(apply)


@router.post("/console/admin/tenants/{tenant_id}/share")
def set_fair_share(
    tenant_id: uuid.UUID,
    request: Request,
    session: SessionDep,
    _: Admin,
    fair_share_weight: Annotated[str, Form()] = "",
) -> Response:
    """The tenant's share of a busy engine (sent to the engines with each of its requests)."""
    try:
        update = TenantUpdate(fair_share_weight=float(fair_share_weight.strip()))
    except (ValueError, ValidationError):  # ValidationError is a ValueError too: one message for both
        error = "A number above 0 and at most 1000 (1 is an equal share)."
        return _tenant_page(
            request, session, tenant_id, 422, share_error=error, share_value=fair_share_weight
        )
    try:
        tenant = tenants.update_tenant(session, tenant_id, update)
    except ServiceError as exc:
        return redirect(request, "/console/admin/tenants", flash=exc.message)
    return redirect(
        request,
        f"/console/admin/tenants/{tenant_id}",
        flash=f"Fair share weight set to {tenant.fair_share_weight:g}.",
    )


@router.post("/console/admin/tenants/{tenant_id}/status")
def set_tenant_status(
    tenant_id: uuid.UUID,
    request: Request,
    session: SessionDep,
    _: Admin,
    disabled: Annotated[str, Form()] = "",
) -> Response:
    try:
        tenant = tenants.update_tenant(session, tenant_id, TenantUpdate(disabled=disabled == "yes"))
    except ServiceError as exc:
        return redirect(request, "/console/admin/tenants", flash=exc.message)
    message = (
        f"Tenant “{tenant.name}” disabled: its keys and console sign-ins stop working."
        if tenant.disabled
        else f"Tenant “{tenant.name}” enabled."
    )
    return redirect(request, f"/console/admin/tenants/{tenant_id}", flash=message)


# -- users ---------------------------------------------------------------------------------------


def _users_page(request: Request, session: SessionDep, status_code: int = 200, **extra: Any) -> Response:
    context = {
        "title": "Users",
        "active": "admin-users",
        "rows": users.list_users(session),
        "tenants": tenants.list_tenants(session),
        "roles": [r.value for r in UserRole],
        "form": {"role": "member"},
    }
    return render(request, "admin_users.html", {**context, **extra}, status_code)


@router.get("/console/admin/users")
def users_page(request: Request, session: SessionDep, _: Admin) -> Response:
    return _users_page(request, session)


@router.post("/console/admin/users")
def create_user(
    request: Request,
    session: SessionDep,
    _: Admin,
    email: Annotated[str, Form()] = "",
    password: Annotated[str, Form()] = "",
    role: Annotated[str, Form()] = "member",
    tenant_id: Annotated[str, Form()] = "",
    back: Annotated[str, Form()] = "",
) -> Response:
    form = {"email": email, "role": role, "tenant_id": tenant_id}
    try:
        chosen_role = UserRole(role)
        tenant = uuid.UUID(tenant_id) if tenant_id else None
        created = users.create_user(session, email, password, chosen_role, tenant)
    except ValueError:
        return _users_page(
            request, session, 422, error="Choose a role and a tenant from the lists.", form=form
        )
    except ServiceError as exc:
        if back.startswith("/console/admin/tenants/") and tenant_id:
            return _tenant_page(
                request, session, uuid.UUID(tenant_id), exc.status_code, user_error=exc.message, form=form
            )
        return _users_page(request, session, exc.status_code, error=exc.message, form=form)
    where = back if back.startswith("/console/admin/") else "/console/admin/users"
    what = "Admin" if created.is_admin else "User"
    return redirect(request, where, flash=f"{what} {created.email} created; they can sign in now.")


@router.post("/console/admin/users/{user_id}/status")
def set_user_status(
    user_id: uuid.UUID,
    request: Request,
    session: SessionDep,
    admin: Admin,
    disabled: Annotated[str, Form()] = "",
) -> Response:
    if user_id == admin.id:
        return redirect(request, "/console/admin/users", flash="You cannot disable your own account.")
    try:
        user = users.set_disabled(session, user_id, disabled == "yes")
    except ServiceError as exc:
        return redirect(request, "/console/admin/users", flash=exc.message)
    if user.disabled:
        console_sessions.end_all(session, user_id)  # signed out everywhere, at once
    state = "disabled and signed out" if user.disabled else "enabled"
    return redirect(request, "/console/admin/users", flash=f"{user.email} {state}.")


# -- deployments ---------------------------------------------------------------------------------


async def _deployments_page(request: Request, status_code: int = 200, **extra: Any) -> Response:
    db = request.app.state.db

    def load() -> list[Any]:
        with db.session() as session:
            return list(deployments.list_deployments(session, request.app.state.discovery))

    rows = await run_in_threadpool(load)
    health = await replicas.deployment_health(request.app.state.http, rows)
    context = {
        "title": "Deployments",
        "active": "admin-deployments",
        "rows": rows,
        "health": health,
        "known_models": sorted(KNOWN_SHAPES),
        "form": {},
    }
    return render(request, "admin_deployments.html", {**context, **extra}, status_code)


@router.get("/console/admin/deployments")
async def deployments_page(request: Request, _: Admin) -> Response:
    return await _deployments_page(request)


@router.post("/console/admin/deployments")
async def create_deployment(
    request: Request,
    _: Admin,
    name: Annotated[str, Form()] = "",
    base_model: Annotated[str, Form()] = "",
    endpoints: Annotated[str, Form()] = "",
) -> Response:
    urls = [line.strip() for line in endpoints.splitlines() if line.strip()]
    form = {"name": name, "base_model": base_model, "endpoints": endpoints}
    try:
        spec = DeploymentCreate(name=name.strip(), base_model=base_model.strip(), endpoints=urls)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = str(first["loc"][0]) if first.get("loc") else "form"
        error = f"{where.replace('_', ' ')}: {first['msg']}"
        return await _deployments_page(request, 422, error=error, form=form)
    db = request.app.state.db
    loopback = request.app.state.settings.allow_loopback_endpoints

    def create() -> str | None:
        with db.session() as session:
            try:
                deployments.create_deployment(session, spec, allow_loopback=loopback)
            except ServiceError as exc:
                return exc.message
        return None

    refused = await run_in_threadpool(create)
    if refused is not None:
        return await _deployments_page(request, 422, error=refused, form=form)
    return redirect(request, "/console/admin/deployments", flash=f"Deployment “{spec.name}” created.")

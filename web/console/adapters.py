"""Adapters: upload (a progress bar with JavaScript, a plain form without), status, delete after confirming.

The upload runs the same service as `POST /api/v1/adapters`, so the checks, quotas and messages are the
API's. A script upload asks for JSON (errors shown inline, then the page reloads); a plain form post is
answered with the page itself (errors inline) or a redirect.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Form, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from ..api.deps import SessionDep, SettingsDep
from ..services import adapters, deployments, engine_sync, multipart, upload_quota
from ..services.errors import ServiceError
from .forms import GuardedRoute, StreamedBodyRoute
from .rendering import redirect, render
from .security import CSRF_FIELD, CSRF_HEADER, CsrfRefused, Member, security_of, verify_csrf

# No router-wide verify_csrf: it reads the whole form, and the upload must check its token before the
# files arrive (it does so itself). Every other state-changing route here takes CSRF explicitly.
router = APIRouter(tags=["console"], include_in_schema=False, route_class=GuardedRoute)
# The upload streams its own body, bounded by the tenant's upload limit (services/multipart.py).
uploads = APIRouter(tags=["console"], include_in_schema=False, route_class=StreamedBodyRoute)
CSRF = [Depends(verify_csrf)]
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
FORM_FIELDS = ("name", "deployment", CSRF_FIELD)


def _wants_json(request: Request) -> bool:
    return "application/json" in request.headers.get("accept", "")


def _page(
    request: Request, session: SessionDep, user: Member, status_code: int = 200, **extra: Any
) -> Response:
    assert user.tenant_id is not None
    rows = adapters.list_adapters(session, user.tenant_id)
    context = {
        "title": "Adapters",
        "active": "adapters",
        "rows": rows,
        "deployments": deployments.list_deployments(session),
        # Another tab's upload still in progress: the page polls until it is ready or failed.
        "validating": any(a.status in ("uploaded", "validating") for a in rows),
    }
    return render(request, "adapters.html", {**context, **extra}, status_code)


@router.get("/console/adapters", dependencies=CSRF)
def adapters_page(request: Request, session: SessionDep, user: Member) -> Response:
    return _page(request, session, user)


@router.get("/console/adapters/status", dependencies=CSRF)
def adapters_status(session: SessionDep, user: Member) -> dict[str, str]:
    """Each adapter's status, for the page to poll while one is still validating."""
    assert user.tenant_id is not None
    return {a.name: a.status for a in adapters.list_adapters(session, user.tenant_id)}


@uploads.post("/console/adapters")
async def upload_adapter(
    request: Request, session: SessionDep, settings: SettingsDep, user: Member
) -> Response:
    # Signed in (Member), CSRF-checked and within quota before any file byte is read: services.multipart.
    assert user.tenant_id is not None
    check_csrf = _csrf_check(request)
    name = deployment = ""
    errors: dict[str, str] = {}
    status_code = 422
    try:
        limit = await run_in_threadpool(
            upload_quota.upload_byte_limit, session, user.tenant_id, settings.max_upload_bytes
        )
        limits = multipart.FormLimits(max_file_bytes=limit)
        multipart.check_content_length(request, limits)
        async with multipart.receive_form(request, limits, FORM_FIELDS, before_files=check_csrf) as form:
            name = form.fields.get("name", "").strip()
            deployment = form.fields.get("deployment", "")
            if not NAME.match(name):
                errors["name"] = (
                    "Use 1 to 128 letters, digits or . _ : - (starting with a letter or digit); "
                    "this is the `model` clients will request."
                )
            if not deployment:
                errors["deployment"] = "Choose the deployment whose base model the adapter was trained on."
            chosen = [f for f in form.files if f.filename]  # a browser sends an empty part for no file
            if not chosen:
                errors["files"] = (
                    "Choose adapter_config.json and adapter_model.safetensors, or one .zip / .tar.gz."
                )
            if not errors:
                await run_in_threadpool(
                    adapters.upload_adapter,
                    session,
                    request.app.state.store,
                    user.tenant_id,
                    name,
                    deployment,
                    chosen,
                    settings.max_upload_bytes,
                    f"user {user.email}",  # kept on the version as who uploaded it
                )
    except ServiceError as exc:
        field = "name" if exc.status_code == 409 else "deployment" if exc.status_code == 404 else "files"
        errors[field] = exc.message
        status_code = exc.status_code
    if not errors:
        message = f"Adapter “{name}” is ready: request it as model “{name}”."
        if _wants_json(request):
            response = JSONResponse({"status": "ready", "redirect": "/console/adapters"}, status_code=201)
            security_of(request).flash(request, response, message)
            return response
        return redirect(request, "/console/adapters", flash=message)
    if _wants_json(request):
        return JSONResponse({"errors": errors}, status_code=status_code)
    form_values = {"name": name, "deployment": deployment}
    return await run_in_threadpool(
        _page, request, session, user, status_code, errors=errors, form=form_values
    )


def _csrf_check(request: Request) -> Callable[[dict[str, str]], None]:
    """verify_csrf's rules without reading the form: the header now, else the form's token field,
    checked when the first file part starts (the page's form puts the token first)."""
    if request.headers.get("sec-fetch-site") == "cross-site":
        raise CsrfRefused()
    security = security_of(request)
    header = request.headers.get(CSRF_HEADER)
    if header is not None and not security.csrf_valid(request, header):
        raise CsrfRefused()

    def check_form_token(fields: dict[str, str]) -> None:
        if header is None and not security.csrf_valid(request, fields.get(CSRF_FIELD)):
            raise CsrfRefused()

    return check_form_token


@router.post("/console/adapters/{name}/delete", dependencies=CSRF)
def delete_adapter(
    name: str, request: Request, session: SessionDep, user: Member, confirm: Annotated[str, Form()] = ""
) -> Response:
    assert user.tenant_id is not None
    if adapters.find_adapter(session, user.tenant_id, name) is None:
        return redirect(request, "/console/adapters", flash=f"There is no adapter “{name}”.")
    if confirm != "yes":  # without JavaScript, the confirmation is a page of its own
        return render(
            request,
            "confirm.html",
            {
                "title": "Delete adapter",
                "active": "adapters",
                "question": f"Delete the adapter “{name}”?",
                "consequence": "Requests for it fail from now on; its usage history stays. "
                "This cannot be undone, but you can upload it again.",
                "action": f"/console/adapters/{name}/delete",
                "confirm_label": "Delete adapter",
                "back": "/console/adapters",
            },
        )
    adapters.delete_adapter(session, user.tenant_id, name, request.app.state.store)
    engine_sync.wake(request.app)  # engines forget it soon; this request does not wait for them
    return redirect(request, "/console/adapters", flash=f"Adapter “{name}” deleted.")


router.include_router(uploads)

"""Adapters: upload (a progress bar with JavaScript, a plain form without), status, delete after confirming.

The upload runs the same service as `POST /api/v1/adapters`, so the checks, quotas and messages are the
API's. A script upload asks for JSON (errors shown inline, then the page reloads); a plain form post is
answered with the page itself (errors inline) or a redirect.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from fastapi import APIRouter, Depends, File, Form, Request, UploadFile
from fastapi.responses import JSONResponse, Response

from loraplex.adapters import LocalArtifactStore

from ..api.deps import SessionDep, SettingsDep
from ..services import adapters, deployments
from ..services.errors import ServiceError
from ..services.uploads import UploadedFile
from .rendering import redirect, render
from .security import Member, security_of, verify_csrf

router = APIRouter(tags=["console"], include_in_schema=False, dependencies=[Depends(verify_csrf)])
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


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
        "validating": any(a.status == "validating" for a in rows),
    }
    return render(request, "adapters.html", {**context, **extra}, status_code)


@router.get("/console/adapters")
def adapters_page(request: Request, session: SessionDep, user: Member) -> Response:
    return _page(request, session, user)


@router.get("/console/adapters/status")
def adapters_status(session: SessionDep, user: Member) -> dict[str, str]:
    """Each adapter's status, for the page to poll while one is still validating."""
    assert user.tenant_id is not None
    return {a.name: a.status for a in adapters.list_adapters(session, user.tenant_id)}


@router.post("/console/adapters")
def upload_adapter(
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
    user: Member,
    name: Annotated[str, Form()] = "",
    deployment: Annotated[str, Form()] = "",
    files: Annotated[list[UploadFile] | None, File()] = None,
) -> Response:
    assert user.tenant_id is not None
    name = name.strip()
    errors: dict[str, str] = {}
    status_code = 422
    if not NAME.match(name):
        errors["name"] = (
            "Use 1 to 128 letters, digits or . _ : - (starting with a letter or digit); "
            "this is the `model` clients will request."
        )
    if not deployment:
        errors["deployment"] = "Choose the deployment whose base model the adapter was trained on."
    chosen = [f for f in files or [] if f.filename]
    if not chosen:
        errors["files"] = "Choose adapter_config.json and adapter_model.safetensors, or one .zip / .tar.gz."
    if not errors:
        uploaded = [UploadedFile(filename=f.filename or "", stream=f.file) for f in chosen]
        store = LocalArtifactStore(settings.artifacts())
        try:
            adapters.upload_adapter(
                session, store, user.tenant_id, name, deployment, uploaded, settings.max_upload_bytes
            )
        except ServiceError as exc:
            field = "name" if exc.status_code == 409 else "deployment" if exc.status_code == 404 else "files"
            errors[field] = exc.message
            status_code = exc.status_code
        else:
            message = f"Adapter “{name}” is ready: request it as model “{name}”."
            if _wants_json(request):
                response = JSONResponse({"status": "ready", "redirect": "/console/adapters"}, status_code=201)
                security_of(request).flash(request, response, message)
                return response
            return redirect(request, "/console/adapters", flash=message)
    if _wants_json(request):
        return JSONResponse({"errors": errors}, status_code=status_code)
    return _page(
        request, session, user, status_code, errors=errors, form={"name": name, "deployment": deployment}
    )


@router.post("/console/adapters/{name}/delete")
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
    adapters.delete_adapter(session, user.tenant_id, name)
    return redirect(request, "/console/adapters", flash=f"Adapter “{name}” deleted.")

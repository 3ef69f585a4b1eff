"""Tenant: upload, list and delete adapters and their versions, and choose the active version (rollback).
A delete reaches the engines through services/engine_sync.py."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request, Response, status
from fastapi.exceptions import RequestValidationError
from pydantic import StringConstraints, TypeAdapter, ValidationError
from starlette.concurrency import run_in_threadpool

from ...schemas import (
    PRINTABLE,
    AdapterPin,
    AdapterPublic,
    AdapterRollback,
    AdapterVersionPublic,
    Name,
    TrafficSplit,
)
from ...services import adapters, engine_sync, multipart, pins, scopes, traffic, upload_quota, versions
from ..deps import Manager, Reader, SessionDep, SettingsDep

router = APIRouter(prefix="/api/v1/adapters", tags=["adapters"])
AdapterName = Annotated[str, Path(max_length=128, pattern=PRINTABLE)]
Version = Annotated[int, Path(ge=1, le=2**31 - 1)]
DeploymentName = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=PRINTABLE)]
FORM_FIELDS = {"name": TypeAdapter(Name), "deployment": TypeAdapter(DeploymentName)}

# The route reads its body itself (after authentication), so the form is described here by hand.
UPLOAD_FORM: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["name", "deployment", "files"],
                    "properties": {
                        "name": {
                            "type": "string",
                            "pattern": r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$",
                            "description": "The adapter's name, the `model` to request: a name "
                            "the tenant has gets a new version (the same bytes: none).",
                        },
                        "deployment": {
                            "type": "string",
                            "minLength": 1,
                            "maxLength": 128,
                            "pattern": PRINTABLE,
                            "description": "The deployment whose base model the adapter fits.",
                        },
                        "files": {
                            "type": "array",
                            "items": {"type": "string", "format": "binary"},
                            "maxItems": multipart.FormLimits(0).max_files,
                            "description": "adapter_config.json and adapter_model.safetensors, "
                            "or one .zip / .tar.gz of them",
                        },
                    },
                }
            }
        },
    }
}


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    responses={
        200: {"description": "the bytes are a version of this adapter already: that version, now active"},
        403: {"description": "adapter quota reached, or the key's scope does not allow it"},
        409: {"description": "a version of this adapter is being uploaded, or it fits another deployment"},
        413: {"description": "too large"},
        415: {"description": "not multipart/form-data"},
        422: {},
    },
    openapi_extra=UPLOAD_FORM,
)
async def upload_adapter(
    request: Request, response: Response, session: SessionDep, settings: SettingsDep, principal: Manager
) -> AdapterPublic:
    # Authenticated (CurrentTenant) and within quota before the body is read: see services.multipart.
    limit = await run_in_threadpool(
        upload_quota.upload_byte_limit, session, principal.tenant_id, settings.max_upload_bytes
    )
    limits = multipart.FormLimits(max_file_bytes=limit)
    multipart.check_content_length(request, limits)
    async with multipart.receive_form(request, limits, fields=FORM_FIELDS) as form:
        values = _validated(form.fields, has_files=bool(form.files))
        scopes.require_adapter(principal.limits, values["name"], "name")
        store = request.app.state.store  # the one ArtifactStore, made by create_app
        uploaded = await run_in_threadpool(
            adapters.upload_version,
            session,
            store,
            principal.tenant_id,
            values["name"],
            values["deployment"],
            form.files,
            settings.max_upload_bytes,
            principal.actor,
        )
        if not uploaded.created:
            response.status_code = status.HTTP_200_OK
        return uploaded.adapter


def _validated(fields: dict[str, str], has_files: bool) -> dict[str, str]:
    """The text fields, checked like FastAPI's Form parameters and refused in the same 422 shape."""
    errors: list[Any] = []
    if not has_files:
        errors.append({"type": "missing", "loc": ("body", "files"), "msg": "Field required", "input": None})
    values: dict[str, str] = {}
    for field, adapter in FORM_FIELDS.items():
        if field not in fields:
            errors.append({"type": "missing", "loc": ("body", field), "msg": "Field required", "input": None})
            continue
        try:
            values[field] = adapter.validate_python(fields[field])
        except ValidationError as exc:
            errors.extend({**error, "loc": ("body", field)} for error in exc.errors(include_url=False))
    if errors:
        raise RequestValidationError(errors)
    return values


@router.get("")
def list_adapters(session: SessionDep, principal: Reader) -> list[AdapterPublic]:
    """Each adapter as its active version (those the key may use)."""
    listed = adapters.list_adapters(session, principal.tenant_id)
    return [a for a in listed if principal.limits.may_use(a.name)]


@router.get("/{name}")
def get_adapter(name: AdapterName, session: SessionDep, principal: Reader) -> AdapterPublic:
    scopes.require_adapter(principal.limits, name)
    return adapters.get_adapter(session, principal.tenant_id, name)


@router.delete("/{name}", status_code=status.HTTP_204_NO_CONTENT)
def delete_adapter(name: AdapterName, request: Request, session: SessionDep, principal: Manager) -> None:
    """Delete the adapter with every version of it."""
    scopes.require_adapter(principal.limits, name)
    adapters.delete_adapter(session, principal.tenant_id, name, request.app.state.store)
    engine_sync.wake(request.app)  # engines forget it soon; this request does not wait for them


@router.get("/{name}/versions")
def list_versions(name: AdapterName, session: SessionDep, principal: Reader) -> list[AdapterVersionPublic]:
    scopes.require_adapter(principal.limits, name)
    return versions.list_versions(session, principal.tenant_id, name)


@router.get("/{name}/versions/{version}")
def get_version(name: AdapterName, version: Version, session: SessionDep, principal: Reader) -> AdapterPublic:
    scopes.require_adapter(principal.limits, name)
    return adapters.get_version(session, principal.tenant_id, name, version)


@router.delete(
    "/{name}/versions/{version}",
    status_code=status.HTTP_204_NO_CONTENT,
    responses={409: {"description": "the version is the active one"}},
)
def delete_version(
    name: AdapterName, version: Version, request: Request, session: SessionDep, principal: Manager
) -> None:
    """Delete one version that is not the active one."""
    scopes.require_adapter(principal.limits, name)
    versions.delete_version(session, principal.tenant_id, name, version, request.app.state.store)
    engine_sync.wake(request.app)


@router.post("/{name}/rollback", responses={409: {"description": "no such ready version to make active"}})
def rollback(
    name: AdapterName, body: AdapterRollback, session: SessionDep, principal: Manager
) -> AdapterPublic:
    """Make a ready version the active one: `version`, or the newest ready one before the active."""
    scopes.require_adapter(principal.limits, name)
    return versions.rollback(session, principal.tenant_id, name, body.version)


@router.post(
    "/{name}/pin",
    responses={
        403: {"description": "over the tenant's max_pinned_adapters"},
        409: {"description": "the version is not ready, or an engine's pool cannot hold it (nothing pinned)"},
    },
)
async def pin_adapter(
    name: AdapterName, body: AdapterPin, request: Request, principal: Manager
) -> AdapterPublic:
    """Pin a version (default: the active one) resident on its deployment's engines: never evicted."""
    scopes.require_adapter(principal.limits, name)
    return await pins.pin(request.app, principal.tenant_id, name, body.version)


@router.delete("/{name}/pin")
async def unpin_adapter(
    name: AdapterName,
    request: Request,
    principal: Manager,
    version: Annotated[int | None, Query(ge=1, le=2**31 - 1)] = None,
) -> AdapterPublic:
    """Unpin `version`, or every pinned version of the name: evicted again like any unused adapter."""
    scopes.require_adapter(principal.limits, name)
    return await pins.unpin(request.app, principal.tenant_id, name, version)


@router.put("/{name}/traffic", responses={409: {"description": "a version of the split is not ready"}})
def set_traffic(
    name: AdapterName, body: TrafficSplit, session: SessionDep, principal: Manager
) -> AdapterPublic:
    """Share the name's requests between ready versions by weight (a canary), e.g. {"1": 90, "2": 10}."""
    scopes.require_adapter(principal.limits, name)
    return traffic.set_traffic(session, principal.tenant_id, name, body.versions(), body.sticky)


@router.delete("/{name}/traffic")
def clear_traffic(name: AdapterName, session: SessionDep, principal: Manager) -> AdapterPublic:
    """End the split: every request for the name goes to its active version again."""
    scopes.require_adapter(principal.limits, name)
    return traffic.clear_traffic(session, principal.tenant_id, name)

"""Tenant: upload, list and delete adapters."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, File, Form, Path, Request, UploadFile, status

from loraplex.adapters import LocalArtifactStore

from ...schemas import PRINTABLE, AdapterPublic, Name
from ...services import adapters
from ...services.uploads import UploadedFile
from ..deps import CurrentTenant, SessionDep, SettingsDep

router = APIRouter(prefix="/api/v1/adapters", tags=["adapters"])
AdapterName = Annotated[str, Path(max_length=128, pattern=PRINTABLE)]


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    responses={409: {"description": "name taken"}, 413: {"description": "too large"}, 422: {}},
)
def upload_adapter(
    name: Annotated[Name, Form(description="Unique among this tenant's adapters; the `model` to request.")],
    deployment: Annotated[
        str,
        Form(
            max_length=128, pattern=PRINTABLE, description="The deployment whose base model the adapter fits."
        ),
    ],
    files: Annotated[
        list[UploadFile],
        File(description="adapter_config.json and adapter_model.safetensors, or one .zip / .tar.gz of them"),
    ],
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
    principal: CurrentTenant,
) -> AdapterPublic:
    uploaded = [UploadedFile(filename=f.filename or "", stream=f.file) for f in files]
    store = LocalArtifactStore(settings.artifacts())
    return adapters.upload_adapter(
        session, store, principal.tenant_id, name, deployment, uploaded, settings.max_upload_bytes
    )


@router.get("")
def list_adapters(session: SessionDep, principal: CurrentTenant) -> list[AdapterPublic]:
    return adapters.list_adapters(session, principal.tenant_id)


@router.get("/{name}")
def get_adapter(name: AdapterName, session: SessionDep, principal: CurrentTenant) -> AdapterPublic:
    return adapters.get_adapter(session, principal.tenant_id, name)


@router.delete("/{name}", status_code=status.HTTP_204_NO_CONTENT)
def delete_adapter(name: AdapterName, session: SessionDep, principal: CurrentTenant) -> None:
    adapters.delete_adapter(session, principal.tenant_id, name)

"""Admin: deployments (a base model and its engine replicas, static or discovered in Kubernetes)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Request, status

from ...schemas import DeploymentCreate, DeploymentPublic, DeploymentUpdate
from ...services import deployments
from ..deps import AdminDep, SessionDep

router = APIRouter(prefix="/admin/v1/deployments", tags=["admin"])
DeploymentName = Annotated[str, Path(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")]


@router.post("", status_code=status.HTTP_201_CREATED)
def create_deployment(
    body: DeploymentCreate, request: Request, session: SessionDep, _: AdminDep
) -> DeploymentPublic:
    loopback = request.app.state.settings.allow_loopback_endpoints
    made = deployments.create_deployment(session, body, allow_loopback=loopback)
    return deployments.with_replicas(made, request.app.state.discovery)


@router.get("")
def list_deployments(request: Request, session: SessionDep, _: AdminDep) -> list[DeploymentPublic]:
    return deployments.list_deployments(session, request.app.state.discovery)


@router.get("/{name}")
def get_deployment(
    name: DeploymentName, request: Request, session: SessionDep, _: AdminDep
) -> DeploymentPublic:
    return deployments.to_public(deployments.by_name(session, name), request.app.state.discovery)


@router.patch("/{name}")
def update_deployment(
    name: DeploymentName, body: DeploymentUpdate, request: Request, session: SessionDep, _: AdminDep
) -> DeploymentPublic:
    loopback = request.app.state.settings.allow_loopback_endpoints
    updated = deployments.update_deployment(session, name, body, allow_loopback=loopback)
    return deployments.with_replicas(updated, request.app.state.discovery)

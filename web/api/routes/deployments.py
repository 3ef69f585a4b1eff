"""Admin: deployments (a base model and its engine replicas)."""

from __future__ import annotations

from fastapi import APIRouter, status

from ...schemas import DeploymentCreate, DeploymentPublic
from ...services import deployments
from ..deps import AdminDep, SessionDep

router = APIRouter(prefix="/admin/v1/deployments", tags=["admin"])


@router.post("", status_code=status.HTTP_201_CREATED)
def create_deployment(body: DeploymentCreate, session: SessionDep, _: AdminDep) -> DeploymentPublic:
    return deployments.create_deployment(session, body)


@router.get("")
def list_deployments(session: SessionDep, _: AdminDep) -> list[DeploymentPublic]:
    return deployments.list_deployments(session)

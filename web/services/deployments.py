"""Deployments: a base model, its shapes, and the engine replicas that serve it."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from loraplex.adapters import BaseShape

from ..db.models import Deployment
from ..schemas import BaseShapeIn, DeploymentCreate, DeploymentPublic
from ..shapes import KNOWN_SHAPES, known_shape
from .errors import Conflict, Invalid, NotFound


def shape_of(deployment: Deployment) -> BaseShape:
    return BaseShape(
        num_layers=deployment.num_layers,
        hidden_size=deployment.hidden_size,
        intermediate_size=deployment.intermediate_size,
        q_size=deployment.q_size,
        kv_size=deployment.kv_size,
    )


def to_public(deployment: Deployment) -> DeploymentPublic:
    shape = shape_of(deployment)
    return DeploymentPublic(
        id=deployment.id,
        name=deployment.name,
        base_model=deployment.base_model,
        endpoints=list(deployment.endpoints),
        shape=BaseShapeIn(**vars(shape)),
        created_at=deployment.created_at,
    )


def create_deployment(session: Session, spec: DeploymentCreate) -> DeploymentPublic:
    if spec.shape is not None:
        shape = BaseShape(**spec.shape.model_dump())
    else:
        known = known_shape(spec.base_model)
        if known is None:
            raise Invalid(
                f"base model {spec.base_model!r} has no known shape; give `shape` or use one of "
                f"{', '.join(sorted(KNOWN_SHAPES))}"
            )
        shape = known
    deployment = Deployment(
        name=spec.name,
        base_model=spec.base_model,
        endpoints=[str(url).rstrip("/") for url in spec.endpoints],
        **vars(shape),
    )
    session.add(deployment)
    try:
        session.commit()
    except IntegrityError:
        session.rollback()
        raise Conflict(f"a deployment named {spec.name!r} already exists") from None
    return to_public(deployment)


def list_deployments(session: Session) -> list[DeploymentPublic]:
    return [to_public(d) for d in session.scalars(select(Deployment).order_by(Deployment.name))]


def by_name(session: Session, name: str) -> Deployment:
    deployment = session.scalar(select(Deployment).where(Deployment.name == name))
    if deployment is None:
        raise NotFound(f"no deployment named {name!r}; an admin lists them at /admin/v1/deployments")
    return deployment

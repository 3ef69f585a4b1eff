"""Deployments: a base model, its shapes, and the engine replicas that serve it."""

from __future__ import annotations

import logging

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session

from loraplex.adapters import BaseShape

from ..db.models import Deployment
from ..db.session import Database
from ..schemas import BaseShapeIn, DeploymentCreate, DeploymentPublic, DeploymentUpdate, ReplicaPublic
from ..shapes import KNOWN_SHAPES, known_shape
from .discovery import Discovery, is_kubernetes_uri
from .endpoint_policy import endpoint_problem
from .errors import Conflict, Invalid, NotFound

log = logging.getLogger("loraplex.web.deployments")


def shape_of(deployment: Deployment) -> BaseShape:
    return BaseShape(
        num_layers=deployment.num_layers,
        hidden_size=deployment.hidden_size,
        intermediate_size=deployment.intermediate_size,
        q_size=deployment.q_size,
        kv_size=deployment.kv_size,
    )


def to_public(deployment: Deployment, discovery: Discovery | None = None) -> DeploymentPublic:
    """The row for an admin; with `discovery`, also the replicas its endpoints stand for now."""
    shape = shape_of(deployment)
    replicas, state = current_replicas(list(deployment.endpoints), discovery)
    return DeploymentPublic(
        id=deployment.id,
        name=deployment.name,
        base_model=deployment.base_model,
        endpoints=list(deployment.endpoints),
        replicas=replicas if discovery is not None else [],
        discovery=state if discovery is not None else None,
        shape=BaseShapeIn(**vars(shape)),
        created_at=deployment.created_at,
    )


def current_replicas(
    endpoints: list[str], discovery: Discovery | None
) -> tuple[list[ReplicaPublic], str | None]:
    """Static endpoints as given, and each kubernetes:// endpoint as its pods; with what discovery says."""
    replicas: list[ReplicaPublic] = []
    states: list[str] = []
    for endpoint in endpoints:
        if not is_kubernetes_uri(endpoint):
            replicas.append(ReplicaPublic(endpoint=endpoint, pod=None, ready=None, detail="static"))
            continue
        if discovery is None or not discovery.enabled:
            states.append(f"{endpoint}: kubernetes discovery is off (LORAPLEX_KUBERNETES_DISCOVERY)")
            continue
        state = discovery.state(endpoint)
        states.append(f"{endpoint}: {state}")
        for pod in discovery.replicas(endpoint) or []:
            replicas.append(
                ReplicaPublic(endpoint=pod.endpoint, pod=pod.pod, ready=pod.ready, detail=pod.detail)
            )
    return replicas, "; ".join(states) or None


def with_replicas(public: DeploymentPublic, discovery: Discovery | None) -> DeploymentPublic:
    """`public` with its current replicas (a row just written starts being followed here)."""
    replicas, state = current_replicas(public.endpoints, discovery)
    return public.model_copy(update={"replicas": replicas, "discovery": state})


def all_endpoints(db: Database) -> list[str]:
    """Every deployment's endpoints (to follow at start); none when the tables are not there yet."""
    try:
        with db.session() as session:
            return [e for endpoints in session.scalars(select(Deployment.endpoints)) for e in endpoints]
    except SQLAlchemyError as exc:  # not migrated yet (web pods start beside the migration job)
        log.warning("could not read deployments at start: %s", exc)
        return []


def check_endpoints(endpoints: list[str], allow_loopback: bool) -> None:
    """Invalid naming the first endpoint the internal token must not go to (schemas.py has refused the
    rest of endpoint_policy already; loopback depends on the setting, known here)."""
    for endpoint in endpoints:
        problem = None if is_kubernetes_uri(endpoint) else endpoint_problem(endpoint, allow_loopback)
        if problem is not None:
            raise Invalid(f"endpoint {endpoint[:100]!r} {problem}")


def create_deployment(session: Session, spec: DeploymentCreate, *, allow_loopback: bool) -> DeploymentPublic:
    check_endpoints(spec.endpoints, allow_loopback)
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
        endpoints=list(dict.fromkeys(spec.endpoints)),  # normalised by the schema
        **vars(shape),
    )
    session.add(deployment)
    try:
        session.commit()
    except IntegrityError:
        session.rollback()
        raise Conflict(f"a deployment named {spec.name!r} already exists") from None
    return to_public(deployment)


def update_deployment(
    session: Session, name: str, spec: DeploymentUpdate, *, allow_loopback: bool
) -> DeploymentPublic:
    check_endpoints(spec.endpoints, allow_loopback)
    deployment = by_name(session, name)
    deployment.endpoints = list(dict.fromkeys(spec.endpoints))
    session.commit()
    return to_public(deployment)


def list_deployments(session: Session, discovery: Discovery | None = None) -> list[DeploymentPublic]:
    rows = session.scalars(select(Deployment).order_by(Deployment.name))
    return [to_public(d, discovery) for d in rows]


def by_name(session: Session, name: str) -> Deployment:
    deployment = session.scalar(select(Deployment).where(Deployment.name == name))
    if deployment is None:
        raise NotFound(f"no deployment named {name!r}; an admin lists them at /admin/v1/deployments")
    return deployment

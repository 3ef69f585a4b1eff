from __future__ import annotations

from fastapi import APIRouter
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from sqlalchemy import text

from ...schemas import Health, Liveness
from ..deps import DatabaseDep

router = APIRouter(tags=["health"])


def _database_ok(db: DatabaseDep) -> bool:
    try:
        with db.session() as session:
            session.execute(text("SELECT 1"))
        return True
    except Exception:
        return False


@router.get("/livez", response_model=Liveness)
async def livez() -> Liveness:
    """Liveness: the process answers. No database here, so a database outage never restarts every replica."""
    return Liveness(status="ok")


@router.get("/health", response_model=Health, responses={503: {"model": Health}})
async def health(db: DatabaseDep) -> JSONResponse:
    """Readiness: the database answers too; a replica without it is taken out of the Service."""
    ok = await run_in_threadpool(_database_ok, db)
    body = Health(status="ok" if ok else "degraded", database=ok)
    return JSONResponse(body.model_dump(), status_code=200 if ok else 503)

"""Tenant: usage by day and model."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from ...schemas import UsageSummary
from ...services import usage
from ..deps import Reader, SessionDep

router = APIRouter(prefix="/api/v1/usage", tags=["usage"])


@router.get("")
def get_usage(
    session: SessionDep,
    principal: Reader,
    days: Annotated[int, Query(ge=1, le=366, description="How many days back, today included.")] = 30,
    by_version: Annotated[
        bool, Query(description="Split each day and model by the adapter version that served it.")
    ] = False,
) -> UsageSummary:
    return usage.summarize(session, principal.tenant_id, days, by_version)

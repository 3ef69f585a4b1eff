"""The overview: the tenant's last 30 days of usage as a chart, and what to do next."""

from __future__ import annotations

import datetime as dt

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from ..api.deps import SessionDep
from ..db.models import utcnow
from ..schemas import UsageSummary
from ..services import adapters, keys, usage
from . import charts
from .forms import GuardedRoute
from .rendering import render
from .security import Member, verify_csrf

router = APIRouter(
    tags=["console"],
    include_in_schema=False,
    dependencies=[Depends(verify_csrf)],
    route_class=GuardedRoute,
)
OVERVIEW_DAYS = 30


def daily_token_series(summary: UsageSummary, days: list[dt.date]) -> list[charts.Series]:
    prompt = {d: 0 for d in days}
    completion = {d: 0 for d in days}
    for row in summary.rows:
        if row.day in prompt:
            prompt[row.day] += row.prompt_tokens
            completion[row.day] += row.completion_tokens
    return [
        charts.Series("Prompt tokens", [prompt[d] for d in days]),
        charts.Series("Completion tokens", [completion[d] for d in days]),
    ]


@router.get("/console")
def overview(request: Request, session: SessionDep, user: Member) -> Response:
    assert user.tenant_id is not None  # Member guarantees it
    summary = usage.summarize(session, user.tenant_id, OVERVIEW_DAYS)
    days = charts.day_range(summary.since, utcnow().date())
    chart = charts.stacked_bars(
        "usage-30d", "Tokens per day, last 30 days", days, daily_token_series(summary, days), "tokens"
    )
    tenant_keys = keys.list_keys(session, user.tenant_id)
    live_keys = [k for k in tenant_keys if k.revoked_at is None]
    tenant_adapters = adapters.list_adapters(session, user.tenant_id)
    ready = [a for a in tenant_adapters if a.status == "ready"]
    return render(
        request,
        "overview.html",
        {
            "title": "Overview",
            "active": "overview",
            "summary": summary,
            "chart": chart,
            "live_keys": len(live_keys),
            "ready_adapters": len(ready),
            "adapters_total": len(tenant_adapters),
            "gateway_url": str(request.base_url).rstrip("/") + "/v1",
        },
    )

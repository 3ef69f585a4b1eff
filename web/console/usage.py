"""Usage by day and adapter (or base model): a stacked chart, the table behind it, and a CSV export."""

from __future__ import annotations

import csv
import datetime as dt
import io
from dataclasses import dataclass
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response

from ..api.deps import SessionDep
from ..db.models import utcnow
from ..schemas import UsageSummary
from ..services import usage
from . import charts
from .forms import GuardedRoute
from .rendering import render
from .security import Member, security_of, verify_csrf

router = APIRouter(
    tags=["console"],
    include_in_schema=False,
    dependencies=[Depends(verify_csrf)],
    route_class=GuardedRoute,
)
RANGES = (7, 30, 90)
# More models than this share one "other" colour in the chart (the table lists them all).
CHART_MODELS = 6
Days = Annotated[int, Query(ge=1, le=366)]
# The day-by-day table starts folded away when it is longer than this (the per-model table stays open).
OPEN_DETAIL_ROWS = 31


@dataclass(frozen=True)
class ModelTotal:
    model: str
    requests: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # of the prompt tokens, those the engine took from its prefix cache


def totals_by_model(summary: UsageSummary) -> list[ModelTotal]:
    totals: dict[str, list[int]] = {}
    for row in summary.rows:
        counts = totals.setdefault(row.model, [0, 0, 0, 0])
        counts[0] += row.requests
        counts[1] += row.prompt_tokens
        counts[2] += row.completion_tokens
        counts[3] += row.cached_tokens
    ranked = sorted(totals.items(), key=lambda item: (-(item[1][1] + item[1][2]), item[0]))
    return [ModelTotal(model, *counts) for model, counts in ranked]


def series_by_model(summary: UsageSummary, days: list[dt.date]) -> list[charts.Series]:
    """Tokens per day for the busiest models, the rest summed into "other"."""
    per_model: dict[str, dict[dt.date, int]] = {}
    for row in summary.rows:
        per_model.setdefault(row.model, {})
        per_model[row.model][row.day] = (
            per_model[row.model].get(row.day, 0) + row.prompt_tokens + row.completion_tokens
        )
    ranked = sorted(per_model, key=lambda m: (-sum(per_model[m].values()), m))
    shown, rest = ranked[:CHART_MODELS], ranked[CHART_MODELS:]
    series = [charts.Series(m, [per_model[m].get(d, 0) for d in days]) for m in shown]
    if rest:
        series.append(charts.Series("other", [sum(per_model[m].get(d, 0) for m in rest) for d in days]))
    return series


@router.get("/console/usage")
def usage_page(request: Request, session: SessionDep, user: Member, days: Days = 30) -> Response:
    assert user.tenant_id is not None
    summary = usage.summarize(session, user.tenant_id, days)
    day_list = charts.day_range(summary.since, utcnow().date())
    chart = charts.stacked_bars(
        "usage-by-model",
        f"Tokens per day and model, last {days} days",
        day_list,
        series_by_model(summary, day_list),
        "tokens",
    )
    return render(
        request,
        "usage.html",
        {
            "title": "Usage",
            "active": "usage",
            "summary": summary,
            "chart": chart,
            "days": days,
            "ranges": RANGES,
            "rows": sorted(summary.rows, key=lambda r: (r.day, r.model), reverse=True),
            "models": totals_by_model(summary),
            "detail_open": len(summary.rows) <= OPEN_DETAIL_ROWS,
        },
    )


@router.get("/console/usage.csv")
def usage_csv(request: Request, session: SessionDep, user: Member, days: Days = 30) -> Response:
    assert user.tenant_id is not None
    summary = usage.summarize(session, user.tenant_id, days)
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    header = [
        "day",
        "model",
        "requests",
        "prompt_tokens",
        "cached_tokens",
        "completion_tokens",
        "total_tokens",
    ]
    writer.writerow(header)
    for row in summary.rows:
        writer.writerow(
            [
                row.day.isoformat(),
                _cell(row.model),
                row.requests,
                row.prompt_tokens,
                row.cached_tokens,
                row.completion_tokens,
                row.prompt_tokens + row.completion_tokens,
            ]
        )
    name = f"loraplex-usage-{user.tenant_name}-{summary.since.isoformat()}-{days}d.csv"
    response = Response(
        out.getvalue(),
        media_type="text/csv; charset=utf-8",
        headers={"Content-Disposition": f'attachment; filename="{name}"'},
    )
    security_of(request).finish(request, response)
    return response


def _cell(text: str) -> str:
    """Spreadsheets run cells that start with = + - @ as formulas; a leading quote keeps them text."""
    return "'" + text if text[:1] in ("=", "+", "-", "@", "\t", "\r") else text

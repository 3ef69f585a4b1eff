"""Jinja2 templates and the one `render` every console page goes through (same layout, same headers)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import HTMLResponse, RedirectResponse
from fastapi.templating import Jinja2Templates

from .security import security_of

TEMPLATES = Jinja2Templates(directory=Path(__file__).parent / "templates")


def _when(moment: dt.datetime | None, empty: str = "—") -> str:
    if moment is None:
        return empty
    if moment.tzinfo is None:  # SQLite hands back naive datetimes; everything stored is UTC
        moment = moment.replace(tzinfo=dt.UTC)
    return moment.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")


def _size(count: int | None) -> str:
    if count is None:
        return "—"
    value = float(count)
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{int(value)} {unit}" if unit == "bytes" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{count} bytes"


def _number(value: int | float | None) -> str:
    return "—" if value is None else f"{value:,}"


TEMPLATES.env.filters["when"] = _when
TEMPLATES.env.filters["size"] = _size
TEMPLATES.env.filters["number"] = _number


def render(
    request: Request, template: str, context: dict[str, Any] | None = None, status_code: int = 200
) -> HTMLResponse:
    security = security_of(request)
    values = {
        "user": getattr(request.state, "user", None),
        "csrf_token": security.csrf_token(request),
        "flash": security.take_flash(request),
        **(context or {}),
    }
    response = TEMPLATES.TemplateResponse(request, template, values, status_code=status_code)
    security.finish(request, response)
    return response


def redirect(request: Request, url: str, flash: str | None = None) -> RedirectResponse:
    """303 to `url` (after a form post), with a notice for the next page."""
    response = RedirectResponse(url, status_code=303)
    security = security_of(request)
    if flash:
        security.flash(request, response, flash)
    security.finish(request, response)
    return response

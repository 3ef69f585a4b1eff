"""An adapter's versions (issue 28 item 6): each with its status, which one is active, its weight in the
traffic split and whether it is pinned; a traffic slider per ready version, rollback (make a version
active), pin and unpin. The same services as the tenant API (services/versions.py, traffic.py, pins.py), so
the checks and messages are the API's; every form works without JavaScript (post, then redirect)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Form, Request
from fastapi.responses import Response

from ..api.deps import SessionDep
from ..services import adapters, pins, traffic, versions
from ..services.errors import ServiceError
from .forms import GuardedRoute
from .rendering import redirect, render
from .security import Member, verify_csrf

router = APIRouter(
    tags=["console"], include_in_schema=False, dependencies=[Depends(verify_csrf)], route_class=GuardedRoute
)
MAX_WEIGHT = 100  # the slider's range: weights are relative, so percentages say it all


def _back(name: str) -> str:
    return f"/console/adapters/{name}"


@router.get("/console/adapters/{name}")
def versions_page(name: str, request: Request, session: SessionDep, user: Member) -> Response:
    assert user.tenant_id is not None
    try:
        rows = versions.list_versions(session, user.tenant_id, name)
        adapter = adapters.get_adapter(session, user.tenant_id, name)
    except ServiceError as exc:
        return redirect(request, "/console/adapters", flash=exc.message)
    split = adapter.traffic or {}
    context: dict[str, Any] = {
        "title": f"Adapter {name}",
        "active": "adapters",
        "adapter": adapter,
        "rows": rows,
        "ready": [v for v in rows if v.status == "ready"],
        # The slider starts where the split is, or all on the active version without one.
        "weights": {
            v.version: (split.get(str(v.version), 0) if split else (MAX_WEIGHT if v.active else 0))
            for v in rows
        },
        "max_weight": MAX_WEIGHT,
    }
    return render(request, "versions.html", context)


@router.post("/console/adapters/{name}/traffic")
async def set_traffic(name: str, request: Request, session: SessionDep, user: Member) -> Response:
    tenant_id = user.tenant_id
    assert tenant_id is not None
    form = await request.form()
    try:
        if form.get("clear"):
            traffic.clear_traffic(session, tenant_id, name)
            return redirect(
                request, _back(name), flash="Split ended: every request goes to the active version."
            )
        split: dict[int, int] = {}
        for key, value in form.items():
            if key.startswith("weight-") and key[7:].isdigit():
                raw = str(value).strip()
                if not raw.isdigit() or int(raw) > MAX_WEIGHT:
                    return redirect(
                        request, _back(name), flash=f"Weights are whole numbers 0 to {MAX_WEIGHT}."
                    )
                split[int(key[7:])] = int(raw)
        if not any(split.values()):
            return redirect(request, _back(name), flash="Give at least one version a weight above 0.")
        traffic.set_traffic(session, tenant_id, name, split, form.get("sticky") == "on")
    except ServiceError as exc:
        return redirect(request, _back(name), flash=exc.message)
    shares = ", ".join(f"version {v}: {w}" for v, w in sorted(split.items()) if w)
    return redirect(request, _back(name), flash=f"Traffic split saved ({shares}).")


@router.post("/console/adapters/{name}/rollback")
def rollback(
    name: str, request: Request, session: SessionDep, user: Member, version: Annotated[int, Form()]
) -> Response:
    assert user.tenant_id is not None
    try:
        versions.rollback(session, user.tenant_id, name, version)
    except ServiceError as exc:
        return redirect(request, _back(name), flash=exc.message)
    return redirect(request, _back(name), flash=f"Version {version} is active: it takes every request now.")


@router.post("/console/adapters/{name}/pin")
async def pin(
    name: str,
    request: Request,
    user: Member,
    version: Annotated[int, Form()],
    action: Annotated[str, Form()] = "pin",
) -> Response:
    assert user.tenant_id is not None
    try:
        if action == "unpin":
            await pins.unpin(request.app, user.tenant_id, name, version)
            done = f"Version {version} unpinned: the engines may evict it when idle."
        else:
            await pins.pin(request.app, user.tenant_id, name, version)
            done = f"Version {version} pinned: kept resident on the engines."
    except ServiceError as exc:
        return redirect(request, _back(name), flash=exc.message)
    return redirect(request, _back(name), flash=done)

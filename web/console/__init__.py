"""The tenant web console: server-rendered pages for tenant users and platform admins.

`install(app, settings)` mounts it under /console on the control plane's app: its pages, its static
files (vendored here, nothing fetched at run time) and the handlers that turn "sign in first", "not
allowed", "bad CSRF token" and "form too large" into pages. Layout: `security` (cookies, CSRF, who is
signed in), `forms` (what every route checks before it reads a body), `rendering` (templates), `charts`
(SVG), and one module of routes per page.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles

from ..settings import Settings
from . import adapters, admin, auth, keys, overview, playground, usage, versions
from .forms import FormTooLarge
from .rendering import render
from .security import ConsoleForbidden, ConsoleSecurity, CsrfRefused, SignInRequired, current_user

STATIC = Path(__file__).parent / "static"


def install(app: FastAPI, settings: Settings) -> None:
    app.state.console = ConsoleSecurity(settings)
    app.mount("/console/static", StaticFiles(directory=STATIC), name="console-static")
    for module in (auth, overview, keys, adapters, versions, playground, usage, admin):
        app.include_router(module.router)
    app.add_exception_handler(SignInRequired, _sign_in_required)  # type: ignore[arg-type]
    app.add_exception_handler(ConsoleForbidden, _forbidden)  # type: ignore[arg-type]
    app.add_exception_handler(CsrfRefused, _csrf_refused)  # type: ignore[arg-type]
    app.add_exception_handler(FormTooLarge, _form_too_large)  # type: ignore[arg-type]


def _wants_json(request: Request) -> bool:
    return "application/json" in request.headers.get("accept", "") or request.url.path.endswith("/stream")


async def _sign_in_required(request: Request, exc: SignInRequired) -> Response:
    if _wants_json(request):
        return JSONResponse({"detail": "your session has ended: sign in again"}, status_code=401)
    target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    if request.method != "GET":
        target = request.url.path
    return RedirectResponse(f"/console/sign-in?next={quote(target, safe='/')}", status_code=303)


async def _forbidden(request: Request, exc: ConsoleForbidden) -> Response:
    if _wants_json(request):
        return JSONResponse({"detail": exc.message}, status_code=403)
    return render(request, "forbidden.html", {"title": "Not allowed", "message": exc.message}, 403)


async def _csrf_refused(request: Request, exc: CsrfRefused) -> Response:
    message = (
        "This form was refused: it carried no valid security token. That happens when a page was "
        "open for a long time, after signing in again elsewhere, or when another site sent the form. "
        "Go back, reload the page and try again."
    )
    if _wants_json(request):
        return JSONResponse({"detail": message}, status_code=403)
    await current_user(request)  # refused before any page dependency ran: the layout still shows who
    return render(request, "forbidden.html", {"title": "Form refused", "message": message}, 403)


async def _form_too_large(request: Request, exc: FormTooLarge) -> Response:
    message = (
        f"This form was refused: it is larger than {exc.limit} bytes. Shorten what you entered and try again."
    )
    if _wants_json(request):
        return JSONResponse({"detail": message}, status_code=413)
    await current_user(request)  # the layout still shows who is signed in
    return render(request, "forbidden.html", {"title": "Form too large", "message": message}, 413)

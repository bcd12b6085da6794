"""The web console: HTML pages at ``/console/...`` (``/`` leads there), its static files at
``/console/static``, and the session: ``POST /console/session`` takes a token, checks it with the token
store and keeps it in an HttpOnly, SameSite=Strict cookie; ``DELETE`` forgets it.

Pages are filled from ``string.Template`` files (``orchestrator/console/templates``; no template engine
is a dependency): the server renders what depends on who is asking (the buttons a role may use, the
others are not in the page at all) and a run's plan graph; the pages' own scripts read the API for the
rest, live ones through its server-sent events. Everything is served from here: the console works with
no internet access."""

from __future__ import annotations

import functools
import string
from html import escape
from pathlib import Path
from typing import Any
from urllib.parse import quote

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel

import orchestrator.console
from orchestrator import observe
from orchestrator.auth.roles import Action, Identity
from orchestrator.console.graph import plan_svg
from orchestrator.engine.model import RunStatus
from orchestrator.errors import SagaError
from orchestrator.server.auth import SESSION_COOKIE, identity_of, require_console_header, tenant_scope
from orchestrator.server.console_api import granted
from orchestrator.server.errors import ApiError, status_of
from orchestrator.store.redis_store import PlanNotFound, RedisStore

CONSOLE_DIR = Path(orchestrator.console.__file__).parent
STATIC_DIR = CONSOLE_DIR / "static"
TEMPLATE_DIR = CONSOLE_DIR / "templates"
HOME = "/console/runs"

#: Pages load scripts, styles and data from this origin only, and no other site may frame them.
PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}

#: Buttons by the action they need: (action, verb, label); only those the role may use are rendered.
RUN_BUTTONS = [(Action.CANCEL, "cancel", "Cancel run"), (Action.REDRIVE, "redrive", "Re-drive")]
VERSION_VERBS = [Action.APPROVE, Action.ACTIVATE, Action.CANARY, Action.RETIRE]
DEFINITION_BUTTONS = [
    (Action.PROMOTE, "promote", "Promote canary"),
    (Action.ABORT, "abort", "Abort canary"),
    (Action.ROLLBACK, "rollback", "Roll back"),
]

router = APIRouter(include_in_schema=False)


class Html(str):
    """Markup that is inserted as it is; every other value filled into a template is escaped."""


@functools.cache
def _template(name: str) -> string.Template:
    return string.Template((TEMPLATE_DIR / name).read_text(encoding="utf-8"))


def fill(template_name: str, **values: str) -> Html:
    """Template ``template_name`` with ``values``, each escaped unless it is :class:`Html`."""
    safe = {k: v if isinstance(v, Html) else escape(v) for k, v in values.items()}
    return Html(_template(template_name).substitute(safe))


def page(page_name: str, title: str, content: Html, who: Identity | None, status: int = 200) -> HTMLResponse:
    nav = fill("nav.html", name=who.name, role=who.role.value) if who else Html("")
    script = (STATIC_DIR / f"{page_name}.js").exists()
    scripts = Html(f'<script src="/console/static/{page_name}.js" defer></script>' if script else "")
    body = fill(
        "base.html",
        title=title,
        page=page_name,
        actions=" ".join(granted(who)) if who else "",
        nav=nav,
        scripts=scripts,
        content=content,
    )
    return HTMLResponse(body, status_code=status, headers=PAGE_HEADERS)


def message(who: Identity | None, heading: str, text: str, status: int) -> HTMLResponse:
    return page("message", heading, fill("message.html", heading=heading, message=text), who, status)


def install(app: FastAPI) -> None:
    """Add the console's pages and session routes, and its static files at ``/console/static``."""
    app.include_router(router)
    app.mount("/console/static", StaticFiles(directory=STATIC_DIR), name="console-static")


async def visitor(request: Request) -> Identity | None:
    """Who is signed in (the session cookie, or a bearer token), or None: the page sends them to sign in."""
    try:
        return await identity_of(request)
    except ApiError as exc:
        if exc.status == 401:
            return None
        raise


def to_sign_in(request: Request) -> RedirectResponse:
    target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    return RedirectResponse(f"/console/sign-in?next={quote(target, safe='')}", status_code=303)


def local_path(target: str | None) -> str:
    """Where to go after signing in: a path on this server only (never ``//host`` or ``https://...``)."""
    if target and target.startswith("/") and not target.startswith("//") and "\\" not in target:
        return target
    return HOME


# ---- session ------------------------------------------------------------------------------------------


class SignIn(BaseModel):
    token: str


@router.post("/console/session")
async def sign_in(body: SignIn, request: Request) -> JSONResponse:
    """Check the token; keep it in the session cookie. Needs ``X-Saga-Console: 1`` like every changing
    request of the console: without it another site could sign a browser in as the attacker's token."""
    require_console_header(request)
    secret = body.token.strip()
    who = await request.app.state.tokens.verify(secret)
    if who is None:
        raise ApiError(
            401, "unauthenticated", "the token is unknown or revoked: ask an admin for a valid one"
        )
    response = JSONResponse(
        {"name": who.name, "role": who.role.value, "tenant": who.tenant, "actions": granted(who)}
    )
    response.set_cookie(
        SESSION_COOKIE,
        secret,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
        path="/",
    )  # no max-age: the session ends with the browser, or at sign-out, or when the token is revoked
    return response


@router.delete("/console/session", status_code=204)
async def sign_out(request: Request) -> Response:
    require_console_header(request)
    response = Response(status_code=204)
    response.delete_cookie(SESSION_COOKIE, path="/", httponly=True, samesite="strict")
    return response


# ---- pages --------------------------------------------------------------------------------------------


@router.get("/")
@router.get("/console")
async def home() -> RedirectResponse:
    return RedirectResponse(HOME, status_code=307)


@router.get("/console/sign-in", response_class=HTMLResponse)
async def sign_in_page(next: str | None = None) -> HTMLResponse:
    return page("sign-in", "Sign in", fill("sign-in.html", next=local_path(next)), None)


@router.get("/console/runs", response_class=HTMLResponse)
async def runs_page(request: Request, state: str = "", definition: str = "", version: str = "") -> Response:
    who = await visitor(request)
    if who is None:
        return to_sign_in(request)
    options = "".join(
        f'<option value="{escape(value)}"{" selected" if value == state else ""}>{escape(label)}</option>'
        for value, label in [("", "any"), *((s.value, s.value) for s in RunStatus)]
    )
    content = fill("runs.html", state_options=Html(options), definition=definition, version=version)
    return page("runs", "Runs", content, who)


@router.get("/console/runs/{run_id}", response_class=HTMLResponse)
async def run_page(run_id: str, request: Request) -> Response:
    who = await visitor(request)
    if who is None:
        return to_sign_in(request)
    app = request.app.state
    try:
        status = await observe.status_view(app.redis, app.settings, run_id, tenant=tenant_scope(request, who))
    except SagaError as exc:
        return message(who, "No such run", str(exc), status_of(getattr(exc, "code", "")))
    return page("run", f"Run {run_id}", await _run_content(request, who, status), who)


async def _run_content(request: Request, who: Identity, status: dict[str, Any]) -> Html:
    graph = Html('<p class="hint">This run has no plan to draw (its start was refused).</p>')
    if status.get("digest"):
        try:
            plan = await RedisStore(request.app.state.redis, request.app.state.settings.key_prefix).plan(
                str(status["digest"])
            )
            graph = Html(plan_svg(plan))
        except PlanNotFound:
            graph = Html('<p class="hint">The plan this run pinned is no longer stored.</p>')
    buttons = "".join(
        f'<button type="button" class="danger" data-verb="{verb}" disabled>{escape(label)}</button>'
        for action, verb, label in RUN_BUTTONS
        if who.allows(action)
    )
    controls = fill("run-controls.html", buttons=Html(buttons)) if buttons else Html("")
    return fill(
        "run.html",
        run_id=str(status["run_id"]),
        state=str(status["state"]),
        definition=str(status.get("definition") or ""),
        version=str(status.get("version") or ""),
        controls=controls,
        graph=graph,
    )


@router.get("/console/definitions", response_class=HTMLResponse)
async def definitions_page(request: Request) -> Response:
    who = await visitor(request)
    if who is None:
        return to_sign_in(request)
    return page("definitions", "Definitions", fill("definitions.html"), who)


@router.get("/console/definitions/{name}", response_class=HTMLResponse)
async def definition_page(name: str, request: Request) -> Response:
    who = await visitor(request)
    if who is None:
        return to_sign_in(request)
    buttons = "".join(
        f'<button type="button" data-verb="{verb}">{escape(label)}</button>'
        for action, verb, label in DEFINITION_BUTTONS
        if who.allows(action)
    )
    versions_too = any(who.allows(action) for action in VERSION_VERBS)
    controls = Html("")
    if buttons or versions_too:
        controls = fill("definition-controls.html", buttons=Html(buttons))
    return page("definition", name, fill("definition.html", name=name, controls=controls), who)


@router.get("/console/dead-letters", response_class=HTMLResponse)
async def dead_letters_page(request: Request) -> Response:
    who = await visitor(request)
    if who is None:
        return to_sign_in(request)
    return page("dead-letters", "Dead letters", fill("dead-letters.html"), who)


@router.get("/console/shards", response_class=HTMLResponse)
async def shards_page(request: Request) -> Response:
    who = await visitor(request)
    if who is None:
        return to_sign_in(request)
    return page("shards", "Shards", fill("shards.html"), who)

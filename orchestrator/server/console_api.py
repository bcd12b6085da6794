"""The API the web console needs beyond the CLI's twins: who the caller is and what their role may do
(``/whoami``), live streams (server-sent events) of the runs listing and of one run's status, and a
version's plan drawn as SVG. Every route takes the bearer token or the console's session cookie."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response, StreamingResponse

from orchestrator import observe
from orchestrator.auth.roles import GRANTS, Action, Identity
from orchestrator.cli_errors import SERVICE_ERRORS
from orchestrator.client import RunNotFound, is_final
from orchestrator.console.graph import plan_svg
from orchestrator.governance import service
from orchestrator.server.auth import Reader, identity_of, tenant_scope
from orchestrator.server.definitions import published
from orchestrator.server.errors import ApiError
from orchestrator.server.runs import MAX_PAGE

router = APIRouter(prefix="/api/v1", tags=["console"])

#: How often a stream reads again: a run's status (stages turning over) and the runs listing.
RUN_INTERVAL_S = 0.5
LISTING_INTERVAL_S = 1.0
#: A comment line after this long without news, so proxies and the browser keep the connection.
KEEPALIVE_S = 15.0
#: A stream ends after this long; EventSource opens it again by itself (after ``RETRY_MS``). Bounding it
#: keeps a forgotten tab from holding a connection (and a reader) for ever.
MAX_STREAM_S = 600.0
RETRY_MS = 1000
#: An SVG answer may draw, never run anything (it is served from this origin).
SVG_POLICY = "default-src 'none'"

Caller = Annotated[Identity, Depends(identity_of)]


def granted(identity: Identity) -> list[str]:
    """What ``identity``'s role may do, in :class:`Action` order (the console shows only these buttons)."""
    return [action.value for action in Action if action in GRANTS[identity.role]]


@router.get("/whoami")
async def whoami(who: Caller) -> dict[str, Any]:
    """The caller's token: name, role, tenant, and the actions its role may do."""
    return {"name": who.name, "role": who.role.value, "tenant": who.tenant, "actions": granted(who)}


def event(data: Any, kind: str | None = None) -> bytes:
    """One server-sent event; ``data`` as one line of JSON."""
    head = f"event: {kind}\n" if kind else ""
    return f"{head}data: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


async def changes(
    request: Request,
    read: Callable[[], Awaitable[dict[str, Any]]],
    *,
    interval_s: float,
    final: Callable[[dict[str, Any]], bool] = lambda _: False,
    first: dict[str, Any] | None = None,
) -> AsyncIterator[bytes]:
    """Read every ``interval_s`` and send the document whenever it changed; ``end`` once ``final`` says
    so. Stops when the client goes, when its token is revoked (``denied``: checked on every reading, as
    every request is), or after ``MAX_STREAM_S``. A Redis or RabbitMQ outage is a ``problem`` event, and
    the stream keeps reading."""
    yield f"retry: {RETRY_MS}\n\n".encode()
    started = sent_at = time.monotonic()
    last: str | None = None
    document = first
    while not await request.is_disconnected():
        try:
            await identity_of(request)
            document = document if document is not None else await read()
        except ApiError as exc:
            yield event({"message": str(exc)}, "denied")
            return
        except RunNotFound as exc:  # its record expired after the retention
            yield event({"message": str(exc)}, "end")
            return
        except SERVICE_ERRORS as exc:
            yield event({"message": f"{type(exc).__name__}: {exc}"}, "problem")
        else:
            text = json.dumps(document, sort_keys=True)
            if text != last:
                last, sent_at = text, time.monotonic()
                yield event(document)
            elif time.monotonic() - sent_at > KEEPALIVE_S:
                sent_at = time.monotonic()
                yield b": keep-alive\n\n"
            if final(document):
                yield event({}, "end")
                return
        document = None
        if time.monotonic() - started > MAX_STREAM_S:
            return
        await asyncio.sleep(interval_s)


def stream(body: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(
        body,
        media_type="text/event-stream",
        # no-transform and X-Accel-Buffering: a proxy that buffers or compresses would hold events back
        headers={"Cache-Control": "no-cache, no-transform", "X-Accel-Buffering": "no"},
    )


# Registered before the runs router (app.py), so that "events" is not taken for a run id.
@router.get("/runs/events", response_class=StreamingResponse)
async def runs_events(
    request: Request,
    who: Reader,
    state: str | None = None,
    definition: str | None = None,
    version: str | None = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 100,
) -> StreamingResponse:
    """``text/event-stream``: the first page of ``GET /runs`` with these filters, whenever it changed
    (read every second)."""
    wanted = observe.RunFilter(
        state or None,
        definition or None,
        version or None,
        None,
        limit,
        None,
        tenant=tenant_scope(request, who),
    )
    settings = request.app.state.settings

    async def read() -> dict[str, Any]:
        return {"runs": await observe.list_runs(settings, wanted)}

    return stream(changes(request, read, interval_s=LISTING_INTERVAL_S))


@router.get("/runs/{run_id}/events", response_class=StreamingResponse)
async def run_events(run_id: str, request: Request, who: Reader) -> StreamingResponse:
    """``text/event-stream``: the run's status document (as ``GET /runs/{id}``) whenever it changed,
    then an ``end`` event once the run is final (404 for a run that is not known)."""
    app = request.app.state

    async def read() -> dict[str, Any]:
        return await observe.status_view(app.redis, app.settings, run_id, tenant=tenant_scope(request, who))

    first = await read()  # before the stream starts, so an unknown run is a plain 404
    return stream(
        changes(request, read, interval_s=RUN_INTERVAL_S, final=lambda d: is_final(d["state"]), first=first)
    )


@router.get(
    "/definitions/{name}/versions/{version}/graph",
    response_class=Response,
    responses={200: {"content": {"image/svg+xml": {}}}},
)
async def version_graph(name: str, version: str, request: Request, _: Reader) -> Response:
    """The version's plan drawn as SVG: its stages (``g.stage[data-stage]``), terminals and edges."""
    settings = request.app.state.settings
    (state,) = await service.states(settings, name)
    plan = await service.plan_of(settings, published(state, version).digest)
    headers = {"Content-Security-Policy": SVG_POLICY}
    return Response(plan_svg(plan), media_type="image/svg+xml", headers=headers)

"""``/api/v1/runs``: start (with an idempotency key), list with filters and a cursor, status, history,
cancel and re-drive, as the CLI's run commands do them, the token's identity named in history. Every one
is the token's tenant's: a run starts as its, and a run of another tenant is not found (a token of the
platform's tenant, ``SAGA_PLATFORM_TENANT``, sees every tenant's)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, Field

from orchestrator import observe
from orchestrator.client import Client
from orchestrator.keys.reload import data_key, sealer_for
from orchestrator.server.auth import Canceller, Reader, Redriver, Starter, tenant_scope
from orchestrator.server.errors import ApiError

router = APIRouter(prefix="/api/v1/runs", tags=["runs"])

MAX_PAGE = 500


class Start(BaseModel):
    definition: str
    context: dict[str, Any] = Field(default_factory=dict)
    idempotency_key: str | None = Field(None, description="the same key and context always give the same run")
    version: str | None = Field(
        None, description="any approved, not retired version (default: the active one)"
    )


class RunRequest(BaseModel):
    reason: str = ""
    undo_lost: bool = Field(
        False, description="re-drive: the undo a poison message left in flight will never report"
    )


def _client(request: Request) -> Client:
    client: Client = request.app.state.client
    return client


@router.post("", status_code=202)
async def start(request: Request, body: Start, who: Starter) -> dict[str, Any]:
    """Start a run; 202 with its id once the broker has the start (the run is created by its shard)."""
    run_id = await _client(request).start(
        body.definition,
        body.context,
        body.idempotency_key,
        body.version,
        tenant=who.tenant,
        requested_by=who.name,
    )
    return {"run_id": run_id, "state": "pending"}


def _cursor(text: str | None) -> tuple[int, str] | None:
    if not text:
        return None
    try:
        return observe.parse_cursor(text)
    except ValueError as exc:
        raise ApiError(400, "invalid_request", str(exc)) from exc


@router.get("")
async def list_runs(
    request: Request,
    who: Reader,
    state: str | None = None,
    definition: str | None = None,
    version: str | None = None,
    since_ms: Annotated[int | None, Query(ge=0)] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 50,
    cursor: str | None = None,
) -> dict[str, Any]:
    """Runs newest first, filtered; ``next_cursor`` (when there may be more) gives the next page."""
    wanted = observe.RunFilter(
        state, definition, version, since_ms, limit, _cursor(cursor), tenant_scope(request, who)
    )
    rows = await observe.list_runs(request.app.state.settings, wanted)
    return {"runs": rows, "next_cursor": observe.page_cursor(rows, limit)}


@router.get("/{run_id}")
async def status(run_id: str, request: Request, who: Reader, inputs: bool = False) -> dict[str, Any]:
    """A run as ``saga status --json`` shows it (``refused``: its start created no run, and why);
    ``inputs``: each work stage's input too, as ``saga status --inputs``."""
    app = request.app.state
    return await observe.status_view(
        app.redis, app.settings, run_id, inputs=inputs, tenant=tenant_scope(request, who)
    )


@router.get("/{run_id}/history")
async def history(run_id: str, request: Request, who: Reader) -> dict[str, Any]:
    app = request.app.state
    events = await observe.run_history(
        app.redis,
        app.settings.key_prefix,
        run_id,
        tenant_scope(request, who),
        data_key(app.settings),
        sealer_for(app.settings),
    )
    return {"run_id": run_id, "events": events}


@router.post("/{run_id}/cancel", status_code=202)
async def cancel(run_id: str, body: RunRequest, request: Request, who: Canceller) -> dict[str, Any]:
    """Ask the run's shard to cancel it (409 for a run that has ended or is ending)."""
    request_id = await _client(request).cancel(
        run_id, body.reason, who.name, tenant=tenant_scope(request, who)
    )
    return {"run_id": run_id, "request": request_id}


@router.post("/{run_id}/redrive", status_code=202)
async def redrive(run_id: str, body: RunRequest, request: Request, who: Redriver) -> dict[str, Any]:
    """Resume a failed run in a new epoch on its pinned plan (409 for a run that is not failed)."""
    request_id = await _client(request).redrive(
        run_id, body.reason, who.name, undo_lost=body.undo_lost, tenant=tenant_scope(request, who)
    )
    return {"run_id": run_id, "request": request_id}

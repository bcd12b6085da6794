"""``saga`` commands that only read: what a run is doing (``status``, ``watch``, ``wait``, ``history``) and
which runs there are (``runs``). Registered on the main group by ``orchestrator.cli``; the reading is in
``orchestrator.observe``, the text in ``orchestrator.views``."""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any

import click

from orchestrator import observe, views
from orchestrator.cli_runtime import _emit, _run, _settings
from orchestrator.client import WaitTimeout
from orchestrator.engine.model import RunStatus, StageStatus
from orchestrator.keys.reload import data_key, sealer_for, signer_for, tenant_scope
from orchestrator.remote import remote_client
from orchestrator.settings import Settings, redis_client
from orchestrator.store import worker_registry
from orchestrator.store.keys import REFUSED
from orchestrator.store.redis_store import PlanNotFound, RedisStore

#: ``saga wait`` / ``saga watch``: the run was still going when the timeout passed (it goes on).
EXIT_STILL_RUNNING = 3
_json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON.")


@click.command()
@click.argument("run_id")
@click.option(
    "--inputs",
    is_flag=True,
    help="Also show each work stage's input (bound again from the run's context and the results of the "
    "stages it reads, as the orchestrator bound it).",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print JSON: the run, 'stages' by name (state, attempt, result or error, a map's 'items', a "
    "join's 'arrived', a decision's 'branch' and 'next', 'waiting' with its reason, a dispatched stage's "
    "'live_workers' serving its contract version) and 'order', every stage of the plan in plan order.",
)
def status(run_id: str, inputs: bool, as_json: bool) -> None:
    """Show a run: its state and reason, then every stage of its pinned plan in plan order with its
    state, attempt and result (a map's items done/total, a join's arrived branches, a decision's route).
    A dispatched stage says why it waits when that is known: no live worker serves its pinned contract
    version, no worker consumes its queue, or another task holds the serial lane. Exit 1 if the run is
    not known."""
    if remote := remote_client():
        _show_status(_run(remote.status(run_id, inputs=inputs)), inputs, as_json)
        return
    settings = _settings()

    async def go() -> tuple[dict[str, Any], str | None]:
        client = redis_client(settings)
        store = RedisStore(client, settings.key_prefix)
        try:
            async with observe.BrokerProbe(settings.amqp_url) as probe:
                view = await observe.status_view(
                    client, settings, run_id, inputs=inputs, probe=probe, store=store, tenant=_scope(settings)
                )
                view = await _with_live_workers(client, settings, view, store, probe.error is None)
                return view, probe.error
        finally:
            await client.aclose()

    view, broker_error = _run(go())
    if broker_error:
        view["waiting_unknown"] = broker_error
        click.echo(f"note: why dispatched stages wait is not known: {broker_error}", err=True)
    _show_status(view, inputs, as_json)


def _show_status(view: dict[str, Any], inputs: bool, as_json: bool) -> None:
    if as_json:
        _emit(view)
        return
    for line in views.status_lines(view, inputs=inputs):
        click.echo(line)


async def _with_live_workers(
    client: Any, settings: Settings, view: dict[str, Any], store: RedisStore, broker_known: bool
) -> dict[str, Any]:
    """The view with the live workers serving each dispatched stage's pinned contract version, and which
    version a stage waits for when none serves it (``orchestrator/store/worker_registry.py``)."""
    if not any(s["state"] == StageStatus.DISPATCHED for s in view["stages"].values()):
        return view
    try:
        plan = await store.plan(str(view["digest"]))
        workers = await worker_registry.live_workers(client, settings.key_prefix)
    except PlanNotFound:
        return view
    serving = worker_registry.serving_index(workers)
    summaries = {ref: [w.summary(ref) for w in found] for ref, found in serving.items()}
    queue = settings.names().task_queue
    return views.with_live_workers(view, plan, summaries, queue, broker_known=broker_known)


def _finished(
    document: dict[str, Any] | None, run_id: str, timeout_s: float | None, *, quiet: bool = False
) -> int:
    """The exit code ``wait`` and ``watch`` share, and what they say on stderr when it is not 0 (nothing
    when ``quiet``: under --json the document on stdout says it)."""
    state = document["state"] if document else "pending"
    if state == RunStatus.COMPLETED:
        return 0
    ended = state in (RunStatus.FAILED, REFUSED)
    if ended:
        why = f"run {run_id} {state}: {(document or {}).get('reason') or 'no reason recorded'}"
    else:
        why = str(WaitTimeout(run_id, state, timeout_s or 0.0))
    if not quiet:
        click.echo(why, err=True)
    return 1 if ended else EXIT_STILL_RUNNING


@click.command()
@click.argument("run_id")
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(min=0),
    default=60.0,
    show_default=True,
    help="Give up after this many seconds (exit 3; the run goes on).",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help='Print JSON: {"run_id", "state", "output", "reason", "timed_out"}.',
)
def wait(run_id: str, timeout_s: float, as_json: bool) -> None:
    """Wait for a run to end (finalisers included). Exit 0 if it completed; 1 if it failed (its reason
    on stderr) or is not known (after 5 s: a run just started may not be created yet); 3 if it is still
    going when the timeout passes."""
    if remote := remote_client():
        document = _run(
            observe.follow(lambda: remote.status(run_id), run_id, timeout_s=timeout_s, interval_s=0.2)
        )
    else:
        document = _run(_wait(_settings(), run_id, timeout_s))
    code = _finished(document, run_id, timeout_s, quiet=as_json)
    state = document["state"] if document else "pending"
    if as_json:
        _emit(
            {
                "run_id": run_id,
                "state": state,
                "output": (document or {}).get("output"),
                "reason": (document or {}).get("reason"),
                "timed_out": code == EXIT_STILL_RUNNING,
            }
        )
    elif code == 0:
        click.echo(f"run {run_id} completed: output = {views.compact((document or {}).get('output'))}")
    elif code == 1:
        click.echo(f"run {run_id} {state}")
    sys.exit(code)


async def _wait(settings: Settings, run_id: str, timeout_s: float) -> dict[str, Any] | None:
    client = redis_client(settings)
    scope, key, sealer = _scope(settings), data_key(settings), sealer_for(settings)
    try:

        async def read() -> dict[str, Any]:
            return await observe.run_document(client, settings.key_prefix, run_id, scope, key, sealer)

        return await observe.follow(read, run_id, timeout_s=timeout_s, interval_s=0.1)
    finally:
        await client.aclose()


@click.command()
@click.argument("run_id")
@click.option(
    "--interval",
    "interval_s",
    type=click.FloatRange(min=0.05),
    default=0.5,
    show_default=True,
    help="Seconds between readings.",
)
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(min=0),
    default=None,
    help="Stop after this many seconds (exit 3; the run goes on). Default: until the run ends.",
)
def watch(run_id: str, interval_s: float, timeout_s: float | None) -> None:
    """Follow a run live: every stage of its plan in plan order with its state (a map's items done/total,
    a join waiting until a branch arrived) and why a dispatched stage waits, until the run ends. On a
    terminal the table is redrawn in place; otherwise it is printed again only when a row changes. Exits
    as 'saga wait' does: 0 completed, 1 failed or not known, 3 still going at --timeout."""
    table = views.LiveTable(sys.stdout.isatty())

    def show(document: dict[str, Any] | None, elapsed_s: float) -> None:
        if document is None:
            return  # not created yet (or not at all): nothing to draw
        text = table.frame(document, elapsed_s)
        if text is not None:
            click.echo(text, nl=False)

    if remote := remote_client():
        reading = observe.follow(
            lambda: remote.status(run_id), run_id, timeout_s=timeout_s, interval_s=interval_s, show=show
        )
        document = _run(reading)
    else:
        document = _run(_watch(_settings(), run_id, interval_s, timeout_s, show))
    sys.exit(_finished(document, run_id, timeout_s))


async def _watch(
    settings: Settings, run_id: str, interval_s: float, timeout_s: float | None, show: Any
) -> dict[str, Any] | None:
    client = redis_client(settings)
    store = RedisStore(client, settings.key_prefix)  # one plan cache for every reading
    scope = _scope(settings)
    try:
        async with observe.BrokerProbe(settings.amqp_url) as probe:

            async def read() -> dict[str, Any]:
                view = await observe.status_view(
                    client, settings, run_id, probe=probe, store=store, tenant=scope
                )
                return await _with_live_workers(client, settings, view, store, probe.error is None)

            return await observe.follow(read, run_id, timeout_s=timeout_s, interval_s=interval_s, show=show)
    finally:
        await client.aclose()


@click.command()
@click.argument("run_id")
@_json_option
def history(run_id: str, as_json: bool) -> None:
    """Show a run's durable history, event by event: sequence, time (ISO 8601, UTC), kind, stage,
    attempt and the event's details."""
    if remote := remote_client():
        events = _run(remote.history(run_id))
    else:
        events = _run(_history(_settings(), run_id))
    if as_json:
        _emit({"run_id": run_id, "events": events})
        return
    for event in events:
        click.echo(views.history_line(event))


def _scope(settings: Settings) -> str | None:
    """The tenant whose runs this command shows: that of the client key it holds (see
    ``keys.reload.tenant_scope``); None: every tenant's."""
    return tenant_scope(signer_for(settings), settings)


async def _history(settings: Settings, run_id: str) -> list[dict[str, Any]]:
    client = redis_client(settings)
    try:
        return await observe.run_history(
            client, settings.key_prefix, run_id, _scope(settings), data_key(settings), sealer_for(settings)
        )
    finally:
        await client.aclose()


def _cursor(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[int, str] | None:
    if value is None:
        return None
    try:
        return observe.parse_cursor(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc


def _since(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return views.parse_since(value, int(time.time() * 1000))
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc


@click.command()
@click.option(
    "--state",
    type=click.Choice([s.value for s in RunStatus]),
    default=None,
    help="Only runs in this state.",
)
@click.option("--definition", default=None, metavar="NAME", help="Only runs of this definition.")
@click.option("--version", default=None, metavar="VERSION", help="Only runs of this definition version.")
@click.option(
    "--since",
    "since_ms",
    default=None,
    metavar="WHEN",
    callback=_since,
    help="Only runs created since WHEN: an ISO 8601 datetime (UTC unless it has a zone) or a duration "
    "back from now (90s, 15m, 2h, 1d, 1w).",
)
@click.option(
    "--limit", type=click.IntRange(min=1), default=50, show_default=True, help="At most this many runs."
)
@click.option(
    "--cursor",
    "after",
    default=None,
    metavar="CURSOR",
    callback=_cursor,
    help="Start after the page that gave this next_cursor (see --json).",
)
@click.option("--json", "as_json", is_flag=True, help='Print JSON: {"runs": [...], "next_cursor"}.')
def runs(
    state: str | None,
    definition: str | None,
    version: str | None,
    since_ms: int | None,
    limit: int,
    after: tuple[int, str] | None,
    as_json: bool,
) -> None:
    """List runs of every shard, newest first: run id, definition, version, state, created and last
    updated (ISO 8601, UTC) and reason. A full page ends with its next_cursor: --cursor gives the page
    after it (runs started meanwhile never shift it)."""
    wanted = observe.RunFilter(state, definition, version, since_ms, limit, after)
    if remote := remote_client():
        found, next_cursor = _run(remote.list_runs(wanted))
    else:
        settings = _settings()
        found = _run(observe.list_runs(settings, dataclasses.replace(wanted, tenant=_scope(settings))))
        next_cursor = observe.page_cursor(found, limit)
    if as_json:
        _emit({"runs": found, "next_cursor": next_cursor})
        return
    for line in views.runs_lines(found):
        click.echo(line)
    if next_cursor is not None:
        more = f"raise --limit, narrow with --since, or page on with --cursor {next_cursor}"
        click.echo(f"(a full page of {limit}: {more})", err=True)


COMMANDS = [status, wait, watch, history, runs]

"""``saga`` commands that talk to RabbitMQ and Redis: run processes, publish definitions, start, cancel,
re-drive and reconcile runs (the read-only ones are in ``orchestrator.cli_observe``). Registered on the
main group by ``orchestrator.cli``."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import logging
import signal
import sys
import time
from typing import TYPE_CHECKING, Any

import aio_pika
import click

from orchestrator import gc_tuning, health, logs, loops, metrics
from orchestrator.bus import names
from orchestrator.bus.connect import connect_robust, untracked_channel
from orchestrator.bus.publisher import Publisher
from orchestrator.cli_errors import SERVICE_ERRORS, CliError, CodedUsageError, unreachable
from orchestrator.cli_options import metrics_options
from orchestrator.client import Client, RedriveRefused
from orchestrator.durability import DurabilityRefused, Role, check_startup
from orchestrator.keys.reload import data_key, sealer_for, signer_for, start_reloading, tenant_scope
from orchestrator.observe import RunFilter, list_runs, run_document
from orchestrator.reconcile import Reconciler, Report
from orchestrator.remote import Remote, remote_client
from orchestrator.sealing import Sealer
from orchestrator.settings import Settings, redis_client
from orchestrator.shard.processor import Processor
from orchestrator.shard.service import ShardOptions, ShardService
from orchestrator.shardmap import ShardMap, owners, pinned
from orchestrator.store import membership, shardmap_store
from orchestrator.store.redis_store import RedisStore
from orchestrator.store.shardmap_store import current_map
from orchestrator.trace import TRACE

if TYPE_CHECKING:
    from workers.sdk import Handler


def _settings() -> Settings:
    from orchestrator.cli import load_settings  # the one place settings errors are turned into usage errors

    return load_settings()


def _emit(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False))


class _Refused(CliError):
    """Production mode refuses these settings: a configuration error (exit 2)."""

    def __init__(self, message: str) -> None:
        super().__init__("durability_refused", message, exit_code=2)


def _require_durability(settings: Settings, role: Role) -> None:
    try:
        check_startup(settings, role)
    except DurabilityRefused as exc:
        raise _Refused(str(exc)) from exc


def _event_loop(settings: Settings) -> loops.LoopFactory | None:
    """What makes the event loop the settings choose; a loop this machine lacks is a configuration error
    (exit 2), said before the process does anything else."""
    try:
        return loops.loop_factory(settings.event_loop)
    except loops.EventLoopUnavailable as exc:
        raise CodedUsageError("event_loop_unavailable", str(exc)) from exc


def _serve(
    make: Any,
    settings: Settings,
    loop: loops.LoopFactory | None,
    readiness: health.Readiness | None = None,
) -> None:
    """Run a service coroutine on a loop from ``loop`` until SIGTERM/SIGINT, which asks it to drain and
    stop. ``make`` returns the service, its cleanup and the :class:`health.Checks` that keep
    ``readiness`` (``/readyz``, when the metrics server runs) up to date meanwhile."""

    async def main() -> None:
        service, cleanup, checks = await make()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, service.stop)
        watching = None
        if readiness is not None:
            watching = asyncio.create_task(health.watch(readiness, checks, settings.redis_timeout_s))
        try:
            await service.run()
        finally:
            if watching is not None:
                watching.cancel()
            if readiness is not None:
                readiness.stopping()  # draining and closing: no longer ready, whatever the last check said
            try:  # a broker that does not answer must not keep a stopping process alive
                await asyncio.wait_for(cleanup(), timeout=10)
            except Exception:
                logging.getLogger(__name__).warning("connections did not close cleanly", exc_info=True)

    try:
        loops.run(main(), loop)
    except (aio_pika.exceptions.AMQPConnectionError, ConnectionError, OSError) as exc:
        raise unreachable(exc) from exc


_verbose = click.option(
    "-v",
    "--verbose",
    is_flag=True,
    help="Log at INFO level (on stderr; SAGA_LOG_FORMAT=json: one JSON object per line).",
)


def _serve_metrics(host: str, port: int | None) -> health.Readiness | None:
    """Serve /metrics, /healthz and /readyz when --metrics-port is given (the readiness /readyz reports,
    for _serve to keep up to date; None: no server); a port that cannot be bound is a usage error."""
    if port is None:
        return None
    readiness = health.Readiness()
    try:
        metrics.serve_metrics(host, port, readiness)
    except OSError as exc:
        raise CodedUsageError(
            "metrics_port_unavailable", f"--metrics-port {port}: cannot serve metrics on {host}:{port}: {exc}"
        ) from exc
    return readiness


@click.command()
@click.option("--class", "shard_class", default=None, help="Serve only this shard class (default: all).")
@click.option("--shards", default="", help="Shard numbers: '0-3', '1,3' (default: all).")
@_verbose
@metrics_options
def orchestrator(
    shard_class: str | None, shards: str, verbose: bool, metrics_port: int | None, metrics_host: str
) -> None:
    """Consume shard queues and advance runs. Without --shards the process joins the others that follow
    the shard map: the live ones divide the served shards of their classes evenly among themselves, and
    take over the shards of one that stops or dies (its lease ends) within seconds. --shards pins it."""
    settings = _settings()
    logs.configure(settings, verbose)
    TRACE.configure(settings.trace_dir, "orchestrator")
    _require_durability(settings, Role.ORCHESTRATOR)
    loop = _event_loop(settings)
    try:
        shard_map = asyncio.run(current_map(settings, seed=False))
    except SERVICE_ERRORS as exc:  # it waits for Redis once running; the map is read again then
        logging.getLogger(__name__).warning("cannot read the shard map yet (%s); starting from settings", exc)
        shard_map = ShardMap.seed(settings.shard_classes, settings.shard_count)
    classes = (shard_class,) if shard_class else tuple(shard_map.classes)
    if shard_class and shard_class not in shard_map.classes:
        raise click.UsageError(f"--class {shard_class}: the shard map has {', '.join(shard_map.classes)}")
    try:
        shard_ids = pinned(shard_map, shards, classes)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc

    async def make() -> tuple[ShardService, Any, health.Checks]:
        connection = await connect_robust(settings.amqp_url, heartbeat_s=settings.amqp_heartbeat_s)
        client = redis_client(settings, per_reply_timeout=False)  # each Redis step is bounded instead
        store = RedisStore(client, settings.key_prefix, settings.retention_ms, direct=True)
        options = ShardOptions(
            names=settings.names(),
            delivery_limit=settings.delivery_limit,
            quorum_group_size=settings.quorum_group_size,
            prefetch=settings.shard_prefetch,
            batch_max=settings.shard_prefetch,
            max_message_bytes=settings.max_message_bytes,
            pack_tasks=settings.pack_tasks,
            max_transition_bytes=settings.max_transition_bytes,
            bag_window=settings.bag_window,
            crash_points=frozenset(settings.crash_points),
            poison_after=settings.delivery_limit - 1,
            redis_timeout_s=settings.redis_timeout_s,
            metrics_interval_s=None if metrics_port is None else 1.0,
            freshness=settings.freshness(),
            tenant_limits=settings.tenant_limits,
            encrypt_sensitive=settings.encrypt_sensitive,
        )

        me = membership.process_id()

        async def follow() -> list[str]:
            """This process's share of the served shards, as the live members divide them now. Bounded:
            a Redis that hangs must not stop the shards from being followed (or the process stopping)."""
            async with asyncio.timeout(settings.redis_timeout_s):
                live = await membership.renew(client, settings.key_prefix, list(classes), me)
                current = await shardmap_store.load(client, settings.key_prefix) or shard_map
            return [shard for shard, owner in owners(current, live).items() if owner == me]

        following = not shards  # --shards pins; otherwise the map and the other members are followed
        signer = signer_for(settings)
        if settings.encrypt_sensitive:
            Sealer(lambda: signer.ring).check()  # refuse to start rather than fail every sealed transition
        stop_reloading = start_reloading(signer, settings)
        service = ShardService(
            connection,
            store,
            signer,
            [] if following else shard_ids,  # a follower's share comes with its first reading
            options,
            follow=follow if following else None,
        )

        async def cleanup() -> None:
            await stop_reloading()
            if following:
                with contextlib.suppress(Exception):  # else its lease ends in a few seconds anyway
                    await membership.leave(client, settings.key_prefix, list(classes), me)
            await connection.close()
            await client.aclose()

        gc_tuning.tune()  # started: what it holds from now on is its work's
        return service, cleanup, health.Checks(client.ping, connection, service.consuming)

    pinned_to = f"shards {', '.join(shard_ids)}" if shards else f"its share of {', '.join(classes)}"
    logs.announce(settings, logging.getLogger(__name__), f"orchestrator serving {pinned_to}")
    readiness = _serve_metrics(metrics_host, metrics_port)
    _serve(make, settings, loop, readiness)


class _MissingTopology(CliError):
    """The broker lacks the namespace's exchanges: a configuration error (exit 2), said in one line."""

    def __init__(self, message: str) -> None:
        super().__init__("topology_missing", message, exit_code=2)


def _handlers_of_apps(apps: tuple[str, ...]) -> dict[str, Handler]:
    from workers.sdk import handlers_of

    handlers: dict[str, Handler] = {}
    for app in apps:
        try:
            module = importlib.import_module(app)
        except Exception as exc:
            raise CodedUsageError(
                "app_not_importable",
                f"cannot import --app {app!r}: {type(exc).__name__}: {exc} (the module must be importable: "
                "installed, or run with PYTHONPATH=. from the directory holding it)",
            ) from exc
        found = handlers_of(module)
        if not found:
            raise click.UsageError(f"--app {app!r} declares no @action or @worker handlers")
        for handler in found:
            ref = handler.contract.ref
            other = handlers.get(ref)
            if other is not None and other.function is not handler.function:
                raise click.UsageError(
                    f"{ref} has two handlers, {_where(other)} and {_where(handler)}: one worker process "
                    "runs one handler per contract version; start the apps as separate workers"
                )
            handlers[ref] = handler
    return handlers


def _where(handler: Handler) -> str:
    return f"{handler.function.__module__}.{handler.function.__qualname__}"


@click.command()
@click.option(
    "--app",
    "apps",
    multiple=True,
    default=("workers.demo",),
    show_default=True,
    metavar="MODULE",
    help="Module with @action/@worker handlers (repeatable: one process may serve several apps). It "
    "must be importable: installed, or run with PYTHONPATH=. from the directory holding it.",
)
@click.option(
    "--queue",
    "queues",
    multiple=True,
    help="Task queue to serve (repeatable; default: each contract's own queue plus tasks.serial, "
    "tasks.parallel and tasks.actions). Tasks reach this worker only for the contracts it has handlers for.",
)
@click.option("--concurrency", default=8, show_default=True, help="Tasks run at once by this process.")
@_verbose
@metrics_options
def worker(
    apps: tuple[str, ...],
    queues: tuple[str, ...],
    concurrency: int,
    verbose: bool,
    metrics_port: int | None,
    metrics_host: str,
) -> None:
    """Consume the queues of the apps' contracts and run their handlers."""
    from orchestrator.bus.topology import serving_queues
    from orchestrator.store.worker_registry import Presence
    from workers.runtime import MissingTopology, WorkerRuntime, worker_info
    from workers.serial_lane import SerialLane, lane_client, lane_key

    settings = _settings()
    logs.configure(settings, verbose)
    TRACE.configure(settings.trace_dir, "worker")
    _require_durability(settings, Role.WORKER)
    loop = _event_loop(settings)
    handlers = _handlers_of_apps(apps)
    serving = serving_queues([h.contract for h in handlers.values()], queues)
    for app in apps:
        startup = getattr(importlib.import_module(app), "saga_startup", None)
        if callable(startup):
            startup(settings)

    async def make() -> tuple[WorkerRuntime, Any, health.Checks]:
        connection = await connect_robust(settings.amqp_url, heartbeat_s=settings.amqp_heartbeat_s)
        registry_redis = redis_client(settings)  # the live worker registry (best effort)
        serial = any(queue == names.SERIAL_TASKS for queue, _ in serving)
        lane_redis = (
            lane_client(settings.redis_url, settings.serial_lease_ms, settings.redis_timeout_s)
            if serial
            else None
        )
        signer = signer_for(settings)
        stop_reloading = start_reloading(signer, settings)
        runtime = WorkerRuntime(
            connection,
            handlers,
            serving,
            signer,
            names=settings.names(),
            lane=None
            if lane_redis is None
            else SerialLane(lane_redis, lane_key(settings.key_prefix), settings.serial_lease_ms),
            concurrency=concurrency,
            delivery_limit=settings.delivery_limit,
            quorum_group_size=settings.quorum_group_size,
            max_message_bytes=settings.max_message_bytes,
            batch_results=settings.batch_results,
            crash_points=frozenset(settings.crash_points),
            presence=Presence(registry_redis, settings.key_prefix, worker_info(handlers, serving, apps)),
        )

        async def cleanup() -> None:
            await stop_reloading()
            await connection.close()
            await registry_redis.aclose()
            if lane_redis is not None:
                await lane_redis.aclose()

        return runtime, cleanup, health.Checks(registry_redis.ping, connection, runtime.consuming)

    served = ", ".join(
        ref + (f" (adapter to {handlers[ref].adapts_to})" if handlers[ref].adapts_to else "")
        for ref in sorted({ref for _, ref in serving})
    )
    on = ", ".join(sorted({queue for queue, _ in serving}))
    logs.announce(settings, logging.getLogger(__name__), f"worker {', '.join(apps)} serving {served} on {on}")
    readiness = _serve_metrics(metrics_host, metrics_port)
    try:
        _serve(make, settings, loop, readiness)
    except MissingTopology as exc:
        raise _MissingTopology(str(exc)) from None


@click.command()
@click.argument("definition")
@click.option(
    "--context", "context_json", default="{}", metavar="JSON", help="The run's context, a JSON object."
)
@click.option(
    "--idempotency-key",
    default=None,
    help="The same key and context always give the same run; the key with another context is refused.",
)
@click.option(
    "--wait",
    "wait_s",
    is_flag=False,
    flag_value=60.0,
    default=None,
    type=float,
    help="Wait for the run to finish (optionally: at most this many seconds).",
)
@click.option(
    "--version",
    "version",
    default=None,
    metavar="V",
    help="Start this version (any approved, not retired one) instead of the active one.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def start(
    definition: str,
    context_json: str,
    idempotency_key: str | None,
    wait_s: float | None,
    version: str | None,
    as_json: bool,
) -> None:
    """Start a run of DEFINITION and print its id (with --wait, its end): of its active version (or of
    its canary, for the canary's share of run ids), or of --version. Checked before anything is sent,
    exit 1 with every problem: a DEFINITION that is not published (with the closest published name), a
    version no run may start from (with those that may), a context its schema refuses, a start too
    large to send, an --idempotency-key already used with another context. With --wait, exit 1 if the
    run failed or its start was refused by the shard."""
    try:
        context = json.loads(context_json)
    except json.JSONDecodeError as exc:
        raise click.UsageError(f"--context is not JSON: {exc}") from exc
    if not isinstance(context, dict):
        raise click.UsageError("--context must be a JSON object")
    settings = _settings()
    remote = remote_client()

    async def go() -> dict[str, Any]:
        async with remote or Client(settings) as client:
            run_id = await client.start(definition, context, idempotency_key, version)
            if wait_s is None:
                return {"run_id": run_id, "state": "pending"}
            result = await client.wait(run_id, timeout_s=wait_s)
            output = result.output if remote else await _shown_output(settings, run_id)
            return {"run_id": run_id, "state": result.state, "output": output, "reason": result.reason}

    document = _run(go())
    if as_json:
        _emit(document)
    else:
        click.echo(
            " ".join(f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in document.items())
        )
    sys.exit(0 if document["state"] in ("pending", "completed") else 1)


@click.command()
@click.argument("run_id")
@click.option("--reason", default="", help="Why: recorded in the run's history and reason.")
@click.option(
    "--wait", "wait_s", type=float, default=None, metavar="S", help="Wait up to S seconds for the run to end."
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def cancel(run_id: str, reason: str, wait_s: float | None, as_json: bool) -> None:
    """Cancel a run: it gets the failed intent with reason 'cancelled', its running stages are asked to
    stop, and its compensations and finalisers run. Exit 0 once the request is with the broker (or, with
    --wait, once the run has ended); exit 1, nothing sent, for a run that has ended or is already
    ending (the error says its state)."""
    settings = _settings()
    requested_by = settings.actor  # through --server: the token's name
    remote = remote_client()

    async def go() -> dict[str, Any]:
        async with remote or Client(settings) as client:
            await client.cancel(run_id, reason, requested_by)
            if wait_s is None:
                return {"run_id": run_id, "requested": True}
            result = await client.wait(run_id, timeout_s=wait_s)
            return {"run_id": run_id, "requested": True, "state": result.state, "reason": result.reason}

    document = _run(go())
    if as_json:
        _emit(document)
    else:
        state = f": the run is {document['state']} ({document['reason']})" if "state" in document else ""
        click.echo(f"cancellation of {run_id} requested{state}")


@click.command()
@click.argument("run_id", required=False)
@click.option("--all", "bulk", is_flag=True, help="Every run matching --state and --definition.")
@click.option("--state", default="failed", show_default=True, help="With --all: runs in this state.")
@click.option("--definition", default=None, help="With --all: runs of this definition only.")
@click.option("--reason", default="", help="Why: recorded in the run's history.")
@click.option(
    "--wait",
    "wait_s",
    type=float,
    default=None,
    metavar="S",
    help="Also wait up to S seconds for the new epoch to end.",
)
@click.option(
    "--undo-lost",
    is_flag=True,
    help="The compensation a poison message left in flight will never report (it was the poison "
    "message, or its task is lost): take its stage as undone and run it again.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def redrive(
    run_id: str | None,
    bulk: bool,
    state: str,
    definition: str | None,
    reason: str,
    wait_s: float | None,
    undo_lost: bool,
    as_json: bool,
) -> None:
    """Resume a failed run (or, with --all, every matching one) in a new epoch on its pinned plan:
    completed stages keep their results; failed, cancelled, timed-out and compensated stages run again;
    finalisers run once more. Prints what the run's orchestrator did with each request: 'redriven
    (epoch N)', or why it refused; a run that is not failed is refused at once, nothing sent, with its
    state. Exit 0 when every request was applied (and, with --wait, every run completed), 1 otherwise."""
    if bulk == (run_id is not None):
        raise click.UsageError("name one RUN, or use --all (with --state and --definition)")
    if bulk and state != "failed":
        raise click.UsageError(f"only failed runs can be re-driven, not {state!r}")
    settings = _settings()
    requested_by = settings.actor  # through --server: the token's name
    remote = remote_client()

    async def go() -> list[dict[str, Any]]:
        async with remote or Client(settings) as client:
            chosen = [run_id] if run_id else await _failed_runs(settings, definition, remote)
            requests = [
                (one, await _request_redrive(client, one, reason, requested_by, undo_lost)) for one in chosen
            ]
            return [await _redrive_report(client, one, request, wait_s) for one, request in requests]

    reports = _run(go())
    if as_json:
        _emit({"runs": reports})
    else:
        for report in reports:
            click.echo(_redrive_line(report), err=not report["redriven"])
        if bulk:
            click.echo(f"{sum(r['redriven'] for r in reports)} of {len(reports)} run(s) re-driven")
    ok = all(r["redriven"] and r.get("state", "completed") == "completed" for r in reports)
    sys.exit(0 if ok else 1)


async def _request_redrive(
    client: Client | Remote, run_id: str, reason: str, requested_by: str, undo_lost: bool
) -> str | RedriveRefused:
    """The request's id, or the client's refusal (a run that is not failed): reported like the
    orchestrator's refusals, so one run's refusal does not hide what became of the others."""
    try:
        return await client.redrive(run_id, reason, requested_by, undo_lost=undo_lost)
    except RedriveRefused as exc:
        return exc


async def _redrive_report(
    client: Client | Remote, run_id: str, request: str | RedriveRefused, wait_s: float | None
) -> dict[str, Any]:
    if isinstance(request, RedriveRefused):
        return {"run_id": run_id, "request": None, "redriven": False, "refused": request.why}
    answer = await client.answer(run_id, request, timeout_s=REQUEST_ANSWER_S)
    report: dict[str, Any] = {"run_id": run_id, "request": request, "redriven": answer.applied}
    if not answer.applied:
        return {**report, "refused": answer.why}
    report["epoch"] = answer.epoch
    if wait_s is not None:
        result = await client.wait(run_id, timeout_s=wait_s)
        report.update(state=result.state, reason=result.reason)
    return report


def _redrive_line(report: dict[str, Any]) -> str:
    if not report["redriven"]:
        return f"error: re-drive of {report['run_id']} refused: {report['refused']}"
    line = f"{report['run_id']} redriven (epoch {report['epoch']})"
    if "state" in report:
        line += f": {report['state']}" + (f" ({report['reason']})" if report.get("reason") else "")
    return line


async def _failed_runs(settings: Settings, definition: str | None, remote: Remote | None) -> list[str]:
    if remote is not None:
        found, _ = await remote.list_runs(RunFilter("failed", definition))
    else:
        found = await _list_runs(settings, "failed")
    return [r["run_id"] for r in found if definition is None or r["definition"] == definition]


@click.command()
@click.option("--dry-run", is_flag=True, help="Report what is stranded; repair nothing.")
@click.option("--min-age-s", type=float, default=60.0, show_default=True, help="Ignore younger entries.")
@click.option(
    "--stranded-after-s", type=float, default=600.0, show_default=True, help="Quiet this long: stranded."
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def reconcile(dry_run: bool, min_age_s: float, stranded_after_s: float, as_json: bool) -> None:
    """Find and repair stranded work on every shard: unsent outbox entries, runs waiting on a message
    that is gone (re-sent with their own ids), and run-id claims without a run."""
    settings = _settings()
    shards = _run(current_map(settings, seed=False)).served

    async def go() -> Report:
        connection = await connect_robust(settings.amqp_url)
        client = redis_client(settings)
        try:
            channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
            store = RedisStore(client, settings.key_prefix, settings.retention_ms)
            signer = signer_for(settings)
            reconciler = Reconciler(
                store,
                Processor(
                    store,
                    lambda: int(time.time() * 1000),
                    settings.limits(),
                    sealer=Sealer(lambda: signer.ring),  # opens what was sealed; re-publishes as given
                ),
                Publisher(
                    channel,
                    signer,
                    settings.names(),
                    settings.delivery_limit,
                    lambda: untracked_channel(connection),
                    settings.quorum_group_size,
                    renew_with=lambda: untracked_channel(connection),
                    max_message_bytes=settings.max_message_bytes,
                    pack_tasks=settings.pack_tasks,
                ),
                min_age_ms=int(min_age_s * 1000),
                stranded_after_ms=int(stranded_after_s * 1000),
            )
            now = int(time.time() * 1000)
            report = await reconciler.claims(now, dry_run=dry_run)
            for shard in shards:
                report.merge(await reconciler.shard(shard, now, dry_run=dry_run))
            return report
        finally:
            await connection.close()
            await client.aclose()

    report = _run(go())
    if as_json:
        _emit({"dry_run": dry_run, **report.as_dict()})
        return
    verb = "found" if dry_run else "repaired"
    click.echo(
        f"{verb}: {len(report.unsent)} unsent outbox entries ({len(report.republished)} re-published, "
        f"{len(report.undeliverable)} too large to send), "
        f"{len(report.stranded)} stranded runs ({len(report.nudged)} nudged), "
        f"{len(report.orphan_claims)} claims without a run ({len(report.dropped_claims)} dropped)"
    )
    for run_id in report.stranded:
        click.echo(f"  stranded run {run_id}")


async def _shown_output(settings: Settings, run_id: str) -> Any:
    """The run's output as it is shown: its sensitive values marked."""
    client = redis_client(settings)
    try:
        document = await run_document(
            client, settings.key_prefix, run_id, key=data_key(settings), sealer=sealer_for(settings)
        )
        return document["output"]
    finally:
        await client.aclose()


async def _list_runs(settings: Settings, state: str | None) -> list[dict[str, Any]]:
    """Runs on every shard (in ``state``, if given), newest first: those of this process's tenant."""
    return await list_runs(
        settings, RunFilter(state=state, tenant=tenant_scope(signer_for(settings), settings))
    )


# How long a request waits for its orchestrator's answer (recorded in the run's history) before the CLI
# says that none came; the request itself stays queued.
REQUEST_ANSWER_S = 30.0


def _run(coro: Any) -> Any:
    """Run a command's coroutine. A SagaError it raises (a run not found, a start refused...) goes up to
    the ``saga`` group, which shows it (text or the --json error document) and exits 1; connection
    failures become one error that names the settings to check."""
    try:
        return asyncio.run(coro)
    except SERVICE_ERRORS as exc:
        raise unreachable(exc) from exc


# the read-only run commands (status, wait, watch, history, runs) are cli_observe's
COMMANDS = [orchestrator, worker, start, cancel, redrive, reconcile]

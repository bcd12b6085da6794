"""The ``saga`` command line.

Exit codes: 0 success, 1 the input is invalid or refused (a definition has problems, a run that is not
there), 2 usage or configuration error (unknown option, missing file, a contracts module that cannot be
loaded, RabbitMQ or Redis that cannot be reached or fails midway), 3 a run still going when a wait ended.
Commands raise; ``orchestrator.cli_errors`` shows every error in
one shape (``error: ...`` on stderr, or with ``--json`` an error document on stdout).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import functools
import json
import logging
import sys
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

import aio_pika
import aiormq
import click
import pamqp.exceptions
import pydantic

from orchestrator import deadletters
from orchestrator.allowlists import load_allowlist
from orchestrator.bus.connect import connect_once, redacted
from orchestrator.bus.topology import Topology, apply_topology, to_definitions, topology_for
from orchestrator.cli_errors import SERVICE_ERRORS, CliError, CodedUsageError, SagaGroup
from orchestrator.cli_options import registry_options
from orchestrator.compiler import CompiledPlan, compile_text
from orchestrator.compiler.allowlist import Allowlist, AllowlistError
from orchestrator.compiler.mermaid import render_mermaid
from orchestrator.contracts import Registry
from orchestrator.errors import ContractError, ContractLoadError, DefinitionError, Problem, SagaError
from orchestrator.remote import SERVER_META, refuse_local_registry, refuse_remote, remote_client
from orchestrator.settings import Settings
from orchestrator.shardmap import ShardMap
from orchestrator.store import shardmap_store


class Env:
    """What every command needs, built once from settings and options."""

    def __init__(self, settings: Settings, modules: tuple[str, ...], registry_file: str | None) -> None:
        self.settings = settings
        self._modules = modules or settings.contracts
        self._registry_file = registry_file
        self._registry: Registry | None = None

    @property
    def registry(self) -> Registry:
        if self._registry is None:
            try:
                if self._registry_file:
                    self._registry = Registry.from_json(Path(self._registry_file).read_text())
                else:
                    self._registry = Registry.from_modules(self._modules)
            except (ContractLoadError, ContractError, OSError, ValueError, KeyError) as exc:
                if isinstance(exc, SagaError):
                    raise CodedUsageError(exc.code, str(exc), exc.ids) from exc
                raise CodedUsageError("registry_unreadable", str(exc)) from exc
        return self._registry

    @functools.cached_property
    def allowlist(self) -> Allowlist | None:
        """The allowlist of SAGA_ALLOWLIST_FILE, read once; one that cannot be used is a configuration
        error (exit 2), not a problem of the definition."""
        try:
            return load_allowlist(self.settings.allowlist_file)
        except AllowlistError as exc:
            raise CodedUsageError(exc.code, str(exc), exc.ids) from exc

    def compile(self, path: str) -> CompiledPlan:
        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            raise DefinitionError(
                [Problem(path, 1, "definition", f"cannot read file: {exc.strerror}")]
            ) from exc
        return compile_text(data, path, self.registry, self.settings.admission_limits(), self.allowlist)


def _env(modules: tuple[str, ...], registry_file: str | None) -> Env:
    return Env(load_settings(), modules, registry_file)


def _shown(loc: tuple[int | str, ...], value: Any) -> str:
    """A refused setting's value for a message: never a key, never a URL's password."""
    if "signing_keys" in loc or "token" in loc:
        return "the keys, not shown"
    if isinstance(value, str) and ("amqp_url" in loc or "redis_url" in loc):
        return repr(redacted(value))
    return repr(value)


def load_settings() -> Settings:
    """Read SAGA_* once; a bad value is a usage error (exit 2) that names the variable."""
    try:
        return Settings()
    except pydantic.ValidationError as exc:
        problems = "; ".join(
            f"SAGA_{'_'.join(str(p) for p in e['loc']).upper()}: {e['msg']} "
            f"(got {_shown(e['loc'], e['input'])})"
            for e in exc.errors(include_url=False)
        )
        raise CodedUsageError("invalid_setting", f"invalid setting: {problems}") from exc


def _emit_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False))


@click.group(
    cls=SagaGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100}
)
@click.version_option(package_name="saga-orchestrator", prog_name="saga")
@click.option(
    "--server",
    "server_url",
    default=None,
    metavar="URL",
    help="Go through the control-plane API at URL ('saga server'), with the token in $SAGA_TOKEN, instead "
    "of RabbitMQ and Redis: start, status, wait, watch, history, runs, cancel, redrive, definitions, "
    "dead-letters, shards and tokens. Overrides $SAGA_SERVER_URL; '' goes direct. Commands "
    "without an API twin refuse it (exit 2).",
)
@click.pass_context
def main(ctx: click.Context, server_url: str | None) -> None:
    """saga-orchestrator: versioned multi-stage workflows (sagas) on RabbitMQ and Redis.

    Validate, compile and publish workflow definitions; declare the broker topology; run orchestrators
    and worker pools; start, inspect, cancel and re-drive runs; repair stranded work and handle dead
    letters. Settings come from SAGA_* variables (SAGA_AMQP_URL, SAGA_REDIS_URL, SAGA_NAMESPACE...).
    With --server URL (or SAGA_SERVER_URL) the commands that have an API twin go through that server,
    acting as the token in SAGA_TOKEN, and print the same output.

    Exit codes: 0 done, 1 refused, failed or not found, 2 usage or configuration error (RabbitMQ or Redis
    unreachable included), 3 still running when a wait ended (wait, watch, --wait). With --json, an error
    is {"error": {"code", "message", "ids"}} on stdout."""
    ctx.meta[SERVER_META] = server_url
    command = ctx.invoked_subcommand
    if command in _PROCESSES:  # a deployment's SAGA_SERVER_URL must not stop its processes
        refuse_remote(command, explicit_only=True)
    elif command in _DIRECT_ONLY:
        refuse_remote(command)


#: Commands with no API twin, refused when a server URL is set (the processes: only given --server).
_PROCESSES = frozenset({"orchestrator", "worker", "server"})
_DIRECT_ONLY = frozenset({"reconcile", "topology"})


@main.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print a JSON report instead of text.")
@registry_options
def validate(
    files: tuple[str, ...], as_json: bool, modules: tuple[str, ...], registry_file: str | None
) -> None:
    """Check definitions; print one line per problem (FILE:LINE: path: message). Exit 1 if any."""
    env = _env(modules, registry_file)
    results: list[dict[str, Any]] = []
    for path in files:
        try:
            plan = env.compile(path)
            results.append({"file": path, "valid": True, "digest": plan.digest, "problems": []})
        except DefinitionError as exc:
            results.append({"file": path, "valid": False, "problems": [vars(p) for p in exc.problems]})
    invalid = [r for r in results if not r["valid"]]
    if as_json:
        _emit_json({"valid": not invalid, "files": results})
    else:
        for result in results:
            for problem in result["problems"]:
                click.echo(str(Problem(**problem)))
        count = sum(len(r["problems"]) for r in invalid)
        summary = f"{len(files) - len(invalid)} of {len(files)} definitions valid" + (
            f"; {count} problem{'s' if count != 1 else ''}" if invalid else ""
        )
        click.echo(summary, err=True)
    sys.exit(1 if invalid else 0)


@main.command(name="compile")
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON with its digest and versions.")
@registry_options
def compile_command(file: str, as_json: bool, modules: tuple[str, ...], registry_file: str | None) -> None:
    """Compile a definition into its canonical plan and print the plan's digest."""
    plan = _compile_or_exit(_env(modules, registry_file), file)
    if as_json:
        _emit_json(plan.to_json_dict())
        return
    click.echo(f"{plan.name} {plan.version}")
    click.echo(f"digest   {plan.digest}")
    click.echo("versions " + ", ".join(f"{k} {v}" for k, v in sorted(plan.versions.items())))
    click.echo(f"class    {plan.plan['class']}")
    click.echo(f"entry    {plan.plan['entry']}")
    click.echo("stages")
    for name, stage in plan.plan["stages"].items():
        target = stage.get("action") or stage.get("worker") or ""
        queue = f" on {stage['queue']}" if "queue" in stage else ""
        click.echo(f"  {name:<24} {stage['type']:<9} {target}{queue}")


@main.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@registry_options
def graph(file: str, modules: tuple[str, ...], registry_file: str | None) -> None:
    """Print the compiled plan as a Mermaid flowchart."""
    click.echo(render_mermaid(_compile_or_exit(_env(modules, registry_file), file).plan), nl=False)


@main.group()
def contracts() -> None:
    """Inspect the contract registry."""


@contracts.command(name="list")
@click.option("--json", "as_json", is_flag=True, help="Print the contracts as JSON.")
@click.option(
    "--live",
    is_flag=True,
    help="Also read Redis: per contract version, the live workers serving it (and through which adapter) "
    "and the unfinished runs pinned to it. Versions only workers or runs know are listed too.",
)
@registry_options
def contracts_list(as_json: bool, live: bool, modules: tuple[str, ...], registry_file: str | None) -> None:
    """List every registered contract with its kind and default queue; with --live, what serves each
    version now and which runs wait on it (a version with pinned runs and no live worker: its tasks wait
    for one)."""
    if live:
        refuse_remote("contracts list --live")
    env = _env(modules, registry_file)
    registry = env.registry
    if live:
        from orchestrator import views
        from orchestrator.settings import redis_client
        from orchestrator.store import worker_registry

        async def read() -> list[dict[str, Any]]:
            shards = (await shardmap_store.current_map(env.settings, seed=False)).known
            client = redis_client(env.settings)
            try:
                prefix, known = env.settings.key_prefix, registry.contracts()
                return await worker_registry.read_contract_rows(client, prefix, shards, known)
            finally:
                await client.aclose()

        rows = asyncio.run(read())
        if as_json:
            _emit_json(rows)
        else:
            for line in views.live_contract_lines(rows):
                click.echo(line)
        return
    if as_json:
        _emit_json([{"ref": c.ref, "kind": c.kind.value, "queue": c.queue} for c in registry.contracts()])
        return
    for c in registry.contracts():
        click.echo(f"{c.ref:<28} {c.kind.value:<7} {c.queue}")


@contracts.command(name="export")
@registry_options
def contracts_export(modules: tuple[str, ...], registry_file: str | None) -> None:
    """Serialise the registry as JSON (load it again with --registry FILE)."""
    click.echo(_env(modules, registry_file).registry.to_json())


def _compile_or_exit(env: Env, file: str) -> CompiledPlan:
    """The plan; an invalid definition raises DefinitionError, which the group shows (its problems, or
    with --json the error document) and exits 1."""
    return env.compile(file)


# ---- saga topology ---------------------------------------------------------------------------------------


class _BrokerError(CliError):
    """A broker that cannot be reached or refuses the topology: a configuration error (exit 2)."""

    def __init__(self, message: str, code: str = "broker_unreachable") -> None:
        super().__init__(code, message, exit_code=2)


def _topology_of(env: Env, shard_map: ShardMap | None = None) -> Topology:
    try:
        return topology_for(env.settings, env.registry, shard_map)
    except ValueError as exc:
        raise _BrokerError(f"cannot build the broker topology: {exc}", "topology_invalid") from exc


def _shard_map(settings: Settings, *, seed: bool) -> ShardMap:
    """The namespace's shard map (stored first, with ``seed``, if there is none yet)."""
    try:
        return asyncio.run(shardmap_store.current_map(settings, seed=seed))
    except ValueError as exc:
        raise _BrokerError(f"cannot build the shard map: {exc}", "topology_invalid") from exc


def _broker_reason(exc: BaseException, url: str) -> str:
    """The broker's own words where it sent a Connection.Close (unknown vhost, refused login), else the
    exception's; never the password."""
    reason = str(exc) or type(exc).__name__
    for arg in exc.args:
        text = getattr(arg, "reply_text", None)
        if text:
            reason = f"{getattr(arg, 'reply_code', '')} {text}".strip()
            break
    return reason.replace(url, redacted(url))


async def _apply_topology(url: str, build: Callable[[], Awaitable[Topology]]) -> Topology:
    """Connect to the broker (first: an unreachable broker is said as such), then build the topology and
    declare it."""
    broker_errors = (aiormq.exceptions.AMQPError, pamqp.exceptions.PAMQPException)
    # aiormq logs a failed connect before raising it; the error below says the same, once.
    logging.getLogger("aiormq").addHandler(logging.NullHandler())
    try:
        connection = await connect_once(url)
    except (*broker_errors, OSError, TimeoutError, ValueError) as exc:
        raise _BrokerError(
            f"cannot connect to RabbitMQ at {redacted(url)}: {_broker_reason(exc, url)}"
        ) from exc
    try:
        topology = await build()
        channel = await connection.channel()
        await apply_topology(channel, topology)
        return topology
    except broker_errors as exc:
        raise _BrokerError(
            f"RabbitMQ at {redacted(url)} refused the topology: {_broker_reason(exc, url)} (an exchange or "
            "queue that exists with other arguments keeps them: use the SAGA_DELIVERY_LIMIT and "
            "SAGA_QUORUM_GROUP_SIZE it was declared with, change it with a policy, or delete it and apply "
            "again)",
            "broker_refused",
        ) from exc
    finally:
        await connection.close()


@main.group()
def topology() -> None:
    """The RabbitMQ topology (exchanges, queues, bindings) derived from settings and contracts."""


@topology.command(name="apply")
@registry_options
def topology_apply(modules: tuple[str, ...], registry_file: str | None) -> None:
    """Declare the topology on the broker at $SAGA_AMQP_URL (idempotent; never deletes anything). Shards
    follow the shard map in Redis; the first apply of a namespace stores the map SAGA_SHARD_CLASSES and
    SAGA_SHARD_COUNT describe ('saga shards' changes it from then on)."""
    env = _env(modules, registry_file)

    async def build() -> Topology:
        try:
            shard_map = await shardmap_store.current_map(env.settings, seed=True)
        except ValueError as exc:
            raise _BrokerError(f"cannot build the shard map: {exc}", "topology_invalid") from exc
        return _topology_of(env, shard_map)

    built = asyncio.run(_apply_topology(env.settings.amqp_url, build))
    click.echo(f"applied {built.summary()} to {redacted(env.settings.amqp_url)}")


@topology.command(name="export")
@click.option(
    "--output", "-o", type=click.Path(dir_okay=False), metavar="FILE", help="Write to FILE, not stdout."
)
@click.option("--vhost", default="/", show_default=True, help="Virtual host the definitions declare.")
@click.option(
    "--user",
    "users",
    multiple=True,
    metavar="NAME:PASSWORD",
    help="Add a user with full permissions on the vhost (repeatable). A broker loading the file at boot "
    "skips rabbitmq.conf's default_user, so a boot file needs one.",
)
@click.option(
    "--role-user",
    "role_users",
    multiple=True,
    metavar="ROLE:PASSWORD",
    help="Add ROLE's least-privilege user, <prefix>-<role>, with this password (repeatable; see saga "
    "provision): orchestrator, worker, client, server.",
)
@registry_options
def topology_export(
    output: str | None,
    vhost: str,
    users: tuple[str, ...],
    role_users: tuple[str, ...],
    modules: tuple[str, ...],
    registry_file: str | None,
) -> None:
    """Print (or write) the topology as RabbitMQ definitions (for load_definitions or import_definitions).
    Shards follow the namespace's shard map in Redis; where there is none (or Redis cannot be reached),
    the first map SAGA_SHARD_CLASSES and SAGA_SHARD_COUNT describe."""
    pairs: list[tuple[str, str]] = []
    for user in users:
        name, sep, password = user.partition(":")
        if not sep or not name or not password:
            raise click.BadParameter(f"{user!r} is not NAME:PASSWORD", param_hint="--user")
        pairs.append((name, password))
    env = _env(modules, registry_file)
    try:
        shard_map = _shard_map(env.settings, seed=False)
    except SERVICE_ERRORS:
        click.echo("note: Redis cannot be reached: shards as SAGA_SHARD_COUNT seeds them", err=True)
        shard_map = None
    built = _topology_of(env, shard_map)
    roles = [_role_user(env.settings, given) for given in role_users]
    text = json.dumps(to_definitions(built, vhost, pairs, roles), indent=2, sort_keys=True) + "\n"
    if output is None:
        click.echo(text, nl=False)
        return
    try:
        Path(output).write_text(text)
    except OSError as exc:
        raise click.UsageError(f"cannot write {output}: {exc.strerror}") from exc
    click.echo(f"wrote {built.summary()} to {output}", err=True)


def _role_user(settings: Settings, given: str) -> tuple[str, str, tuple[str, str, str]]:
    from orchestrator.access import AccessRole, rabbitmq_permissions, user_name

    role, sep, password = given.partition(":")
    if not sep or not password or role not in {r.value for r in AccessRole}:
        roles = ", ".join(r.value for r in AccessRole)
        raise click.BadParameter(
            f"{given!r} is not ROLE:PASSWORD with ROLE one of {roles}", param_hint="--role-user"
        )
    allowed = rabbitmq_permissions(settings.namespace, AccessRole(role))
    return (
        user_name(settings.key_prefix, AccessRole(role)),
        password,
        (allowed.configure, allowed.write, allowed.read),
    )


# ---- saga dead-letters ------------------------------------------------------------------------------------

T = TypeVar("T")


def _dead_letter_queues(queue: str | None, modules: tuple[str, ...], registry_file: str | None) -> list[str]:
    """The queue asked for, or every dead-letter queue of the topology (so contracts' queues too)."""
    if queue is not None:
        try:
            return [deadletters.require_dead_letter_queue(queue, load_settings().names())]
        except deadletters.NotADeadLetterQueue as exc:
            raise CodedUsageError(exc.code, f"Invalid value for '--queue': {exc}", exc.ids) from exc
    settings = load_settings()
    shard_map = _shard_map(settings, seed=False)  # the shards of the map, draining ones included
    topology = _topology_of(_env(modules, registry_file), shard_map)
    return deadletters.dead_letter_queues(topology, settings.names())


def _on_broker(call: Callable[[aio_pika.abc.AbstractConnection], Awaitable[T]]) -> T:
    """Run ``call`` on a fresh connection to $SAGA_AMQP_URL. An id or queue that is not there exits 1; a
    broker that cannot be reached or fails midway is a configuration error (exit 2), and whatever was read
    and not yet acked goes back to its queue when the connection closes."""
    url = load_settings().amqp_url
    broker_errors = (aiormq.exceptions.AMQPError, pamqp.exceptions.PAMQPException, OSError, TimeoutError)

    async def go() -> T:
        logging.getLogger("aiormq").addHandler(logging.NullHandler())
        try:
            connection = await connect_once(url)
        except (*broker_errors, ValueError) as exc:
            raise _BrokerError(
                f"cannot connect to RabbitMQ at {redacted(url)}: {_broker_reason(exc, url)}"
            ) from exc
        try:
            return await call(connection)
        except broker_errors as exc:
            raise _BrokerError(
                f"RabbitMQ at {redacted(url)} failed: {_broker_reason(exc, url)}", "broker_failed"
            ) from exc
        finally:
            await connection.close()

    return asyncio.run(go())  # a DeadLetterError (exit 1) is shown by the group


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' if n != 1 else ''}"


def _letter_line(letter: deadletters.DeadLetter) -> str:
    why = letter.reason + (f" x{letter.death_count}" if letter.death_count is not None else "")
    why += f": {letter.detail}" if letter.detail else ""
    parts = [
        letter.message_id,
        letter.kind or "?",
        f"run {letter.run_id or '?'}",
        f"stage {letter.stage or '-'}",
        why,
        f"from {letter.origin or '?'}",
    ]
    if letter.delivery_count:
        parts.append(f"(inspected {letter.delivery_count}x before)")
    return "  " + deadletters.printable("  ".join(parts), keep_newlines=False)


def _print_listing(listing: deadletters.QueueListing) -> None:
    if not listing.exists:
        click.echo(f"{listing.queue}: not declared (run 'saga topology apply')")
        return
    click.echo(f"{listing.queue}: {_count(listing.count, 'message')}")
    for letter in listing.letters:
        click.echo(_letter_line(letter))
    if listing.count > len(listing.letters):
        click.echo(f"  ... and {listing.count - len(listing.letters)} more (raise --limit to see them)")


def _run_remote(call: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(call)


def _listing_of(document: dict[str, Any]) -> deadletters.QueueListing:
    """A queue's listing from the API's (the ``list --json`` entry)."""
    queue = str(document["queue"])
    letters = tuple(_letter_of({**m, "queue": queue}) for m in document["messages"])
    return deadletters.QueueListing(queue, bool(document["exists"]), int(document["count"]), letters)


def _letter_of(summary: dict[str, Any]) -> deadletters.DeadLetter:
    fields = {f.name for f in dataclasses.fields(deadletters.DeadLetter)}
    return deadletters.DeadLetter(**{k: v for k, v in summary.items() if k in fields})


def _detail_of(document: dict[str, Any]) -> deadletters.Detail:
    """A dead letter's detail from the API's (the ``show --json`` entry)."""
    letter = _letter_of(document)
    body = document["body"]
    raw = base64.b64decode(body) if document["body_format"] == "base64" else json.dumps(body).encode()
    return deadletters.Detail(letter, document["properties"], document["headers"], raw)


_REISSUE_NOTES = {
    True: ", issued again under this process's signing key",
    False: ", sent as it was (it does not verify with this process's SAGA_SIGNING_KEYS, or it reports an "
    "attempt's liveness): a shard refuses it again if it is past its window",
    None: "",
}


def _replayed_row(item: deadletters.Replayed) -> dict[str, Any]:
    """A replay's outcome as the API says it."""
    letter = item.letter
    return {
        "message_id": letter.message_id,
        "queue": letter.queue,
        "target": item.target,
        "error": item.error,
        "reissued": item.reissued,
    }


_queue_option = click.option(
    "--queue",
    "queue",
    default=None,
    metavar="QUEUE",
    help="Only this queue: a '<namespace>.<queue>.dlq' or '<namespace>.rejected' (default: every one of "
    "the namespace's).",
)


@main.group(name="dead-letters")
def dead_letters() -> None:
    """Messages the broker dead-lettered (<namespace>.<queue>.dlq) or saga refused
    (<namespace>.rejected), in the namespace of $SAGA_NAMESPACE only.

    Without --queue they read the topology's dead-letter queues: every shard's, and those of the task
    queues of the loaded contracts (--contracts / $SAGA_CONTRACTS); a task queue that only a stage names
    is read with --queue <namespace>.task.<queue>.dlq.

    Reading never consumes: messages are read without acking and handed back, in order, when the
    command's channel closes. Only 'replay' and 'purge' remove anything."""


@dead_letters.command(name="list")
@_queue_option
@click.option(
    "--limit", default=1000, show_default=True, type=click.IntRange(min=1), help="Messages read per queue."
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@registry_options
def dead_letters_list(
    queue: str | None, limit: int, as_json: bool, modules: tuple[str, ...], registry_file: str | None
) -> None:
    """Per queue: its count, and per message its id, kind, run, stage, reason and original queue. Text
    shows the queues that hold messages (or are not declared), then a summary on stderr."""
    if remote := remote_client():
        refuse_local_registry(modules, registry_file)
        params = {"queue": queue, "limit": limit}
        found = _run_remote(remote.request("GET", "/dead-letters", params=params))["queues"]
        listings = [_listing_of(q) for q in found]
        read_where = f"through {remote.url}"
    else:
        queues = _dead_letter_queues(queue, modules, registry_file)
        listings = _on_broker(lambda c: deadletters.list_queues(c, queues, limit, missing_ok=queue is None))
        read_where = f"of namespace {load_settings().namespace!r}"
    if as_json:
        _emit_json(
            {
                "queues": [
                    {
                        "queue": q.queue,
                        "exists": q.exists,
                        "count": q.count,
                        "messages": [letter.summary() for letter in q.letters],
                    }
                    for q in listings
                ]
            }
        )
        return
    shown = [q for q in listings if q.count or not q.exists or queue is not None]
    for listing in shown:
        _print_listing(listing)
    total = sum(q.count for q in listings)
    holding = sum(1 for q in listings if q.count)
    click.echo(
        f"{_count(total, 'dead letter')} in {_count(holding, 'queue')} "
        f"({_count(len(listings), 'dead-letter queue')} {read_where} read)",
        err=True,
    )


@dead_letters.command(name="show")
@click.argument("message_id")
@_queue_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON (a list: one entry per copy found).")
@registry_options
def dead_letters_show(
    message_id: str, queue: str | None, as_json: bool, modules: tuple[str, ...], registry_file: str | None
) -> None:
    """A dead letter's headers and decoded body (every copy, if the id is there more than once)."""
    if remote := remote_client():
        refuse_local_registry(modules, registry_file)
        path = f"/dead-letters/{quote(message_id, safe='')}"
        found = [_detail_of(d) for d in _run_remote(remote.request("GET", path, params={"queue": queue}))]
    else:
        queues = _dead_letter_queues(queue, modules, registry_file)
        found = _on_broker(lambda c: deadletters.show(c, queues, message_id, missing_ok=queue is None))
        found = asyncio.run(deadletters.redacted(found, load_settings()))
    if as_json:
        _emit_json([detail.document() for detail in found])
        return
    for detail in found:
        click.echo(f"{deadletters.printable(detail.letter.message_id)} on {detail.letter.queue}")
        click.echo(_letter_line(detail.letter))
        for title, table in (("properties", detail.properties), ("headers", detail.headers)):
            click.echo(title)
            for name, value in table.items():
                text = json.dumps(value, ensure_ascii=False, sort_keys=True)
                click.echo(deadletters.printable(f"  {name}: {text}", keep_newlines=False))
        click.echo("body")
        click.echo(deadletters.render_body(detail.body))


@dead_letters.command(name="replay")
@click.argument("message_id", required=False)
@click.option("--all", "replay_all", is_flag=True, help="Replay every message of the queue(s).")
@_queue_option
@registry_options
def dead_letters_replay(
    message_id: str | None,
    replay_all: bool,
    queue: str | None,
    modules: tuple[str, ...],
    registry_file: str | None,
) -> None:
    """Publish MESSAGE_ID (or --all) back to the queue it came from; the dead letter is removed only once
    the broker confirms the copy. Exit 1 if any could not be replayed (they stay where they were)."""
    if (message_id is None) == (not replay_all):
        raise click.UsageError("give either a MESSAGE_ID or --all (not both)")
    if remote := remote_client():
        refuse_local_registry(modules, registry_file)
        body = {"message_id": message_id, "queue": queue}
        done = _run_remote(remote.request("POST", "/dead-letters/replay", body=body))["replayed"]
    else:
        queues = _dead_letter_queues(queue, modules, registry_file)
        reissue = deadletters.replay_reissue(load_settings(), message_id)
        replayed = _on_broker(
            lambda c: deadletters.replay(c, queues, message_id, reissue, missing_ok=queue is None)
        )
        done = [_replayed_row(item) for item in replayed]
    for item in done:
        if item["error"] is None:
            click.echo(
                f"replayed {deadletters.printable(item['message_id'])} from {item['queue']} to "
                f"{item['target']}{_REISSUE_NOTES[item.get('reissued')]}"
            )
        else:
            click.echo(f"error: {deadletters.printable(item['error'])}", err=True)
    failed = sum(1 for item in done if item["error"] is not None)
    click.echo(f"replayed {len(done) - failed} of {len(done)}", err=True)
    sys.exit(1 if failed else 0)


@dead_letters.command(name="purge")
@_queue_option
@click.option("--yes", is_flag=True, help="Yes: delete the messages for good (required).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@registry_options
def dead_letters_purge(
    queue: str | None, yes: bool, as_json: bool, modules: tuple[str, ...], registry_file: str | None
) -> None:
    """Delete every message on the namespace's dead-letter queues (or --queue) for good, and say how
    many each held. Refuses without --yes (exit 2); 'list' shows first what would go."""
    if not yes:
        raise click.UsageError("purge deletes dead letters for good: pass --yes (see them first with 'list')")
    if remote := remote_client():
        refuse_local_registry(modules, registry_file)
        body = {"queue": queue, "all": queue is None}
        found = _run_remote(remote.request("POST", "/dead-letters/purge", body=body))["queues"]
        purged = [deadletters.Purged(q["queue"], q["exists"], q["purged"]) for q in found]
    else:
        queues = _dead_letter_queues(queue, modules, registry_file)
        purged = _on_broker(lambda c: deadletters.purge(c, queues, missing_ok=queue is None))
    if as_json:
        _emit_json({"queues": [{"queue": p.queue, "exists": p.exists, "purged": p.removed} for p in purged]})
        return
    for item in purged:
        if item.removed or queue is not None:
            click.echo(f"purged {_count(item.removed, 'message')} from {item.queue}")
    total = sum(p.removed for p in purged)
    holding = sum(1 for p in purged if p.removed)
    click.echo(f"purged {_count(total, 'dead letter')} from {_count(holding, 'queue')}", err=True)


def _register_runtime_commands() -> None:
    # after main exists: cli_runtime (and cli_observe, through it) import from here
    from orchestrator.cli_definitions import definitions
    from orchestrator.cli_keys import keys_group
    from orchestrator.cli_observe import COMMANDS as OBSERVE_COMMANDS
    from orchestrator.cli_provision import provision
    from orchestrator.cli_runtime import COMMANDS
    from orchestrator.cli_server import server
    from orchestrator.cli_shards import shards
    from orchestrator.cli_tokens import tokens_group

    for command in [
        *COMMANDS,
        *OBSERVE_COMMANDS,
        definitions,
        shards,
        tokens_group,
        keys_group,
        provision,
        server,
    ]:
        main.add_command(command)


_register_runtime_commands()

"""``saga keys``: the key ring of ``SAGA_KEY_RING_FILE`` (``orchestrator/keys``).

Rotation, in four steps: ``add`` a key (it verifies only) and give its secret to every process that must
verify it; ``activate`` it (it signs from then on, and the key it replaces verifies only); ``retire`` the
old key (it signs nothing at once, and verifies for ``SAGA_KEY_RETIRE_GRACE_MS`` more). Running processes
reload the file within a second of each change, or on SIGHUP. Each change is appended to the file's
``changes`` list (who: ``SAGA_ACTOR``). A refused change exits 1 and writes nothing; a bad option exits 2.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import click

from orchestrator.cli_errors import CodedUsageError
from orchestrator.cli_runtime import _emit, _settings
from orchestrator.keys.ring import KeyState, Scope
from orchestrator.keys.ringfile import (
    KeyEntry,
    KeyRingError,
    RingFile,
    activated,
    added,
    editing,
    read_ring_file,
    read_secret,
    retired,
    secret_path,
    write_ring_file,
    write_secret_file,
)
from orchestrator.settings import Settings

_json = click.option("--json", "as_json", is_flag=True, help="Print JSON.")


def _ring_path(settings: Settings) -> Path:
    if settings.key_ring_file is None:
        raise CodedUsageError(
            "key_ring_unset",
            "SAGA_KEY_RING_FILE is not set: point it at the key ring file (created by the first "
            "'saga keys add'), the same path for every process of this machine",
        )
    return Path(settings.key_ring_file)


def _now_ms() -> int:
    return int(time.time() * 1000)


@click.group(name="keys")
def keys_group() -> None:
    """The signing keys of SAGA_KEY_RING_FILE: scoped keys that rotate without a restart."""


@keys_group.command(name="list")
@_json
def keys_list(as_json: bool) -> None:
    """Every key: its scope, state, whether this machine holds its secret, and until when a retired key
    still verifies."""
    settings = _settings()
    path = _ring_path(settings)
    ring = read_ring_file(path)
    rows = [_row(path, e, settings.key_retire_grace_ms) for e in ring.keys]
    if as_json:
        _emit({"file": str(path), "keys": rows})
        return
    if not rows:
        click.echo(f"no keys in {path}: add one with 'saga keys add'", err=True)
        return
    click.echo(f"{'KEY':<24} {'SCOPE':<12} {'FOR':<24} {'STATE':<8} {'HELD':<5} SECRET")
    for row in rows:
        state = row["state"] + ("" if row["verifies"] else " (no longer verifies)")
        held = "yes" if row["held"] else "no"
        click.echo(
            f"{row['id']:<24} {row['scope']:<12} {row['for']:<24} {state:<8} {held:<5} {row['secret']}"
        )


def _row(path: Path, entry: KeyEntry, grace_ms: int) -> dict[str, Any]:
    try:
        held: bool | str = read_secret(path, entry, os.environ) is not None
    except KeyRingError as exc:  # a secret too short, unreadable: say so rather than fail the listing
        held = f"unusable: {exc}"
    where = secret_path(path, entry)
    verifies_until = None
    if entry.state is KeyState.RETIRED and entry.retired_at_ms is not None:
        verifies_until = entry.retired_at_ms + grace_ms
    return {
        "id": entry.id,
        "scope": entry.scope.value,
        "for": ", ".join(entry.contracts or entry.tenants) or "-",
        "state": entry.state.value,
        "retired_at_ms": entry.retired_at_ms,
        "verifies_until_ms": verifies_until,
        "verifies": verifies_until is None or _now_ms() < verifies_until,
        "held": held,
        "secret": f"file {where}" if where is not None else f"variable {entry.secret_env}",
    }


@keys_group.command(name="add")
@click.argument("key_id")
@click.option(
    "--scope",
    required=True,
    type=click.Choice([s.value for s in Scope if s is not Scope.ANY]),
    help="orchestrator: releases and refills; dispatch: tasks, cancellations, finished runs; worker: "
    "results of its contracts; client: starts and cancels of its tenant; operator: cancels, re-drives, "
    "replays; server: the control-plane server, for its tenants; data: signs nothing, keys the hash "
    "that marks sensitive values.",
)
@click.option("--contract", "contracts", multiple=True, help="Worker keys: a contract its pool serves.")
@click.option(
    "--tenant", "tenants", multiple=True, help="Client keys: its tenant; server keys: one of theirs."
)
@click.option(
    "--secret-file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Where the secret is (relative: to the ring file's folder); written with a new random secret, "
    "readable by its owner only, if it does not exist.",
)
@click.option("--secret-env", help="The environment variable that holds the secret instead.")
@click.option("--activate", is_flag=True, help="Sign with it at once (a new ring; else activate it later).")
@_json
def keys_add(
    key_id: str,
    scope: str,
    contracts: tuple[str, ...],
    tenants: tuple[str, ...],
    secret_file: Path | None,
    secret_env: str | None,
    activate: bool,
    as_json: bool,
) -> None:
    """Add KEY_ID to the ring. It verifies from the moment each process reloads; activate it once every
    process that must verify it holds its secret."""
    settings = _settings()
    path = _ring_path(settings)
    if secret_file is None and secret_env is None:
        secret_file = Path("secrets") / f"{key_id}.key"
    try:
        entry = KeyEntry(
            id=key_id,
            scope=Scope(scope),
            state=KeyState.ACTIVE if activate else KeyState.VERIFY,
            secret_file=None if secret_file is None else str(secret_file),
            secret_env=secret_env,
            contracts=list(contracts),
            tenants=list(tenants),
        )
    except ValueError as exc:
        raise CodedUsageError("key_invalid", _first_error(exc)) from exc
    with editing(path):
        changed = added(read_ring_file(path), entry, _now_ms(), settings.actor)
        where = secret_path(path, entry)
        if where is not None:
            write_secret_file(where)
        write_ring_file(path, changed)
    _report(as_json, path, changed, f"added key {key_id} ({entry.state.value})")


def _first_error(exc: ValueError) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        first = errors(include_url=False)[0]
        where = ".".join(str(p) for p in first["loc"])
        return f"{where}: {first['msg']}" if where else str(first["msg"]).removeprefix("Value error, ")
    return str(exc)


@keys_group.command(name="activate")
@click.argument("key_id")
@_json
def keys_activate(key_id: str, as_json: bool) -> None:
    """KEY_ID signs from now on; the key it replaces (same scope, contracts or tenants) verifies only."""
    settings = _settings()
    path = _ring_path(settings)
    with editing(path):
        changed = activated(read_ring_file(path), key_id, _now_ms(), settings.actor)
        write_ring_file(path, changed)
    _report(as_json, path, changed, f"activated key {key_id}")


@keys_group.command(name="retire")
@click.argument("key_id")
@click.option("--force", is_flag=True, help="Even if it is the only active key of its scope.")
@_json
def keys_retire(key_id: str, force: bool, as_json: bool) -> None:
    """KEY_ID signs nothing from now on, and verifies for SAGA_KEY_RETIRE_GRACE_MS more."""
    settings = _settings()
    path = _ring_path(settings)
    with editing(path):
        changed = retired(read_ring_file(path), key_id, _now_ms(), settings.actor, force=force)
        write_ring_file(path, changed)
    grace_s = settings.key_retire_grace_ms / 1000
    _report(as_json, path, changed, f"retired key {key_id}: it verifies for {grace_s:g} s more")


def _report(as_json: bool, path: Path, ring: RingFile, said: str) -> None:
    if as_json:
        _emit({"file": str(path), "change": ring.changes[-1].model_dump(mode="json")})
        return
    click.echo(f"{said} in {path}; running processes reload it within a second", err=True)

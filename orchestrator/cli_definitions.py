"""``saga definitions``: publish versions and move them through their lifecycle.

Every change is stored atomically with its audit record (who: ``SAGA_ACTOR``; when: Redis's clock; why:
``--reason``). A refused change exits 1 with the reason and changes nothing; Redis that cannot be reached
exits 2.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

import click

from orchestrator.cli_options import registry_options
from orchestrator.cli_runtime import _emit, _run, _settings
from orchestrator.governance import service
from orchestrator.governance.diff import PlanDiff, diff_plans
from orchestrator.governance.lifecycle import Change, DefinitionState, LifecycleRefused, VersionRecord
from orchestrator.remote import Remote, refuse_local_registry, remote_client

_json = click.option("--json", "as_json", is_flag=True, help="Print JSON.")
_reason = click.option("--reason", default="", help="Why: kept in the audit record.")
_version = click.option("--version", "version", required=True, metavar="V", help="The version, e.g. 2.4.0.")


def _api_path(name: str, tail: str = "") -> str:
    """A definition's path in the API (``/api/v1`` left out)."""
    return f"/definitions/{quote(name, safe='')}{tail}"


@click.group()
def definitions() -> None:
    """Publish definition versions and govern them: approve, activate, canary (then promote or abort),
    rollback, retire. 'list' and 'show' say who did what; 'diff' what changed between two versions."""


@definitions.command(name="publish")
@click.argument("files", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--activate",
    is_flag=True,
    help="Also approve and activate each version (development: refused where separate approval is on).",
)
@_reason
@_json
@registry_options
def definitions_publish(
    files: tuple[str, ...],
    activate: bool,
    reason: str,
    as_json: bool,
    modules: tuple[str, ...],
    registry_file: str | None,
) -> None:
    """Compile every FILE and store each as a new published version: immutable, not yet used by any run
    (approve it, then activate it or put it on a canary). The same file again changes nothing; another
    file under a stored name and version is refused: bump its version. An invalid definition exits 1 with
    its problems, and then nothing is published."""
    if remote := remote_client():
        rows = _run(_publish_remote(remote, files, activate, reason, modules, registry_file))
    else:
        rows = _publish(files, activate, reason, modules, registry_file)
    if as_json:
        _emit(rows)
        return
    for row in rows:
        note = "" if row["changed"] else " (already published: nothing changed)"
        click.echo(f"{row['definition']} {row['version']} {row['digest']} is {row['state']}{note}")


def _publish(
    files: tuple[str, ...], activate: bool, reason: str, modules: tuple[str, ...], registry_file: str | None
) -> list[dict[str, Any]]:
    from orchestrator.cli import Env  # after main exists: cli imports this module

    settings = _settings()
    env = Env(settings, modules, registry_file)
    plans = [(path, env.compile(path)) for path in files]  # a DefinitionError is shown by the saga group
    changes = _run(
        service.publish(settings, [p for _, p in plans], settings.actor, reason, activate=activate)
    )
    rows = []
    for (path, plan), change in zip(plans, changes, strict=True):
        state = change.after.versions[plan.version].state.value
        rows.append(
            {
                "file": path,
                "definition": plan.name,
                "version": plan.version,
                "digest": plan.digest,
                "state": state,
                "changed": not change.noop,
            }
        )
    return rows


async def _publish_remote(
    remote: Remote,
    files: tuple[str, ...],
    activate: bool,
    reason: str,
    modules: tuple[str, ...],
    registry_file: str | None,
) -> list[dict[str, Any]]:
    """Each file in its own request, in order, compiled by the server against its contracts; the first
    refusal stops the rest (those before it stay published)."""
    refuse_local_registry(modules, registry_file)
    rows = []
    for path in files:
        try:
            source = Path(path).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise click.BadParameter(f"cannot read {path}: {exc}", param_hint="FILES") from exc
        body = {"source": source, "file": path, "activate": activate, "reason": reason}
        answer = await remote.request("POST", "/definitions", body=body)
        rows.append(
            {
                "file": path,
                **{k: answer[k] for k in ("definition", "version", "digest", "state", "changed")},
            }
        )
    return rows


@definitions.command(name="list")
@click.argument("name", required=False)
@_json
def definitions_list(name: str | None, as_json: bool) -> None:
    """Every version of every definition (or of NAME): state, digest, who published, approved and
    activated it and when, and its runs not yet finished."""
    if remote := remote_client():
        answer = _run(remote.request("GET", _api_path(name) if name else "/definitions"))
        rows = answer["versions"] if name else answer
    else:
        rows = _rows(name)
    if as_json:
        _emit(rows)
        return
    if not rows:
        click.echo("no definitions published yet: saga definitions publish FILE")
        return
    click.echo(f"{'DEFINITION':<24} {'VERSION':<10} {'STATE':<9} {'RUNS':>5}  {'DIGEST':<19} WHO")
    for row in rows:
        state = row["state"] + (f" {row['canary_percent']}%" if row["state"] == "canary" else "")
        click.echo(
            f"{row['definition']:<24} {row['version']:<10} {state:<9} {row['unfinished_runs']:>5}  "
            f"{row['digest'][:19]:<19} {_who(row)}"
        )


def _rows(name: str | None) -> list[dict[str, Any]]:
    settings = _settings()

    async def read() -> tuple[list[DefinitionState], dict[str, int]]:
        return await service.states(settings, name), await service.unfinished(settings)

    states, unfinished = _run(read())
    return [service.version_row(state, v, unfinished) for state in states for v in state.versions]


def _who(row: Mapping[str, Any]) -> str:
    parts = []
    for verb in ("published", "approved", "activated", "retired"):
        by = row.get(f"{verb}_by")
        if by:
            parts.append(f"{verb} by {by} {_when(row[f'{verb}_at'])}")
    return "; ".join(parts)


def _when(at_ms: int | None) -> str:
    if at_ms is None:
        return ""
    return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(at_ms / 1000))


@definitions.command(name="show")
@click.argument("name")
@click.option("--version", "version", default=None, metavar="V", help="One version (default: all).")
@_json
def definitions_show(name: str, version: str | None, as_json: bool) -> None:
    """NAME's versions (or one), its routing (active version, canary) and its audit history."""
    settings = _settings()

    async def read() -> tuple[DefinitionState, list[dict[str, Any]], dict[str, int]]:
        (state,) = await service.states(settings, name)
        return state, await service.audit(settings, name), await service.unfinished(settings)

    if remote := remote_client():
        state, audit, unfinished = _shown(_run(remote.request("GET", _api_path(name))))
    else:
        state, audit, unfinished = _run(read())
    records = [state.record(version)] if version else list(state.versions.values())
    if version:
        audit = [a for a in audit if a["version"] == version]
    document: dict[str, Any] = {
        "definition": name,
        "active": state.active,
        "canary": state.canary,
        "canary_percent": state.canary_percent if state.canary else None,
        "versions": [service.version_row(state, r.version, unfinished) for r in records],
        "audit": audit,
    }
    if as_json:
        _emit(document)
        return
    canary = f", canary {state.canary} for {state.canary_percent}% of new runs" if state.canary else ""
    click.echo(f"{name}: active {state.active or '(none)'}{canary}")
    for row in document["versions"]:
        click.echo(f"  {row['version']:<10} {row['state']:<9} {row['digest']}  runs {row['unfinished_runs']}")
        click.echo(f"             {_who(row)}")
    click.echo("audit")
    for a in audit:
        why = f" ({a['reason']})" if a["reason"] else ""
        moved = f"{a['from'] or '-'} -> {a['to']}"
        click.echo(f"  {_when(a['at'])} {a['actor']} {a['action']} {a['version']}: {moved}{why}")


def _shown(answer: dict[str, Any]) -> tuple[DefinitionState, list[dict[str, Any]], dict[str, int]]:
    """What ``show`` reads, from the API's answer (which is ``show --json`` of every version)."""
    rows = answer["versions"]
    state = DefinitionState(
        name=answer["definition"],
        versions={row["version"]: VersionRecord.from_json(row) for row in rows},
        active=answer["active"],
        canary=answer["canary"],
        canary_percent=answer["canary_percent"] or 0,
    )
    return state, answer["audit"], {row["digest"]: row["unfinished_runs"] for row in rows}


@definitions.command(name="diff")
@click.argument("name")
@click.argument("old_version", metavar="V1")
@click.argument("new_version", metavar="V2")
@_json
def definitions_diff(name: str, old_version: str, new_version: str, as_json: bool) -> None:
    """What changed in NAME's plan from V1 to V2: stages added, removed and changed (field by field),
    the definition's own fields, and the contracts it calls."""
    settings = _settings()

    async def read() -> tuple[dict[str, Any], dict[str, Any]]:
        (state,) = await service.states(settings, name)
        old, new = state.record(old_version), state.record(new_version)
        return await service.plan_of(settings, old.digest), await service.plan_of(settings, new.digest)

    if remote := remote_client():
        params = {"v1": old_version, "v2": new_version}
        diff = PlanDiff.from_json(_run(remote.request("GET", _api_path(name, "/diff"), params=params)))
    else:
        diff = diff_plans(*_run(read()))
    if as_json:
        _emit({"definition": name, "from": old_version, "to": new_version, **diff.to_json()})
        return
    click.echo(f"{name} {old_version} -> {new_version}")
    for line in diff.lines():
        click.echo(f"  {line}")


def _act(
    verb: str, name: str, reason: str, as_json: bool, version: str | None = None, percent: int = 0
) -> None:
    if remote := remote_client():
        body = {"version": version, "percent": percent, "reason": reason}
        answer = _run(remote.request("POST", _api_path(name, f"/{verb}"), body=body))
        _show_change(answer, as_json, verb, name)
        return
    settings = _settings()
    request = service.Request(
        actor=settings.actor,
        reason=reason,
        version=version,
        percent=percent,
        separate_approver=settings.separate_approver_required,
    )
    _report(_run(service.change(settings, verb, name, request)), as_json, verb, name)


def _report(change: Change, as_json: bool, verb: str, name: str) -> None:
    _show_change(service.change_document(name, change), as_json, verb, name)


def _show_change(document: dict[str, Any], as_json: bool, verb: str, name: str) -> None:
    if as_json:
        _emit(document)
        return
    if not document["changed"]:
        click.echo(f"{name}: nothing to {verb}: already so")
    for r in document["records"]:
        click.echo(f"{name} {r['version']}: {r['from'] or '-'} -> {r['to']}")


@definitions.command(name="approve")
@click.argument("name")
@_version
@_reason
@_json
def definitions_approve(name: str, version: str, reason: str, as_json: bool) -> None:
    """Approve a published version of NAME (refused for its publisher where separate approval is on)."""
    _act("approve", name, reason, as_json, version)


@definitions.command(name="activate")
@click.argument("name")
@_version
@_reason
@_json
def definitions_activate(name: str, version: str, reason: str, as_json: bool) -> None:
    """Make an approved version of NAME the one new runs use; the active one goes to standby. Runs in
    flight keep the plan they pinned."""
    _act("activate", name, reason, as_json, version)


@definitions.command(name="canary")
@click.argument("name")
@_version
@click.option(
    "--percent",
    type=click.IntRange(1, 99),
    required=True,
    help="The share of new runs (chosen by run id) that use the canary.",
)
@_reason
@_json
def definitions_canary(name: str, version: str, percent: int, reason: str, as_json: bool) -> None:
    """Let --percent of NAME's new runs use an approved version (chosen by run id, so a re-sent start
    picks the same version); then 'promote' or 'abort' it. Nothing else changes NAME meanwhile."""
    _act("canary", name, reason, as_json, version, percent)


@definitions.command(name="promote")
@click.argument("name")
@_reason
@_json
def definitions_promote(name: str, reason: str, as_json: bool) -> None:
    """The canary of NAME becomes active for every new run; the old active version goes to standby."""
    _act("promote", name, reason, as_json)


@definitions.command(name="abort")
@click.argument("name")
@_reason
@_json
def definitions_abort(name: str, reason: str, as_json: bool) -> None:
    """End NAME's canary: it goes back to approved, and the active version takes every new run."""
    _act("abort", name, reason, as_json)


@definitions.command(name="rollback")
@click.argument("name")
@_reason
@_json
def definitions_rollback(name: str, reason: str, as_json: bool) -> None:
    """Activate again the version of NAME that was active before the current one (from the audit
    history); the current one goes to standby."""
    _act("rollback", name, reason, as_json)


@definitions.command(name="retire")
@click.argument("name")
@_version
@_reason
@_json
def definitions_retire(name: str, version: str, reason: str, as_json: bool) -> None:
    """No new runs of a version of NAME (never the active one): runs pinned to it finish on it, and
    'list' shows them draining to 0."""
    _act("retire", name, reason, as_json, version)


__all__ = ["LifecycleRefused", "definitions"]

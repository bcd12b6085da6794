"""``saga tokens``: the bearer tokens the control-plane API accepts, and their roles.

A token's secret is printed once, by ``create``, and stored only hashed. Every create and revoke is kept in
an audit stream (who: ``SAGA_ACTOR``; when: Redis's clock). A refusal (a name a live token holds, a token
not found) exits 1 and changes nothing; a bad option or Redis that cannot be reached exits 2.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any
from urllib.parse import quote

import click

from orchestrator.auth import tokens
from orchestrator.auth.roles import Role
from orchestrator.auth.tokens import TokenNameInvalid, TokenRecord
from orchestrator.cli_runtime import _emit, _run, _settings
from orchestrator.remote import remote_client

_json = click.option("--json", "as_json", is_flag=True, help="Print JSON.")


def _checked(field: str) -> Any:
    def check(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
        if value is None:
            return None
        try:
            return tokens.check_name(field, value)
        except TokenNameInvalid as exc:
            raise click.BadParameter(str(exc), ctx, param) from exc

    return check


@click.group(name="tokens")
def tokens_group() -> None:
    """Bearer tokens for the control-plane API: each has a name (the actor in audit records), a role
    (viewer, author, approver, operator, admin) and a tenant. Revoking one refuses it at once."""


@tokens_group.command(name="create")
@click.option("--name", required=True, callback=_checked("name"), help="Unique among live tokens.")
@click.option(
    "--role",
    required=True,
    type=click.Choice([r.value for r in Role]),
    help="viewer reads; author publishes; approver governs versions; operator runs; admin all, and tokens.",
)
@click.option(
    "--tenant",
    default=None,
    callback=_checked("tenant"),
    help="Its tenant (default: 'default'; through --server, the caller's own).",
)
@_json
def tokens_create(name: str, role: str, tenant: str | None, as_json: bool) -> None:
    """Create a token and print its secret (alone on stdout; the rest on stderr): the only time it is
    shown, as only its hash is stored. A name a live token holds is refused: revoke that one first."""
    settings = _settings()

    async def create() -> tuple[str, TokenRecord]:
        async with tokens.opened(settings) as store:
            return await store.create(name, role, tenant or "default", actor=settings.actor)

    if remote := remote_client():
        body = {"name": name, "role": role, **({"tenant": tenant} if tenant else {})}
        answer = _run(remote.request("POST", "/tokens", body=body))
        secret, record = answer["token"], _record_of(answer)
    else:
        secret, record = _run(create())
    if as_json:
        _emit({**record.to_json(), "secret": secret, "warning": _WARNING})
        return
    # the secret alone on stdout (TOKEN=$(saga tokens create ...)); the rest for the person on stderr
    click.echo(
        f"created token {record.name} (id {record.token_id}, role {record.role}, tenant {record.tenant})",
        err=True,
    )
    click.echo(secret)
    click.echo(f"warning: {_WARNING}", err=True)


_WARNING = "this secret is not shown again: store it now (a lost one cannot be recovered; revoke it)"


@tokens_group.command(name="list")
@_json
def tokens_list(as_json: bool) -> None:
    """Every token, live and revoked: id, name, role, tenant, who created it and when, and when it was
    revoked. Never a secret."""
    settings = _settings()

    async def read() -> list[TokenRecord]:
        async with tokens.opened(settings) as store:
            return await store.list()

    if remote := remote_client():
        records = [_record_of(r) for r in _run(remote.request("GET", "/tokens"))]
    else:
        records = _run(read())
    if as_json:
        _emit([r.to_json() for r in records])
        return
    if not records:
        click.echo("no tokens yet: saga tokens create --name NAME --role ROLE")
        return
    click.echo(f"{'ID':<13} {'NAME':<24} {'ROLE':<9} {'TENANT':<12} {'STATE':<8} CREATED")
    for r in records:
        state = "live" if r.live else "revoked"
        made = f"{_when(r.created_at)} by {r.created_by}"
        gone = f"; revoked {_when(r.revoked_at)} by {r.revoked_by}" if r.revoked_at is not None else ""
        click.echo(f"{r.token_id:<13} {r.name:<24} {r.role:<9} {r.tenant:<12} {state:<8} {made}{gone}")


@tokens_group.command(name="revoke")
@click.argument("name_or_id")
@_json
def tokens_revoke(name_or_id: str, as_json: bool) -> None:
    """Revoke the live token named NAME_OR_ID (or the token with that id): the API refuses its secret
    from the next request on. A token already revoked (by id) changes nothing."""
    settings = _settings()

    async def revoke() -> tuple[TokenRecord, bool]:
        async with tokens.opened(settings) as store:
            return await store.revoke(name_or_id, settings.actor)

    if remote := remote_client():
        answer = _run(remote.request("POST", f"/tokens/{quote(name_or_id, safe='')}/revoke"))
        record, changed = _record_of(answer), bool(answer["changed"])
    else:
        record, changed = _run(revoke())
    if as_json:
        _emit({**record.to_json(), "changed": changed})
        return
    if changed:
        click.echo(f"revoked token {record.name} (id {record.token_id})")
    else:
        click.echo(
            f"token {record.name} (id {record.token_id}) was already revoked "
            f"{_when(record.revoked_at)} by {record.revoked_by}: nothing changed"
        )


def _record_of(document: dict[str, Any]) -> TokenRecord:
    """A token's record from the API's answer (its ``to_json``)."""
    fields = {f.name for f in dataclasses.fields(TokenRecord)}
    values = {k: v for k, v in document.items() if k in fields}
    return TokenRecord(**{**values, "role": Role(values["role"])})


def _when(at_ms: int | None) -> str:
    if at_ms is None:
        return ""
    return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(at_ms / 1000))

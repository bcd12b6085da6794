"""``saga provision``: a Redis user and a RabbitMQ user per role, each with only what it needs
(``orchestrator/access.py``), and each role's connection settings in a file of its own.

Run it as an administrator (``SAGA_REDIS_URL`` and ``SAGA_AMQP_URL`` of a user that may create users). For
each role it makes a random password (kept, if its file exists), sets the role's Redis ACL user (``ACL
SETUSER``; on a cluster, on every primary) and RabbitMQ user (``rabbitmqctl``, for a broker on this
host, unless ``--no-rabbitmq``), writes ``<secrets-dir>/<role>.env`` (``SAGA_REDIS_URL`` and
``SAGA_AMQP_URL`` as that user, readable by its owner only) and, with ``--rabbitmq-definitions FILE``,
the RabbitMQ users and permissions as definitions to import elsewhere. A refused step exits 1 and says
which; nothing is printed that holds a password.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit, urlunsplit

import click
from redis.exceptions import ResponseError

from orchestrator.access import (
    AccessRole,
    acl_file,
    rabbitmq_definitions,
    rabbitmq_permissions,
    redis_acl,
    user_name,
)
from orchestrator.cli_errors import CliError
from orchestrator.cli_runtime import _settings
from orchestrator.keys.ringfile import new_secret
from orchestrator.settings import Settings
from orchestrator.store.connect import REDIS_ERRORS, is_cluster_url, sync_client


@click.command(name="provision")
@click.option(
    "--role",
    "roles",
    multiple=True,
    type=click.Choice([r.value for r in AccessRole]),
    help="Only these roles (default: every one).",
)
@click.option(
    "--secrets-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("secrets"),
    show_default=True,
    help="Where each role's <role>.env and password files go.",
)
@click.option("--redis/--no-redis", "on_redis", default=True, help="Set the Redis ACL users.")
@click.option(
    "--rabbitmq/--no-rabbitmq",
    "on_rabbitmq",
    default=True,
    help="Set the RabbitMQ users with rabbitmqctl (a broker on this host).",
)
@click.option(
    "--password",
    "given",
    multiple=True,
    metavar="ROLE:PASSWORD",
    help="Use this password for ROLE (from your vault; or a placeholder, for a file you fill in later) "
    "instead of the one kept in SECRETS_DIR/<role>.password.",
)
@click.option(
    "--redis-acl-file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Also write the Redis users as an ACL file (redis-server --aclfile FILE).",
)
@click.option(
    "--rabbitmq-definitions",
    "rabbitmq_definitions_to",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Also write the RabbitMQ users and permissions as definitions (rabbitmqctl import_definitions).",
)
def provision(
    roles: tuple[str, ...],
    secrets_dir: Path,
    on_redis: bool,
    on_rabbitmq: bool,
    given: tuple[str, ...],
    redis_acl_file: Path | None,
    rabbitmq_definitions_to: Path | None,
) -> None:
    """A least-privilege Redis user and RabbitMQ user for each role: orchestrator, worker, client, server,
    admin. Each role's settings go to SECRETS_DIR/<role>.env: give each process its own."""
    settings = _settings()
    chosen = [AccessRole(r) for r in roles] or list(AccessRole)
    fixed = _given_passwords(given)
    passwords = {role: _password(secrets_dir, role, fixed.get(role)) for role in chosen}
    if on_redis:
        _redis_users(settings, passwords)
    vhost = _vhost(settings.amqp_url)
    if on_rabbitmq:
        _rabbitmq_users(settings, vhost, passwords)
    if redis_acl_file is not None:
        redis_acl_file.write_text(acl_file(settings.key_prefix, passwords))
        click.echo(f"wrote the Redis users to {redis_acl_file}", err=True)
    if rabbitmq_definitions_to is not None:
        document = rabbitmq_definitions(settings.namespace, vhost, passwords, settings.key_prefix)
        rabbitmq_definitions_to.write_text(json.dumps(document, indent=2) + "\n")
        click.echo(f"wrote the RabbitMQ users and permissions to {rabbitmq_definitions_to}", err=True)
    for role, password in passwords.items():
        path = _write_env(secrets_dir, role, _env_of(settings, role, password))
        click.echo(f"{role.value}: user {user_name(settings.key_prefix, role)}, settings in {path}", err=True)


def _given_passwords(given: tuple[str, ...]) -> dict[AccessRole, str]:
    found = {}
    for pair in given:
        role, sep, password = pair.partition(":")
        if not sep or not password or role not in {r.value for r in AccessRole}:
            roles = ", ".join(r.value for r in AccessRole)
            raise click.BadParameter(
                f"{pair!r} is not ROLE:PASSWORD with ROLE one of {roles}", param_hint="--password"
            )
        found[AccessRole(role)] = password
    return found


def _password(folder: Path, role: AccessRole, given: str | None) -> str:
    """The role's password: ``given`` (kept in its file from now on), else the one kept in its file, else
    a new one written there (owner only), so that provisioning again never changes it unasked."""
    path = folder / f"{role.value}.password"
    if given is None and path.exists():
        return path.read_text().strip()
    folder.mkdir(parents=True, exist_ok=True)
    password = given or new_secret()
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(password + "\n")
    return password


def _redis_users(settings: Settings, passwords: dict[AccessRole, str]) -> None:
    """Set each role's user on every node (a cluster's replicas too: a failover must find them), and save
    them to the ACL file where the server keeps one (else a restart would lose them: a warning)."""
    client = sync_client(settings.redis_url, decode_responses=True)
    try:
        nodes = client.get_nodes() if is_cluster_url(settings.redis_url) else [None]  # type: ignore[attr-defined]
        for node in nodes:
            target = {} if node is None else {"target_nodes": node}
            for role, password in passwords.items():
                args = [
                    "ACL",
                    "SETUSER",
                    user_name(settings.key_prefix, role),
                    *redis_acl(settings.key_prefix, role, password),
                ]
                client.execute_command(*args, **target)  # type: ignore[no-untyped-call]
            try:
                client.execute_command("ACL", "SAVE", **target)  # type: ignore[no-untyped-call]
            except ResponseError as exc:  # no aclfile: users live until a restart
                click.echo(
                    f"warning: Redis keeps no ACL file ({exc}): the users are lost on a restart; run Redis "
                    "with --aclfile, or write them with --redis-acl-file and load that",
                    err=True,
                )
    except REDIS_ERRORS as exc:
        raise CliError(
            "provision_refused",
            f"could not set the Redis users ({type(exc).__name__}: {exc}): run saga provision with a "
            "SAGA_REDIS_URL whose user may run ACL SETUSER (Redis's default user, or one with +acl); "
            "the users it makes, saga's admin included, may not",
        ) from exc
    finally:
        client.close()


def _vhost(amqp_url: str) -> str:
    first = amqp_url.split(",", maxsplit=1)[0]
    path = urlsplit(first).path
    return unquote(path[1:]) if len(path) > 1 else "/"


def _rabbitmq_users(settings: Settings, vhost: str, passwords: dict[AccessRole, str]) -> None:
    ctl = shutil.which("rabbitmqctl")
    if ctl is None:
        raise CliError(
            "provision_refused",
            "rabbitmqctl is not on this host: pass --no-rabbitmq --rabbitmq-definitions FILE and import "
            "that file on the broker (rabbitmqctl import_definitions FILE)",
        )
    for role, password in passwords.items():
        name = user_name(settings.key_prefix, role)
        allowed = rabbitmq_permissions(settings.namespace, role)
        existing = _ctl(ctl, "list_users", "--formatter", "json")
        if any(u.get("user") == name for u in json.loads(existing or "[]")):
            _ctl(ctl, "change_password", name, password)
        else:
            _ctl(ctl, "add_user", name, password)
        _ctl(ctl, "set_user_tags", name)  # none: management rights are the broker's administrators' alone
        _ctl(ctl, "set_permissions", "-p", vhost, name, allowed.configure, allowed.write, allowed.read)


def _ctl(ctl: str, *args: str) -> str:
    done = subprocess.run([ctl, "-q", *args], capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0:
        shown = args[0] if args[0] in ("add_user", "change_password") else " ".join(args)
        raise CliError(
            "provision_refused", f"rabbitmqctl {shown} failed: {done.stderr.strip() or done.stdout.strip()}"
        )
    return done.stdout


def _env_of(settings: Settings, role: AccessRole, password: str) -> dict[str, str]:
    user = user_name(settings.key_prefix, role)
    return {
        "SAGA_REDIS_URL": _with_user(settings.redis_url, user, password),
        "SAGA_AMQP_URL": ",".join(_with_user(u, user, password) for u in settings.amqp_url.split(",")),
        "SAGA_NAMESPACE": settings.namespace,
        "SAGA_KEY_PREFIX": settings.key_prefix,
    }


def _with_user(url: str, user: str, password: str) -> str:
    """``url`` as ``user`` (a URL naming only hosts, as a node list's later entries may, is kept)."""
    if "://" not in url:
        return url
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{quote(user, safe='')}:{quote(password, safe='')}@{host}"))


def _write_env(folder: Path, role: AccessRole, env: dict[str, str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{role.value}.env"
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.writelines(f"{name}={value}\n" for name, value in env.items())
    return path

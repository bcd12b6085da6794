"""Durability modes (``SAGA_MODE``): what a process checks before it starts serving.

* ``development`` (default): nothing is refused; one warning at start-up names what this set-up can lose.
* ``production``: the orchestrator refuses to start when Redis persists nothing (its state would not survive
  a Redis restart), and the orchestrator and workers refuse to start while any signing key is the
  development default (anyone can forge messages with it). A Redis whose ``appendfsync`` is not ``always``
  is only warned about: it loses at most the last second of acknowledged transitions on a power cut.

:func:`assess` is the pure decision over :class:`Facts`; :func:`gather` is the I/O that collects them and
:func:`check_startup` puts the two together for the CLI.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from urllib.parse import unquote, urlsplit

import redis

from orchestrator.bus.connect import node_urls
from orchestrator.errors import SagaError
from orchestrator.keys.ringfile import load_ring
from orchestrator.settings import DEVELOPMENT_SIGNING_SECRET, Settings
from orchestrator.store.connect import (
    BadRedisUrl,
    config_of_every_primary,
    info_of_every_primary,
    is_cluster_url,
    parse_cluster_url,
    sync_client,
)

log = logging.getLogger(__name__)

PRODUCTION = "production"
#: Short: a start-up check must not hang a process that would otherwise report Redis as unreachable itself.
REDIS_TIMEOUT_S = 5.0


class Role(StrEnum):
    ORCHESTRATOR = "orchestrator"  # owns run state in Redis
    WORKER = "worker"  # owns no state: only the signing keys matter


@dataclass(frozen=True)
class Facts:
    """What a start-up check found. ``None`` means not asked (a worker does not ask Redis) or unreadable."""

    mode: str
    role: Role
    redis: str  # where, for messages: host:port/db, never a password
    aof_enabled: bool | None = None
    appendfsync: str | None = None
    redis_error: str | None = None  # why aof_enabled could not be read
    development_keys: tuple[str, ...] = ()  # ids of signing keys whose secret is the development default
    default_redis_user: bool = False  # SAGA_REDIS_URL names no user (or "default"): the all-powerful one
    amqp_guest: bool = False  # SAGA_AMQP_URL connects as RabbitMQ's guest
    unscoped_keys: bool = False  # signing keys from SAGA_SIGNING_KEYS: each may sign any message


@dataclass(frozen=True)
class Verdict:
    refusals: tuple[str, ...]
    warnings: tuple[str, ...]


class DurabilityRefused(SagaError):
    """Raised when production mode refuses to start; ``problems`` says each reason and what to do."""

    code = "durability_refused"
    id_fields = ("role",)

    def __init__(self, role: Role, problems: tuple[str, ...]) -> None:
        self.role = role
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"the {role} refuses to start in production mode (SAGA_MODE=production):\n{lines}")


# ---- the pure decision -------------------------------------------------------------------------------


def development_key_ids(signing_keys: tuple[str, ...]) -> tuple[str, ...]:
    """Ids of the ``id:secret`` pairs whose secret is the development default, whatever id it is under:
    a verifying key is as good as a signing one to a forger."""
    found = []
    for pair in signing_keys:
        key_id, _, secret = pair.partition(":")
        if secret == DEVELOPMENT_SIGNING_SECRET:
            found.append(key_id)
    return tuple(found)


def _fsync_loss(appendfsync: str) -> str:
    if appendfsync == "everysec":
        return "up to ~1 s of acknowledged transitions"
    return "whatever the OS has not yet flushed (often tens of seconds) of acknowledged transitions"


def _production(facts: Facts) -> Verdict:
    refusals: list[str] = []
    warnings: list[str] = []
    if facts.role is Role.ORCHESTRATOR:
        if facts.aof_enabled is None:
            refusals.append(
                f"cannot tell whether Redis at {facts.redis} persists its writes ({facts.redis_error}): "
                "start Redis or fix SAGA_REDIS_URL; production mode does not start on a Redis it cannot check"
            )
        elif not facts.aof_enabled:
            refusals.append(
                f"Redis at {facts.redis} persists nothing (INFO persistence: aof_enabled:0), so a Redis "
                "restart loses every run: run it with --appendonly yes --appendfsync always (or "
                "'appendonly yes' in redis.conf), or set SAGA_MODE=development to accept the loss"
            )
        elif facts.appendfsync is not None and facts.appendfsync != "always":
            warnings.append(
                f"Redis at {facts.redis} has appendfsync {facts.appendfsync}: a power cut can lose "
                f"{_fsync_loss(facts.appendfsync)}, and those runs stall until reconciled; set "
                "appendfsync always to lose nothing acknowledged"
            )
    if facts.development_keys:
        refusals.append(
            f"signing key {', '.join(repr(k) for k in facts.development_keys)} is the development default, "
            "so anyone who can publish to the broker can forge messages: set SAGA_SIGNING_KEYS=id:secret "
            "with a secret of your own, the same on every orchestrator, worker and client"
        )
    refusals += _least_privilege(facts)
    return Verdict(tuple(refusals), tuple(warnings))


def _least_privilege(facts: Facts) -> list[str]:
    found = []
    if facts.default_redis_user:
        found.append(
            f"it connects to Redis at {facts.redis} as the default user, which may do anything (FLUSHALL, "
            "CONFIG, every key): run 'saga provision' and give this process its role's SAGA_REDIS_URL "
            f"(secrets/{facts.role.value}.env)"
        )
    if facts.amqp_guest:
        found.append(
            "it connects to RabbitMQ as guest, the broker's default user: run 'saga provision' and give "
            f"this process its role's SAGA_AMQP_URL (secrets/{facts.role.value}.env)"
        )
    if facts.unscoped_keys:
        found.append(
            "its signing keys come from SAGA_SIGNING_KEYS, unscoped: each may sign any message (a worker's "
            "could start or cancel runs): set SAGA_KEY_RING_FILE to a key ring of scoped keys ('saga keys "
            "add ID --scope ...')"
        )
    return found


def _development_losses(facts: Facts) -> list[str]:
    losses: list[str] = []
    if facts.role is Role.ORCHESTRATOR:
        if facts.aof_enabled is None:
            losses.append(
                f"every run on a Redis restart, if Redis at {facts.redis} persists nothing "
                f"(not checked: {facts.redis_error})"
            )
        elif not facts.aof_enabled:
            losses.append(
                f"every run on a Redis restart (Redis at {facts.redis} has no AOF; in-flight messages then "
                "name unknown runs and go to saga.rejected)"
            )
        elif facts.appendfsync is not None and facts.appendfsync != "always":
            losses.append(
                f"{_fsync_loss(facts.appendfsync)} on a power cut (appendfsync {facts.appendfsync})"
            )
    if facts.development_keys:
        losses.append(
            f"message authenticity (signing key {', '.join(repr(k) for k in facts.development_keys)} is the "
            "development default: anyone who can publish can forge messages)"
        )
    return losses


def _development(facts: Facts) -> Verdict:
    losses = _development_losses(facts)
    if not losses:
        warning = (
            "development mode (SAGA_MODE=development): the durability checks pass but are not enforced; "
            "set SAGA_MODE=production to enforce them"
        )
    else:
        warning = (
            f"development mode (SAGA_MODE=development): this {facts.role} can lose {'; '.join(losses)}. "
            "Set SAGA_MODE=production to refuse to start like this"
        )
    return Verdict((), (warning,))


def assess(facts: Facts) -> Verdict:
    """What to refuse and what to warn about, from the facts alone (no I/O)."""
    return _production(facts) if facts.mode == PRODUCTION else _development(facts)


# ---- gathering the facts ------------------------------------------------------------------------------


def redis_location(url: str) -> str:
    """``host:port/db`` of a Redis URL (``cluster host:port,...`` of a cluster's), for messages: never its
    password."""
    try:
        if is_cluster_url(url):
            return "cluster " + ",".join(f"{h}:{p}" for h, p in parse_cluster_url(url).nodes)
        parts = urlsplit(url)
        return f"{parts.hostname or '?'}:{parts.port or 6379}{parts.path or '/0'}"
    except (ValueError, BadRedisUrl):
        return "<unparseable SAGA_REDIS_URL>"


def _appendfsync(client: redis.Redis) -> str | None:
    # Managed Redis often disables CONFIG: then the fsync policy is simply unknown, never a refusal.
    # A cluster's is its weakest primary's (any that is not "always" loses what that one loses).
    try:
        values = config_of_every_primary(client, "appendfsync")
    except (redis.RedisError, OSError):
        return None
    if not values or any(not v for v in values):
        return None
    return next((str(v) for v in values if v != "always"), "always")


def _redis_facts(url: str) -> tuple[bool | None, str | None, str | None]:
    """(aof_enabled, appendfsync, error). Persistence is read with INFO, not CONFIG GET, which managed
    Redis services often disable. On a cluster every primary must have AOF on."""
    try:
        client = sync_client(
            url, socket_connect_timeout=REDIS_TIMEOUT_S, socket_timeout=REDIS_TIMEOUT_S, decode_responses=True
        )
    except (redis.RedisError, redis.exceptions.RedisClusterException, OSError, BadRedisUrl) as exc:
        return None, None, f"{type(exc).__name__}: {exc}"
    try:
        infos = info_of_every_primary(client, "persistence")
        aof_enabled = bool(infos) and all(int(info["aof_enabled"]) == 1 for info in infos)
        return aof_enabled, _appendfsync(client) if aof_enabled else None, None
    except (redis.RedisError, redis.exceptions.RedisClusterException, OSError, KeyError, ValueError) as exc:
        return None, None, f"{type(exc).__name__}: {exc}"
    finally:
        client.close()


def gather(settings: Settings, role: Role) -> Facts:
    """Ask Redis (only for the orchestrator: workers own no state) and read the signing keys."""
    found: tuple[bool | None, str | None, str | None] = (None, None, None)
    if role is Role.ORCHESTRATOR:
        found = _redis_facts(settings.redis_url)
    aof_enabled, appendfsync, error = found
    return Facts(
        mode=settings.mode,
        role=role,
        redis=redis_location(settings.redis_url),
        aof_enabled=aof_enabled,
        appendfsync=appendfsync,
        redis_error=error,
        development_keys=_development_keys(settings),
        default_redis_user=default_redis_user(settings.redis_url),
        amqp_guest=any(_amqp_user(url) in (None, "guest") for url in node_urls(settings.amqp_url)),
        unscoped_keys=settings.key_ring_file is None,
    )


def default_redis_user(url: str) -> bool:
    """Whether ``url`` connects as Redis's default user (it names none, or names it)."""
    try:
        user = parse_cluster_url(url).username if is_cluster_url(url) else urlsplit(url).username
    except (ValueError, BadRedisUrl):
        return False  # refused elsewhere, with its own error
    return not user or user == "default"


def _amqp_user(url: str) -> str | None:
    """The user ``url`` names (None: none, so the client's default, guest)."""
    try:
        return unquote(urlsplit(url).username or "") or None
    except ValueError:
        return None


def _development_keys(settings: Settings) -> tuple[str, ...]:
    """Ids of the keys this process holds whose secret is the development default: of its key ring if it
    has one (a ring that cannot be read raises KeyRingError, which stops the process), else of
    SAGA_SIGNING_KEYS."""
    if settings.key_ring_file is None:
        return development_key_ids(settings.signing_keys)
    ring = load_ring(Path(settings.key_ring_file), settings.key_retire_grace_ms)
    default = DEVELOPMENT_SIGNING_SECRET.encode()
    return tuple(k.key_id for k in ring.held() if k.secret == default)


def check_startup(settings: Settings, role: Role) -> Verdict:
    """Gather, assess, log the warnings; raise :class:`DurabilityRefused` when production says no."""
    verdict = assess(gather(settings, role))
    if verdict.refusals:
        raise DurabilityRefused(role, verdict.refusals)
    for warning in verdict.warnings:
        log.warning("%s", warning)
    return verdict

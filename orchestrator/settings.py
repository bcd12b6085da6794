"""Settings, read once at the edge (CLI, process start) from ``SAGA_*`` environment variables and passed
down. Nothing else reads the environment."""

from __future__ import annotations

from typing import Annotated, Literal

import redis.asyncio as aioredis
from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from orchestrator.bus.batch import DEFAULT_PACK_TASKS, MAX_PACKED_TASKS
from orchestrator.bus.names import NAMESPACE_PATTERN, Names
from orchestrator.compiler.limits import AdmissionLimits
from orchestrator.dsl.expressions import ExpressionLimits
from orchestrator.dsl.yaml_source import YamlLimits
from orchestrator.loops import EventLoopChoice
from orchestrator.shard.admission import TenantLimit
from orchestrator.wire.freshness import Freshness
from orchestrator.wire.sizes import DEFAULT_BAG_WINDOW, Limits

DEFAULT_CONTRACT_MODULES = ("workers.demo",)
#: The signing key every fresh checkout shares: fine on a laptop, a forgery licence anywhere else, so
#: production mode refuses to start with it (orchestrator/durability.py).
DEVELOPMENT_SIGNING_SECRET = "saga-development-signing-key"
DEVELOPMENT_SIGNING_KEY = f"dev:{DEVELOPMENT_SIGNING_SECRET}"


def _split(value: object) -> object:
    return tuple(p.strip() for p in value.split(",") if p.strip()) if isinstance(value, str) else value


def _default_actor() -> str:
    import getpass
    import socket

    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a bare container)
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


class Settings(BaseSettings):
    """Every knob, with the ``SAGA_`` prefix: ``SAGA_MAX_FORK_BRANCHES=64``, ``SAGA_CONTRACTS=a.b,c.d``."""

    model_config = SettingsConfigDict(env_prefix="SAGA_", extra="ignore")

    contracts: Annotated[tuple[str, ...], NoDecode] = Field(
        DEFAULT_CONTRACT_MODULES, description="modules whose @action/@worker handlers form the registry"
    )
    shard_classes: Annotated[tuple[str, ...], NoDecode] = ("fast", "slow")
    max_stages: int = 200
    max_fork_branches: int = 32
    max_map_items: int = 10_000
    max_attempts: int = 10
    max_stage_deadline_ms: int = 86_400_000
    max_run_deadline_ms: int = 30 * 86_400_000
    max_input_bytes: int = 65_536
    max_expression_chars: int = 1_000
    max_expression_depth: int = 16
    max_definition_bytes: int = 1_048_576

    # ---- runtime -----------------------------------------------------------------------------------
    mode: Literal["development", "production"] = Field(
        "development",
        description="production: the orchestrator and workers refuse to start on settings that can lose "
        "runs or admit forged messages (Redis without AOF, the development signing key)",
    )
    amqp_url: str = "amqp://guest:guest@127.0.0.1:5672/"
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_timeout_s: float = Field(
        5.0,
        gt=0,
        description="a Redis connect or reply slower than this counts as Redis being down (the "
        "orchestrator stops consuming until it answers again) instead of a wait that never ends",
    )
    namespace: str = Field(
        "saga",
        pattern=NAMESPACE_PATTERN,
        description="the environment: prefixes every exchange and queue name (and, unless SAGA_KEY_PREFIX "
        "is set, every Redis key), so environments sharing a broker and a Redis never meet",
    )
    key_prefix: str = Field("", description="prefix of every Redis key; empty: the namespace")
    shard_count: int = Field(4, ge=1, le=256, description="shard queues per shard class")
    shard_prefetch: int = Field(64, ge=1, le=1000, description="unacked deliveries per shard consumer")
    delivery_limit: int = Field(20, ge=2, description="x-delivery-limit of shard queues")
    quorum_group_size: int | None = Field(
        None,
        ge=1,
        description="replicas of every quorum queue (x-quorum-initial-group-size); unset: the broker's "
        "default, 3 on RabbitMQ 3.10 or every node of a smaller cluster. Set it before a namespace's "
        "queues are first declared: RabbitMQ refuses to redeclare a queue with another value",
    )
    amqp_heartbeat_s: int = Field(5, ge=1, description="short, so a standby takes over in seconds")
    signing_keys: Annotated[tuple[str, ...], NoDecode] = Field(
        (DEVELOPMENT_SIGNING_KEY,),
        description="id:secret pairs, comma-separated; the first signs, all verify (rotation)",
    )
    key_ring_file: str | None = Field(
        None,
        description="a key ring file (saga keys): scoped keys, their states and where their secrets are; "
        "set, it replaces SAGA_SIGNING_KEYS, and running processes reload it when it changes or on SIGHUP",
    )
    tenant_limits: dict[str, TenantLimit] = Field(
        default_factory=dict,
        description='per tenant, JSON: {"acme": {"max_runs": 500, "starts_per_s": 50}, "*": {...}} ("*": '
        "every tenant not named); each shard admits its share of a start's tenant's limits, and refuses "
        "a start over them at once",
    )
    encrypt_sensitive: bool = Field(
        False,
        description="keep sensitive values (marked in contracts and context schemas) encrypted in Redis "
        "with the key ring's data key, which orchestrators (and whatever shows runs) then need",
    )
    platform_tenant: str = Field(
        "default",
        description="the tenant that runs the platform: its tokens (and keys that are not a client's) see "
        "and act on every tenant's runs and dead letters; every other tenant's only on its own",
    )
    key_retire_grace_ms: int = Field(
        3_600_000,
        ge=0,
        description="how long a retired key still verifies, so that what it signed and is still in flight "
        "is taken: at least the longest a message waits in a queue (a result held through an outage)",
    )
    max_message_bytes: int = Field(
        1_048_576,
        ge=16_384,
        description="no process reads a larger message, so no transition sends one (a task's body may "
        "take this less 2,048 bytes for its envelope); the same on every process",
    )
    max_transition_bytes: int = Field(
        64 * 1_048_576,
        ge=1_048_576,
        description="what one transition may send or write in all (a bag's item tasks, a bag's results): it "
        "travels to Redis as one call",
    )
    bag_window: int = Field(
        DEFAULT_BAG_WINDOW,
        ge=2,
        le=100_000,
        description="a map stage sends at most this many item tasks at once, the next chunk as half of them "
        "have arrived; the same on every orchestrator",
    )
    batch_results: bool = Field(
        True,
        description="a worker sends the results (and acceptances, heartbeats) it finished in one event-loop "
        "turn for one shard in one message, each still signed and acked on its own; false: each alone. "
        "Orchestrators older than this release refuse such messages: upgrade them first",
    )
    pack_tasks: int = Field(
        DEFAULT_PACK_TASKS,
        ge=1,
        le=MAX_PACKED_TASKS,
        description="an orchestrator packs up to this many tasks for one contract queue, of those it sends "
        "at once, into one message (each still signed, run and reported on its own); 1: each alone. Upgrade "
        "the workers before the orchestrators: older ones cannot read such messages, or hold them too long",
    )
    serial_lease_ms: int = Field(
        15_000,
        ge=1_000,
        description="how long the serial lane stays held by a worker that stopped renewing it (crashed, or "
        "lost Redis); renewed every third of it while a serial handler runs",
    )
    retention_ms: int = Field(7 * 86_400_000, ge=1000, description="how long finished runs are kept")
    message_window_ms: int | None = Field(
        None,
        ge=1000,
        description="a start, result, release, refill, cancel or re-drive issued longer ago than this is "
        "refused by the shard (parked on saga.rejected as stale): a replay must not outlive the run records "
        "that deduplicate it, so this plus SAGA_CLOCK_SKEW_MS must stay below SAGA_RETENTION_MS. Also how "
        "long such a message may wait in a shard queue while orchestrators or Redis are down. Unset: the "
        "smaller of 24 hours and half SAGA_RETENTION_MS",
    )
    liveness_window_ms: int = Field(
        300_000,
        ge=1000,
        description="an acceptance or heartbeat issued longer ago than this is refused as stale",
    )
    clock_skew_ms: int = Field(
        30_000,
        ge=0,
        description="how far ahead of an orchestrator's clock a sender's may run: a message issued further "
        "in the future is refused as future-dated",
    )
    # ---- governance -------------------------------------------------------------------------------
    actor: str = Field(
        default_factory=_default_actor,
        min_length=1,
        max_length=200,
        description="who the definition lifecycle commands act as, in every audit record; default: the "
        "operating-system user at this host",
    )
    require_separate_approver: bool | None = Field(
        None,
        description="refuse an approval by the actor who published the version (and 'publish "
        "--activate'); unset: on in production mode, off in development",
    )
    allowlist_file: str | None = Field(
        None,
        description="YAML file of per-namespace allowlists: a definition-name prefix -> the contracts and "
        "queues its definitions may use, checked at compile time",
    )
    # ---- operations -------------------------------------------------------------------------------
    log_format: Literal["text", "json"] | None = Field(
        None,
        description="text: one readable line per record; json: one JSON object per line with time, level, "
        "logger, message and the ids in scope (run, stage, attempt, shard, message id); unset: text",
    )
    server_url: str | None = Field(
        None, description="the control-plane server the CLI goes through (saga --server URL); unset: direct"
    )
    token: str | None = Field(None, description="the bearer token the CLI presents to SAGA_SERVER_URL")
    event_loop: EventLoopChoice = Field(
        "auto",
        description="the event loop orchestrator and worker processes run on: auto (uvloop where it is "
        "installed, else asyncio's own), uvloop (refuse to start without it) or asyncio",
    )
    trace_dir: str | None = Field(
        None,
        description="for the bench's latency breakdown: each process appends timestamps of every message "
        "hop and processing step to a file of its own in this folder (orchestrator/trace.py); unset: off",
    )
    crash_points: Annotated[tuple[str, ...], NoDecode] = Field(
        (), description="fault injection for tests only: kill -9 this process at these named points"
    )

    @field_validator("contracts", "shard_classes", "signing_keys", "crash_points", mode="before")
    @classmethod
    def _comma_separated(cls, value: object) -> object:
        return _split(value)

    @field_validator("amqp_url")
    @classmethod
    def _names_nodes(cls, value: str) -> str:
        from orchestrator.bus.connect import node_urls

        node_urls(value)  # a ValueError here says what is wrong with it, password hidden
        return value

    @field_validator("crash_points")
    @classmethod
    def _known_crash_points(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        from orchestrator.faults import CRASH_POINTS, unknown_points

        unknown = unknown_points(value)
        if unknown:
            raise ValueError(
                f"unknown crash point(s) {', '.join(unknown)}; known: {', '.join(sorted(CRASH_POINTS))}"
            )
        return value

    @field_validator("contracts", "shard_classes", "signing_keys")
    @classmethod
    def _not_empty(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise ValueError("must name at least one entry (comma-separated)")
        return value

    @model_validator(mode="after")
    def _key_prefix_defaults_to_namespace(self) -> Settings:
        if not self.key_prefix:
            self.key_prefix = self.namespace
        return self

    @field_validator("clock_skew_ms")
    @classmethod
    def _window_ends_before_records_expire(cls, skew: int, info: ValidationInfo) -> int:
        # on the last of the three fields, so that an error names it and shows only its value
        retention, liveness = info.data.get("retention_ms"), info.data.get("liveness_window_ms")
        if retention is not None and liveness is not None:
            windows = Freshness.for_retention(retention, info.data.get("message_window_ms"), liveness, skew)
            problem = windows.check_against(retention)
            if problem is not None:
                raise ValueError(problem)
        return skew

    def freshness(self) -> Freshness:
        """How old a message a shard takes may be, by kind."""
        return Freshness.for_retention(
            self.retention_ms, self.message_window_ms, self.liveness_window_ms, self.clock_skew_ms
        )

    @property
    def separate_approver_required(self) -> bool:
        """Whether an approval must come from someone other than the publisher."""
        if self.require_separate_approver is None:
            return self.mode == "production"
        return self.require_separate_approver

    def names(self) -> Names:
        """The broker names of this environment."""
        return Names(self.namespace)

    def limits(self) -> Limits:
        """The message limits every process applies alike."""
        return Limits(self.max_message_bytes, self.max_transition_bytes, self.bag_window)

    def admission_limits(self) -> AdmissionLimits:
        return AdmissionLimits(
            max_stages=self.max_stages,
            max_fork_branches=self.max_fork_branches,
            max_map_items=self.max_map_items,
            max_attempts=self.max_attempts,
            max_stage_deadline_ms=self.max_stage_deadline_ms,
            max_run_deadline_ms=self.max_run_deadline_ms,
            max_input_bytes=self.max_input_bytes,
            shard_classes=self.shard_classes,
            expressions=ExpressionLimits(
                max_chars=self.max_expression_chars, max_depth=self.max_expression_depth
            ),
            yaml=YamlLimits(max_bytes=self.max_definition_bytes),
        )


def redis_client(settings: Settings, *, per_reply_timeout: bool = True) -> aioredis.Redis:
    """The async Redis client saga processes use. Without a timeout a connection whose peer vanished
    without a reset (a partition that drops connection state, an idle-timeout NAT, a hung server) blocks
    its await forever. Clients get a per-reply socket timeout; the orchestrator, whose every transition
    would pay for it, passes ``per_reply_timeout=False`` and bounds each of its Redis steps instead
    (``ShardOptions.redis_timeout_s``). A ``redis+cluster://`` URL gives a cluster client
    (``orchestrator/store/connect.py``)."""
    from orchestrator.store.connect import async_client

    return async_client(
        settings.redis_url,
        decode_responses=True,
        socket_timeout=settings.redis_timeout_s if per_reply_timeout else None,
        socket_connect_timeout=settings.redis_timeout_s,
        socket_keepalive=True,
    )

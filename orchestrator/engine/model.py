"""The engine's vocabulary: run and stage states, the events it consumes, the snapshot it reads and the
decision it returns. Plain frozen values; nothing here does I/O."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class RunStatus(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    FINALISING = "finalising"
    COMPLETED = "completed"
    FAILED = "failed"


TERMINAL_RUN_STATUSES = frozenset({RunStatus.COMPLETED, RunStatus.FAILED})


class StageStatus(StrEnum):
    """The seed's stage states."""

    DISPATCHED = "queued"
    RUNNING = "running"
    RETRY_SCHEDULED = "retry-scheduled"
    COMPLETED = "completed"
    FAILED = "failed"
    TIMED_OUT = "timed-out"
    CANCELLED = "cancelled"
    SKIPPED = "skipped"


ACTIVE_STAGE_STATUSES = frozenset({StageStatus.DISPATCHED, StageStatus.RUNNING})


class Intent(StrEnum):
    COMPLETED = "completed"
    FAILED = "failed"


class Verdict(StrEnum):
    """What became of an event. Only ``APPLIED`` changes the run; the others are recorded."""

    APPLIED = "applied"
    DUPLICATE = "duplicate"
    STALE = "stale"
    LATE = "late"
    INVALID = "invalid"


# ---- events ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StartRun:
    message_id: str
    run_id: str
    shard: str
    context: Mapping[str, Any]
    tenant: str = "default"


@dataclass(frozen=True)
class StageResult:
    """A worker's report for one attempt of a stage (one item of it, for a map stage)."""

    message_id: str
    stage: str
    attempt: int
    fence: str
    ok: bool
    result: Any = None
    error: str | None = None
    item: int | None = None
    digest: str = ""  # the plan the dispatch named; a mismatch is refused


@dataclass(frozen=True)
class BarrierReleased:
    """The continuation a join or map barrier emits, exactly once, when its last arrival lands."""

    message_id: str
    stage: str
    fence: str


@dataclass(frozen=True)
class FinaliserResult:
    message_id: str
    index: int
    fence: str
    ok: bool
    result: Any = None
    error: str | None = None
    digest: str = ""


Event = StartRun | StageResult | BarrierReleased | FinaliserResult


# ---- snapshot --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StageRecord:
    status: StageStatus
    attempt: int
    fence: str
    result: Any = None
    error: str | None = None
    items: int | None = None  # a map stage: how many items it dispatched


@dataclass(frozen=True)
class RunSnapshot:
    """What the engine reads of a run: the run record and the stage records it needs."""

    run_id: str
    shard: str
    digest: str
    status: RunStatus
    context: Mapping[str, Any]
    intent: Intent | None = None
    reason: str | None = None
    epoch: int = 1
    finaliser_index: int = 0
    finaliser_failed: bool = False
    tenant: str = "default"
    output: Any = None
    stages: Mapping[str, StageRecord] = field(default_factory=dict)
    map_results: Mapping[str, list[Any]] = field(default_factory=dict)


# ---- decision --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Key:
    """A logical key of one run: ``run``, ``stage`` (with its name), ``barrier`` (join or map)."""

    kind: str
    name: str = ""


RUN = Key("run")


@dataclass(frozen=True)
class Expect:
    """A precondition: ``key.field`` equals ``value`` (``None``: the field is absent)."""

    key: Key
    field: str
    value: str | None


@dataclass(frozen=True)
class Write:
    key: Key
    fields: Mapping[str, str]


@dataclass(frozen=True)
class Outgoing:
    """A message the transition causes, appended to the shard outbox in the same atomic call.

    ``route`` is logical: ``("task", queue)``, ``("shard", shard)``, ``("events", routing_key)``.
    """

    message_id: str
    kind: str
    route: tuple[str, str]
    body: Mapping[str, Any]


@dataclass(frozen=True)
class BarrierInit:
    key: Key
    count: int


@dataclass(frozen=True)
class Arrival:
    """A branch or item arriving at a barrier: counted once per distinct member; the last arrival
    appends ``release`` to the outbox. ``result`` (items only) is stored under the member."""

    key: Key
    member: str
    release: Outgoing
    result: str | None = None


@dataclass(frozen=True)
class HistoryEntry:
    kind: str
    stage: str | None = None
    attempt: int | None = None
    detail: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    history: tuple[HistoryEntry, ...] = ()
    expects: tuple[Expect, ...] = ()
    writes: tuple[Write, ...] = ()
    barriers: tuple[BarrierInit, ...] = ()
    arrival: Arrival | None = None
    outgoing: tuple[Outgoing, ...] = ()
    absent: tuple[tuple[Key, str], ...] = ()  # barrier members that must not exist (else: duplicate)
    create: bool = False  # the transition creates the run (fails if it exists)
    finished: bool = False  # the run reached a terminal status: start its retention clock

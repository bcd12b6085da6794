"""The engine's vocabulary: run and stage states, the events it consumes, the snapshot it reads and the
decision it returns. Plain frozen values; nothing here does I/O."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import Any, TypeVar

from orchestrator.wire.outgoing import Outgoing

_Frozen = TypeVar("_Frozen")


def evolve(value: _Frozen, **changes: Any) -> _Frozen:
    """``dataclasses.replace`` for this module's frozen values, at a fraction of its cost: a copy of
    ``value``'s fields with ``changes`` over them, without calling ``__init__`` again (these classes do
    nothing in it beyond storing the fields). Every transition copies a snapshot and a decision this way,
    where ``replace`` cost several microseconds for each. An unknown field name raises, as ``replace``
    does."""
    cls: type = type(value)
    unknown = changes.keys() - _field_names(cls)
    if unknown:
        raise TypeError(f"{cls.__name__} has no field {', '.join(sorted(unknown))}")
    copied: _Frozen = object.__new__(cls)
    copied.__dict__.update(value.__dict__)
    copied.__dict__.update(changes)
    return copied


@functools.cache
def _field_names(cls: type) -> frozenset[str]:
    return frozenset(f.name for f in fields(cls))


class RunStatus(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    FINALISING = "finalising"
    COMPLETED = "completed"
    FAILED = "failed"


TERMINAL_RUN_STATUSES = frozenset({RunStatus.COMPLETED, RunStatus.FAILED})


class StageStatus(StrEnum):
    """A stage's state. ``dispatched``: its task is on its queue, or held by a worker that has not reported
    acceptance (workers report it only for stages with a queue, execution or heartbeat clock); ``running``:
    a worker reported acceptance (a join: its fork released the branches it waits for)."""

    DISPATCHED = "dispatched"
    RUNNING = "running"
    RETRY_SCHEDULED = "retry-scheduled"
    COMPLETED = "completed"
    FAILED = "failed"
    TIMED_OUT = "timed-out"
    CANCELLED = "cancelled"
    SKIPPED = "skipped"
    COMPENSATED = "compensated"  # completed, then undone by its compensation after the run failed


ACTIVE_STAGE_STATUSES = frozenset({StageStatus.DISPATCHED, StageStatus.RUNNING})
# An attempt the orchestrator gave up on (its run failed, or it timed out): a worker's report about it is
# late, or acknowledges the cancellation.
FENCED_OFF = frozenset({StageStatus.CANCELLED, StageStatus.TIMED_OUT})


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
    # the tool versions stored beside the plan the run pins (dsl, compiler, engine): kept in the run record
    versions: Mapping[str, str] = field(default_factory=dict)
    requested_by: str = ""  # the token a server started it for: named in the run's history


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
    retryable: bool = True  # the worker's verdict on a failure: may another attempt succeed?
    cancelled: bool = False  # the handler stopped because cancellation was requested
    contract: str = ""  # the contract the report names (name@version); one its task was not for is refused


@dataclass(frozen=True)
class StageAccepted:
    """A worker took the attempt off its queue and started it (sent only for stages with deadlines):
    stops the queue clock, starts the execution and heartbeat clocks."""

    message_id: str
    stage: str
    attempt: int
    fence: str
    digest: str = ""
    contract: str = ""  # the contract the report names (name@version); one its task was not for is refused


@dataclass(frozen=True)
class StageHeartbeat:
    """The attempt's handler is still alive: pushes its heartbeat deadline forward. Not in history."""

    message_id: str
    stage: str
    attempt: int
    fence: str
    digest: str = ""
    issued_at_ms: int | None = None  # when its worker sent it (None: a beat with no time, always taken)
    contract: str = ""  # the contract the report names (name@version); one its task was not for is refused


class Clock(StrEnum):
    """The timers a run can have (seed 000's three clocks, plus the retry backoff)."""

    QUEUE = "queue"  # dispatched, not accepted in time
    EXECUTION = "execution"  # accepted, no result in time
    HEARTBEAT = "heartbeat"  # accepted, no heartbeat in time
    RETRY = "retry"  # the backoff before the next attempt
    RUN = "run"  # the whole run's deadline


@dataclass(frozen=True)
class TimerFired:
    """A durable timer came due. ``stage`` is empty for the run deadline; ``fence`` is the attempt's (or
    the run epoch's) fence the timer was set for, so a timer of an older attempt is stale."""

    message_id: str
    clock: Clock
    stage: str
    fence: str
    member: str  # the timer's member in the shard's timer set, claimed by the transition


@dataclass(frozen=True)
class CancelRun:
    """An operator or service asked to cancel the run (``saga cancel``)."""

    message_id: str
    reason: str = ""
    requested_by: str = ""


@dataclass(frozen=True)
class BarrierReleased:
    """The continuation a join or map barrier emits, exactly once, when its last arrival lands."""

    message_id: str
    stage: str
    fence: str


@dataclass(frozen=True)
class BagRefill:
    """The continuation a bag sending its items in chunks emits when enough of them arrived: send the
    items from ``sent`` on (the next chunk)."""

    message_id: str
    stage: str
    fence: str
    sent: int


@dataclass(frozen=True)
class FinaliserResult:
    message_id: str
    index: int
    fence: str
    ok: bool
    result: Any = None
    error: str | None = None
    digest: str = ""
    contract: str = ""  # the contract the report names (name@version); one its task was not for is refused


@dataclass(frozen=True)
class CompensationResult:
    """A worker's report on one compensation (``index`` in the run's compensation order)."""

    message_id: str
    stage: str  # the compensated stage
    index: int
    fence: str
    ok: bool
    error: str | None = None
    digest: str = ""
    result: Any = None  # checked against the compensation contract's output schema, then dropped
    contract: str = ""  # the contract the report names (name@version); one its task was not for is refused


@dataclass(frozen=True)
class Redrive:
    """Resume a failed run on its pinned plan in a new epoch (``saga redrive``). ``undo_lost``: the
    operator says the compensation a poison message left in flight will never report (it was the poison
    message, or its task is lost): its stage is taken as undone, and runs again."""

    message_id: str
    reason: str = ""
    requested_by: str = ""
    undo_lost: bool = False


@dataclass(frozen=True)
class Nudge:
    """The reconciler found the run stranded (no unsent message, no timer, quiet for long): re-send what
    it is waiting for. Re-sent tasks keep their ids, so a task that was only slow is a duplicate."""

    message_id: str


Event = (
    StartRun
    | StageResult
    | BarrierReleased
    | BagRefill
    | FinaliserResult
    | StageAccepted
    | StageHeartbeat
    | TimerFired
    | CancelRun
    | CompensationResult
    | Nudge
    | Redrive
)


# ---- snapshot --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StageRecord:
    status: StageStatus
    attempt: int
    fence: str
    result: Any = None
    error: str | None = None
    items: int | None = None  # a map stage: how many items it has
    # a map stage sending its items in chunks: how many it has sent (the rest come with refills), and
    # its window (kept with it, so that every process refills it alike); None: it sent them all at once
    sent: int | None = None
    window: int | None = None
    completed_at: int | None = None  # stages with a compensation: when it completed (the undo order)
    # when the latest heartbeat applied was sent, "<fence>|<issued_at_ms>": a copy of it, or a beat sent
    # before it, moves nothing (heartbeats are not remembered in the applied set: an attempt beats often)
    beat: str | None = None


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
    compensations: tuple[str, ...] = ()  # stages to undo, in the order they are undone
    compensation_index: int = 0
    compensation_failed: bool = False
    phase: str = ""  # while finalising: "compensating", then "finalising"
    item_attempts: Mapping[str, int] = field(default_factory=dict)  # "<map>:<item>" -> attempt, once retried
    tenant: str = "default"
    output: Any = None
    stages: Mapping[str, StageRecord] = field(default_factory=dict)
    map_results: Mapping[str, list[Any]] = field(default_factory=dict)
    barriers: Mapping[str, int] = field(default_factory=dict)  # join or map -> arrivals it still waits for
    # join or map -> the members that arrived; read only for a nudge (re-sending a bag's missing items)
    arrivals: Mapping[str, frozenset[str]] = field(default_factory=dict)


# ---- decision --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Key:
    """A logical key of one run: ``run``, ``stage`` (with its name), ``barrier`` (join or map: its members),
    ``counter`` (a barrier's count of arrivals still awaited), ``item`` (``<map>:<item>``: a map item that
    was retried)."""

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
class BarrierInit:
    """A barrier (re)opened: its members cleared, then ``members`` (branches that arrived in the opening
    transition itself) added, and its counter set to the ``count`` still awaited."""

    key: Key
    count: int
    members: tuple[str, ...] = ()


@dataclass(frozen=True)
class Arrival:
    """A branch or item arriving at a barrier: counted once per distinct member; the last arrival
    appends ``release`` to the outbox (None: the transition releases the barrier itself, and expects
    the count it takes to 0). ``result`` (items only) is stored under the member.
    ``refill``: a bag still to send items, whose arrival that is the ``at``-th appends its refill."""

    key: Key
    member: str
    release: Outgoing | None
    result: str | None = None
    refill: Refill | None = None

    def continuations(self, remaining: int) -> list[Outgoing]:
        """What the store appended to the outbox with this arrival, which left ``remaining`` members to
        come: the release after the last one, a bag's refill after its ``at``-th."""
        sent = [self.release] if remaining == 0 and self.release is not None else []
        if self.refill is not None and self.refill.items - remaining == self.refill.at:
            sent.append(self.refill.message)
        return sent


@dataclass(frozen=True)
class Refill:
    """A bag's next chunk: ``message`` (a ``bag.refill`` to its own shard) goes out with the arrival
    that makes ``at`` of its ``items`` arrived, which happens exactly once (the count moves once per
    distinct item)."""

    at: int
    items: int
    message: Outgoing


@dataclass(frozen=True)
class Timer:
    """A durable timer in the shard's sorted set: ``member`` names it, ``due_ms`` is its score."""

    member: str
    due_ms: int


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
    timers: tuple[Timer, ...] = ()  # set (or moved) in the same atomic call
    untimers: tuple[str, ...] = ()  # timer members removed in the same atomic call
    claim: str | None = None  # a fired timer: the member must still be there and due, else no effect
    # add the message id to the run's applied set: only for an applied message that is not a heartbeat or
    # a timer (a refused message may carry the id of a genuine report still to come)
    remember: bool = True
    removes: tuple[tuple[Key, str], ...] = ()  # fields deleted (before the writes)
    persist: bool = False  # the run lives again (a re-drive): cancel the retention clock of its keys

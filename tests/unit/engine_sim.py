"""A small, pure simulator of one run: the engine, the in-memory store and the demo handlers, no broker.

It drives a run the way the shard service does (``orchestrator/shard/processor.py``): read a snapshot, let
the engine decide, apply the decision atomically, retry on CONFLICT, and publish what the transition caused
(the decision's messages, plus a barrier's release only when this arrival took the counter to 0). Published
messages are kept as a list of pending deliveries:

* a ``task`` goes to a "worker": the demo handler for its contract is called directly and its outcome
  becomes a pending ``StageResult`` (or ``FinaliserResult``) for the shard;
* a ``barrier.released`` becomes a pending ``BarrierReleased`` for the shard, a ``bag.refill`` a
  pending ``BagRefill``;
* ``cancel`` and ``run.finished`` leave the system (kept in ``cancels`` and ``finished``);
* a task of a stage with deadlines is also accepted: its ``StageAccepted`` becomes pending before its
  result;
* durable timers wait in the store's timer set; :meth:`Sim.fire_next_timer` moves the clock to the
  earliest and fires it (``run`` does when nothing else is pending, tests may do it at any time: a
  timeout racing the result).

Tests pick which pending delivery happens next (FIFO, by predicate, or at random), deliver one again (a
duplicate), or inject an event of their own (a stale result). Every event the shard handled is logged with
its clock value, so the same sequence can be replayed against a fresh store (:func:`replay`).
"""

from __future__ import annotations

import inspect
import json
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import workers.demo
from orchestrator.engine import advance, clocks
from orchestrator.engine.model import (
    BagRefill,
    BarrierReleased,
    CompensationResult,
    Decision,
    Event,
    FinaliserResult,
    Nudge,
    RunSnapshot,
    StageAccepted,
    StageHeartbeat,
    StageResult,
    StartRun,
    TimerFired,
    Verdict,
)
from orchestrator.engine.plan import Plan, typed_plan
from orchestrator.store.memory import MemoryStore
from orchestrator.store.replies import APPLIED, CONFLICT
from orchestrator.wire import bodies, ids
from orchestrator.wire.outgoing import Outgoing
from orchestrator.wire.sizes import DEFAULT_LIMITS, Limits
from workers.sdk import Handler, handlers_of

HANDLERS: dict[str, Handler] = {h.contract.ref: h for h in handlers_of(workers.demo)}
MAX_CONFLICT_RETRIES = 8  # as processor.py
SHARD = "fast.0"


class InjectedFailure(RuntimeError):
    """What a handler raises when the test asked it to fail."""


@dataclass(frozen=True)
class Delivery:
    """One pending delivery: a task for a worker, or an event for the shard."""

    kind: str  # "task" | "event"
    task: Outgoing | None = None
    event: Event | None = None

    @property
    def stage(self) -> str | None:
        if self.task is not None:
            return str(self.task.body["stage"])
        return getattr(self.event, "stage", None)

    @property
    def item(self) -> int | None:
        if self.task is not None:
            return self.task.body["item"]  # type: ignore[no-any-return]
        return getattr(self.event, "item", None)

    def __repr__(self) -> str:
        if self.task is not None:
            return f"task({self.stage}, item={self.item})"
        return f"{type(self.event).__name__}({self.stage}, {getattr(self.event, 'fence', '')})"


@dataclass(frozen=True)
class Handled:
    """What became of one event: the engine's decision, the store's answer and what was published."""

    event: Event
    decision: Decision
    code: int | None  # None: not applied at all (no run and nothing to create)
    detail: str
    published: tuple[Outgoing, ...]
    conflicts: int = 0

    @property
    def verdict(self) -> Verdict:
        return self.decision.verdict

    @property
    def took_effect(self) -> bool:
        return self.decision.verdict is Verdict.APPLIED and self.code == APPLIED


def report(
    run_id: str,
    stage: str,
    fence: str,
    ok: bool,
    result: Any = None,
    error: str | None = None,
    *,
    attempt: int = 1,
    item: int | None = None,
    digest: str = "",
    **flags: bool,
) -> StageResult:
    """A worker's report on the task (``stage``, ``fence``, ``item``, ``attempt``), under the id a worker
    derives from that task's id (the engine refuses a report whose id answers another task)."""
    message_id = ids.result_id(ids.stage_task_id(run_id, stage, fence, item, attempt))
    return StageResult(message_id, stage, attempt, fence, ok, result, error, item, digest, **flags)


def heartbeat(
    run_id: str, stage: str, fence: str, beat: int = 1, issued_at_ms: int | None = None
) -> StageHeartbeat:
    """The attempt's ``beat``-th heartbeat, under the id a worker gives it, sent at ``issued_at_ms``."""
    return StageHeartbeat(
        ids.heartbeat_id(run_id, stage, fence, beat), stage, 1, fence, issued_at_ms=issued_at_ms
    )


def to_publish(decision: Decision, code: int | None, detail: str) -> list[Outgoing]:
    """What the shard publishes after a transition (mirrors ``processor._to_publish``)."""
    if code != APPLIED:
        return []
    messages = list(decision.outgoing)
    if decision.arrival is not None:
        messages += decision.arrival.continuations(int(detail))
    return messages


_TYPED: dict[int, tuple[Mapping[str, Any], Plan]] = {}


def typed(plan: Plan | Mapping[str, Any]) -> Plan:
    """The typed plan of a compiled plan's mapping, built once per mapping (kept alive with it, so its
    id is not reused); a typed plan as it is."""
    if isinstance(plan, Plan):
        return plan
    kept = _TYPED.get(id(plan))
    if kept is None or kept[0] is not plan:
        kept = _TYPED[id(plan)] = (plan, typed_plan(plan))
    return kept[1]


def apply_event(
    store: MemoryStore,
    plan: Plan | Mapping[str, Any],
    digest: str,
    run_id: str,
    event: Event,
    now_ms: int,
    limits: Limits = DEFAULT_LIMITS,
) -> Handled:
    """One delivery through engine and store, as the shard's processor does it."""
    plan = typed(plan)
    barriers = list(plan.barriers)
    conflicts = 0
    for _ in range(MAX_CONFLICT_RETRIES):
        snapshot = store.snapshot(run_id, with_members=isinstance(event, Nudge))
        decision = advance(plan, snapshot.digest if snapshot else digest, snapshot, event, now_ms, limits)
        if snapshot is None and not decision.create:
            return Handled(event, decision, None, "", ())
        code, detail = store.apply(run_id, event.message_id, decision, barriers, now_ms)
        if code == CONFLICT:
            conflicts += 1
            continue
        return Handled(event, decision, code, detail, tuple(to_publish(decision, code, detail)), conflicts)
    raise AssertionError(f"{MAX_CONFLICT_RETRIES} conflicts in a row for {event}")


@dataclass(frozen=True)
class Poisoned:
    """A logged step that is no event of the engine: a poison message marked the run failed
    (lua/poison.lua, bypassing the engine), with its work possibly still in flight."""

    message_id: str
    error: str


def replay(
    plan: Plan | Mapping[str, Any], digest: str, run_id: str, log: list[tuple[Event | Poisoned, int]]
) -> tuple[MemoryStore, list[Handled]]:
    """Apply a logged event sequence to a fresh store (outbox entries are left unsent)."""
    store = MemoryStore()
    handled = []
    for event, now in log:
        if isinstance(event, Poisoned):
            store.poison(run_id, event.message_id, event.error, now)
        else:
            handled.append(apply_event(store, plan, digest, run_id, event, now))
    return store, handled


def handler_output(contract: str, payload: Any) -> Any:
    """Call the demo handler for ``contract`` directly, validating input and output like the runtime."""
    handler = HANDLERS[contract]
    model = handler.input_model.model_validate(payload)
    output = _settle(handler.function(model))
    checked = (
        output if isinstance(output, handler.output_model) else handler.output_model.model_validate(output)
    )
    return checked.model_dump(mode="json")


def _settle(value: Any) -> Any:
    """The value of a handler call; an async handler is driven to its end without an event loop (the demo
    handlers do no I/O when called without a task context, so they never suspend)."""
    if not inspect.iscoroutine(value):
        return value
    try:
        value.send(None)
    except StopIteration as stop:
        return stop.value
    value.close()
    raise AssertionError("a demo handler suspended: it tried real I/O")


@dataclass
class Sim:
    plan: Mapping[str, Any]
    digest: str
    run_id: str = "run-1"
    fail_stages: frozenset[str] = frozenset()  # stage names (or "finaliser:<i>") whose handler raises
    fail_items: frozenset[int] = frozenset()  # map items whose handler raises
    flaky_stages: frozenset[str] = frozenset()  # stages whose handler raises when a task is run again
    lost_stages: frozenset[str] = frozenset()  # stages whose worker takes the task and never reports
    limits: Limits = DEFAULT_LIMITS  # what the shard's engine is told about message sizes
    store: MemoryStore = field(default_factory=MemoryStore)
    clock: int = 1_700_000_000_000
    pending: list[Delivery] = field(default_factory=list)
    delivered: list[Delivery] = field(default_factory=list)
    log: list[tuple[Event | Poisoned, int]] = field(default_factory=list)
    handled: list[Handled] = field(default_factory=list)
    published: Counter[str] = field(default_factory=Counter)
    tasks: list[Outgoing] = field(default_factory=list)  # every task ever published
    cancels: list[Outgoing] = field(default_factory=list)
    finished: list[Outgoing] = field(default_factory=list)
    calls: list[tuple[str, int | None, bool, Any]] = field(default_factory=list)  # stage, item, ok, value
    hook: Callable[[Sim, Handled], None] | None = None

    # ---- driving ------------------------------------------------------------------------------------

    def start(self, context: Mapping[str, Any], message_id: str = "start-1") -> Delivery:
        """Queue the run's start (delivered like any other pending message)."""
        delivery = Delivery("event", event=StartRun(message_id, self.run_id, SHARD, dict(context)))
        self.pending.append(delivery)
        return delivery

    def handle(self, event: Event) -> Handled:
        """The shard handles one event; what it publishes becomes pending."""
        self.clock += 1
        self.log.append((event, self.clock))
        assert not self.store.outbox, f"unsent outbox entries before a delivery: {list(self.store.outbox)}"
        handled = apply_event(self.store, self.plan, self.digest, self.run_id, event, self.clock, self.limits)
        self.handled.append(handled)
        ids_published = [m.message_id for m in handled.published]
        # decide and record together: the outbox holds exactly what this transition publishes
        assert set(self.store.outbox) == set(ids_published), (
            f"outbox {sorted(self.store.outbox)} != published {sorted(ids_published)} for {event}"
        )
        self.store.mark_sent(ids_published)  # a positive publisher confirm
        for message in handled.published:
            self.published[message.message_id] += 1
            self._route(message)
        if self.hook is not None:
            self.hook(self, handled)
        return handled

    def _route(self, message: Outgoing) -> None:
        if message.kind == "task":
            self.tasks.append(message)
            self.pending.append(Delivery("task", task=message))
        elif message.kind == "barrier.released":
            body = message.body
            event = BarrierReleased(message.message_id, str(body["stage"]), str(body["fence"]))
            self.pending.append(Delivery("event", event=event))
        elif message.kind == "bag.refill":
            body = message.body
            refill = BagRefill(message.message_id, str(body["stage"]), str(body["fence"]), int(body["sent"]))
            self.pending.append(Delivery("event", event=refill))
        elif message.kind == "cancel":
            self.cancels.append(message)
        elif message.kind == "run.finished":
            self.finished.append(message)
        else:
            raise AssertionError(f"unexpected message kind {message.kind!r}: {message}")

    def poison(self, message_id: str = "poison-1", error: str = "RuntimeError: a bug") -> None:
        """A message's transition failed on every delivery: the run is marked failed as the shard
        service does (``saga_poison``), whatever is in flight."""
        self.clock += 1
        self.log.append((Poisoned(message_id, error), self.clock))
        self.store.poison(self.run_id, message_id, error, self.clock)

    def deliver(self, delivery: Delivery) -> Handled | None:
        """Deliver (one more time) ``delivery``; a task's acceptance (if asked for) and result become
        pending."""
        self.delivered.append(delivery)
        if delivery.kind == "task":
            assert delivery.task is not None
            body = delivery.task.body
            if body.get("report"):
                accepted = StageAccepted(
                    ids.acceptance_id(self.run_id, str(body["stage"]), str(body["fence"])),
                    str(body["stage"]),
                    int(body["attempt"]),
                    str(body["fence"]),
                    str(body["digest"]),
                )
                self.pending.append(Delivery("event", event=accepted))
            if body["stage"] not in self.lost_stages:
                self.pending.append(Delivery("event", event=self.work(delivery.task)))
            return None
        assert delivery.event is not None
        return self.handle(delivery.event)

    def deliver_at(self, index: int) -> Handled | None:
        return self.deliver(self.pending.pop(index))

    def deliver_where(self, predicate: Callable[[Delivery], bool]) -> Handled | None:
        for i, delivery in enumerate(self.pending):
            if predicate(delivery):
                return self.deliver_at(i)
        raise AssertionError(f"nothing pending matches; pending: {self.pending}")

    def deliver_task(self, stage: str, item: int | None = None) -> Handled | None:
        """Run the pending task of ``stage`` (and ``item``) and deliver its result at once."""
        self.deliver_where(lambda d: d.kind == "task" and d.stage == stage and d.item == item)
        if any(isinstance(d.event, StageAccepted) and d.stage == stage for d in self.pending):
            self.deliver_where(lambda d: isinstance(d.event, StageAccepted) and d.stage == stage)
        return self.deliver_where(lambda d: d.kind == "event" and d.stage == stage and d.item == item)

    def run(self, limit: int = 100_000) -> None:
        """Deliver everything pending, first in first out, then fire timers, until nothing is left."""
        for _ in range(limit):
            if self.pending:
                self.deliver_at(0)
            elif self.store.timers:
                self.fire_next_timer()
            else:
                return
        raise AssertionError("the run did not quiesce")

    def fire_next_timer(self) -> Handled:
        """Move the clock to the earliest timer and fire it, as the shard's timer loop does."""
        member, due = min(self.store.timers.items(), key=lambda t: (t[1], t[0]))
        self.clock = max(self.clock, due)
        parsed = clocks.parse_member(member)
        assert parsed is not None, member
        _, clock, stage, fence = parsed
        return self.handle(TimerFired(f"timer-{member}", clock, stage, fence, member))

    # ---- the worker side ----------------------------------------------------------------------------

    def work(self, task: Outgoing) -> StageResult | FinaliserResult | CompensationResult:
        """Run a task's handler and build the worker's report (its id derives from the task's id)."""
        body = task.body
        stage, item = str(body["stage"]), body["item"]
        again = any(s == stage and i == item for s, i, _, _ in self.calls)
        try:
            if stage in self.fail_stages or (item is not None and item in self.fail_items):
                raise InjectedFailure(f"injected failure of {stage} item {item}")
            if again and stage in self.flaky_stages:
                raise InjectedFailure(f"injected failure of {stage} item {item} on a redelivery")
            value, ok, error = handler_output(str(body["contract"]), body["input"]), True, None
        except Exception as exc:
            value, ok, error = None, False, f"{type(exc).__name__}: {exc}"
        # what the worker runtime sends: a result too large for a message becomes a failure saying so
        sent = bodies.result(ok, value if ok else error, self.limits)
        ok, value, error = sent["ok"], sent.get("result"), sent.get("error")
        self.calls.append((stage, item, ok, value if ok else error))
        message_id = ids.result_id(task.message_id)
        if stage.startswith("compensate:"):
            index = int(str(body["fence"]).rpartition(".c")[2])
            name = stage.partition(":")[2]
            return CompensationResult(
                message_id, name, index, str(body["fence"]), ok, error, str(body["digest"]), value
            )
        if stage.startswith("finaliser:"):
            index = int(stage.partition(":")[2])
            return FinaliserResult(
                message_id, index, str(body["fence"]), ok, value, error, str(body["digest"])
            )
        return StageResult(
            message_id,
            stage,
            int(body["attempt"]),
            str(body["fence"]),
            ok,
            value,
            error,
            item,
            str(body["digest"]),
            retryable=sent.get("retryable", True),
        )

    # ---- reading ------------------------------------------------------------------------------------

    def snapshot(self) -> RunSnapshot:
        snapshot = self.store.snapshot(self.run_id)
        assert snapshot is not None, "the run does not exist"
        return snapshot

    @property
    def record(self) -> dict[str, str]:
        return self.store.runs[self.run_id].record

    @property
    def history(self) -> list[dict[str, Any]]:
        return self.store.runs[self.run_id].history

    def kinds(self) -> list[str]:
        return [h["kind"] for h in self.history]

    def entries(self, kind: str, stage: str | None = None) -> list[dict[str, Any]]:
        return [h for h in self.history if h["kind"] == kind and (stage is None or h["stage"] == stage)]

    @property
    def status(self) -> str:
        return self.record["status"]

    @property
    def output(self) -> Any:
        return json.loads(self.record["output"]) if "output" in self.record else None

    def pending_tasks(self) -> list[str]:
        return [str(d.stage) for d in self.pending if d.kind == "task"]

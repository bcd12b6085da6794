"""The builder one transition is assembled in: what it expects, writes, records and sends.

A transition is decided by calling methods on one builder (``Step``, which adds the routing rules, and
``Ending``, which adds the intent, compensations and finalisers); ``decision()`` turns it into the
Decision the store applies atomically. Here: the primitives, the timers, the bindings and the task
messages every part builds, and the helpers for events that change nothing.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from orchestrator import jsontext
from orchestrator.dsl.binding import bind, validator_for
from orchestrator.dsl.fastcheck import certainly_fits
from orchestrator.engine import clocks
from orchestrator.engine.model import (
    RUN,
    Arrival,
    BarrierInit,
    Clock,
    Decision,
    Expect,
    HistoryEntry,
    Intent,
    Key,
    RunSnapshot,
    StageRecord,
    Timer,
    Verdict,
    Write,
)
from orchestrator.engine.plan import Bag, Plan, Work
from orchestrator.redaction import WITHHELD, path_is_sensitive
from orchestrator.wire import bodies, ids, sizes
from orchestrator.wire.bodies import DEFAULT_TENANT
from orchestrator.wire.kinds import Kind
from orchestrator.wire.outgoing import Outgoing


def dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), sort_keys=True)


def result_text(result: Any) -> str:
    """A stage's or an item's result as the run keeps it, read back only as JSON: orjson's text (sorted,
    several times faster to write), unless it holds a null, where a non-finite number may hide (orjson
    writes NaN as null); that text is the standard library's, which keeps NaN as NaN."""
    text = jsontext.dumps(result, sort_keys=True)
    return dumps(result) if "null" in text else text


#: How long a worker may wait before reporting the acceptance of an attempt whose stage has no queue
#: deadline: one whose handler returns sooner sends no acceptance, one message and one transition fewer.
ACCEPT_AFTER_MS = 50


@dataclass
class Builder:
    """One transition under construction."""

    plan: Plan
    digest: str
    run: RunSnapshot
    now_ms: int
    history: list[HistoryEntry] = field(default_factory=list)
    expects: dict[tuple[Key, str], str | None] = field(default_factory=dict)
    writes: dict[Key, dict[str, str]] = field(default_factory=dict)
    barriers: list[BarrierInit] = field(default_factory=list)
    arrival: Arrival | None = None
    absent: list[tuple[Key, str]] = field(default_factory=list)
    outgoing: list[Outgoing] = field(default_factory=list)
    overlay: dict[str, StageRecord] = field(default_factory=dict)
    finished: bool = False
    intent: Intent | None = None
    reason: str | None = None
    timers: dict[str, int] = field(default_factory=dict)
    untimers: set[str] = field(default_factory=set)
    claim: str | None = None
    remember: bool = True
    removes: list[tuple[Key, str]] = field(default_factory=list)
    persist: bool = False
    limits: sizes.Limits = sizes.DEFAULT_LIMITS
    # join -> branches that arrived in the very transition that opens the join (reused after a re-drive,
    # or a decision routing straight to the join): the fork counts them when it sets the barrier
    early_arrivals: dict[str, list[str]] = field(default_factory=dict)

    def expect(self, key: Key, name: str, value: str | None) -> None:
        """A precondition on the state this transition was decided from (the first one per field wins).

        A field this transition has already written or removed is its own: the store checks every
        precondition before the first write, so expecting it would compare the stored value with this
        transition's own intention and conflict on every attempt."""
        if (key, name) in self.expects or name in self.writes.get(key, ()) or (key, name) in self.removes:
            return
        self.expects[(key, name)] = value

    def write(self, key: Key, **fields: str) -> None:
        self.writes.setdefault(key, {}).update(fields)

    def record(self, kind: str, stage: str | None = None, attempt: int | None = None, **detail: Any) -> None:
        self.history.append(HistoryEntry(kind, stage, attempt, detail))

    def set_stage(self, name: str, record: StageRecord) -> None:
        self.overlay[name] = record
        fields = {"status": record.status.value, "attempt": str(record.attempt), "fence": record.fence}
        if record.result is not None:
            fields["result"] = result_text(record.result)
        if record.error is not None:
            fields["error"] = record.error
        if record.items is not None:
            fields["items"] = str(record.items)
        if record.sent is not None:
            fields["sent"] = str(record.sent)
        if record.window is not None:
            fields["window"] = str(record.window)
        if record.completed_at is not None:
            fields["done_at"] = str(record.completed_at)
        self.write(Key("stage", name), **fields)

    def guard(self, name: str, rec: StageRecord) -> None:
        """The transition holds only while the attempt is the one we read and the run has no intent."""
        self.expect(Key("stage", name), "fence", rec.fence)
        self.expect(Key("stage", name), "status", rec.status.value)
        self.expect(RUN, "intent", None)

    def reject(self, verdict: Verdict, why: str, stage: str | None, attempt: int | None = None) -> Decision:
        """An event that changes the run in nothing: recorded with its reason (plus whatever messages this
        step already decided to send, such as a repeated cancellation)."""
        self.history.append(rejection(verdict, why, stage, attempt))
        return self.decision(verdict)

    def stage(self, name: str) -> StageRecord | None:
        return self.overlay.get(name) or self.run.stages.get(name)

    def decision(self, verdict: Verdict = Verdict.APPLIED, *, create: bool = False) -> Decision:
        return Decision(
            verdict=verdict,
            history=tuple(self.history),
            expects=tuple(Expect(k, f, v) for (k, f), v in self.expects.items()),
            writes=tuple(Write(k, v) for k, v in self.writes.items()),
            barriers=tuple(self.barriers),
            arrival=self.arrival,
            absent=tuple(self.absent),
            outgoing=tuple(self.outgoing),
            create=create,
            finished=self.finished,
            timers=tuple(Timer(m, due) for m, due in sorted(self.timers.items())),
            untimers=tuple(sorted(self.untimers)),
            claim=self.claim,
            # Only an applied message's id is remembered. A refused one may carry the id of a report
            # still to come (a signed forgery naming a stale fence under the genuine report's id):
            # remembered, it would make the genuine report a duplicate, and the run wait for ever.
            remember=self.remember and verdict is Verdict.APPLIED,
            removes=tuple(self.removes),
            persist=self.persist,
        )

    def done_at(self, stage: Work) -> int | None:
        """When a stage that can be compensated completed (the undo order); None for the others."""
        return self.now_ms if stage.compensate else None

    def set_timer(self, clock: Clock, stage: str, fence: str, after_ms: int) -> None:
        name = clocks.member(self.run.run_id, clock, stage, fence)
        self.untimers.discard(name)
        self.timers[name] = self.now_ms + after_ms

    def clear_timer(self, clock: Clock, stage: str, fence: str) -> None:
        name = clocks.member(self.run.run_id, clock, stage, fence)
        self.timers.pop(name, None)
        self.untimers.add(name)

    def clear_attempt_clocks(self, name: str, fence: str) -> None:
        """The attempt ended: its queue, execution and heartbeat timers have nothing left to watch."""
        stage = self.plan.work(name)
        for clock in stage.clocks if stage else ():
            self.clear_timer(clock, name, fence)

    def variables(self, **extra: Any) -> dict[str, Any]:
        names = set(self.run.stages) | set(self.overlay)
        stages = {}
        for name in names:
            rec = self.stage(name)
            if rec is not None:
                stages[name] = {"state": rec.status.value, "attempt": rec.attempt, "result": rec.result}
        return {"context": dict(self.run.context), "stages": stages, **extra}

    def bind_input(self, name: str, stage: Work, **extra: Any) -> Any:
        schema = self.plan.contracts[stage.contract].input_schema
        return bind(stage.input, self.variables(**extra), schema, f"{name}.input")

    def stage_task(
        self, name: str, stage: Work, attempt: int, fence: str, payload: Any, item: int | None
    ) -> Outgoing:
        report: dict[str, Any] | None = None
        if item is None and stage.needs_acceptance:
            # the worker reports acceptance, and heartbeats at a third of the timeout
            report = {"accept": True, "heartbeat_ms": stage.heartbeat_timeout_ms}
            if stage.queue_deadline_ms is None:
                # no queue clock to stop: a handler that returns within this lets its result stand for
                # its acceptance (the execution and heartbeat clocks start at most this much later)
                report["accept_after_ms"] = ACCEPT_AFTER_MS
        id_part = ids.item_part(item, attempt)
        return self.task(
            name,
            stage.contract,
            stage.queue,
            attempt,
            fence,
            payload,
            item=item,
            id_parts=(id_part,),
            report=report,
            per_message=stage.items_per_message if isinstance(stage, Bag) and item is not None else 1,
            # started by then or not at all: the queue clock times the attempt out at that moment (a map's
            # items have none: a bag has one clock, from dispatch to its last item)
            deadline_ms=None
            if stage.queue_deadline_ms is None or item is not None
            else self.now_ms + stage.queue_deadline_ms,
        )

    def task(
        self,
        label: str,
        ref: str,
        queue: str,
        attempt: int,
        fence: str,
        payload: Any,
        *,
        item: int | None = None,
        id_parts: tuple[object, ...] = (),
        report: dict[str, Any] | None = None,
        per_message: int = 1,
        deadline_ms: int | None = None,
    ) -> Outgoing:
        """A task message for contract ``ref``: its id is a pure function of run, label, fence and
        ``id_parts``, so building it again (a relay, a nudge) gives the same message, and it is the
        idempotency key."""
        message_id = ids.task_id(self.run.run_id, label, fence, *id_parts)
        body = bodies.task(
            run_id=self.run.run_id,
            shard=self.run.shard,
            stage=label,
            attempt=attempt,
            fence=fence,
            item=item,
            contract=ref,
            digest=self.digest,
            tenant=self.run.tenant,
            payload=payload,
            idempotency_key=message_id,
            report=report,
            per_message=per_message,
        )
        return Outgoing(message_id, Kind.TASK, ("task", queue), body, deadline_ms)

    def send_or_why(self, message: Outgoing) -> str | None:
        """Send ``message`` if its reader can take it (it fits ``limits``); else say why it cannot."""
        problem = sizes.too_big(message.body, self.limits)
        if problem is None:
            self.outgoing.append(message)
        return problem

    def release(self, barrier: str, fence: str) -> Outgoing:
        """The continuation a join or map barrier sends itself, once, when its last member arrives."""
        return _release(self.run.run_id, self.run.shard, barrier, fence, self.run.tenant)

    def window_of(self, rec: StageRecord) -> int:
        """How many items a chunked bag sends at once: its own window, kept when it was entered."""
        return rec.window or self.limits.bag_window

    def refill_at(self, rec: StageRecord, sent: int) -> int:
        """How many of a chunked bag's items have arrived when its refill from ``sent`` is due: half a
        window of the sent items still out."""
        return sent - self.window_of(rec) // 2

    def refill(self, bag: str, fence: str, sent: int) -> Outgoing:
        """The continuation a chunked bag sends itself for its next chunk, the items from ``sent`` on."""
        return _refill(self.run.run_id, self.run.shard, bag, fence, sent, self.run.tenant)

    def request_cancel(self, name: str, fence: str, cause: str = "") -> None:
        """Ask the workers to stop an attempt (broadcast: any worker running it stops). The attempt is
        fenced whatever they do; this only saves the work. ``cause``: the message that made us ask again
        (a worker still reporting on the attempt), so each request has an id of its own."""
        self.outgoing.append(
            Outgoing(
                ids.message_id("cancel", self.run.run_id, name, fence, cause),
                Kind.CANCEL,
                ("events", f"cancel.{self.run.run_id}"),
                bodies.attempt(self.run.run_id, name, fence),
            )
        )


def rejection(
    verdict: Verdict, why: str, stage: str | None, attempt: int | None = None, **extra: str
) -> HistoryEntry:
    detail = {"reason": verdict.value, "detail": why, **extra}
    return HistoryEntry("callback.rejected", stage, attempt, detail)


def rejected(
    verdict: Verdict,
    why: str,
    stage: str | None,
    attempt: int | None = None,
    *,
    remember: bool = False,
    **extra: str,
) -> Decision:
    """An event that changes nothing: recorded in history with its reason (``extra``: what lets its
    sender find the answer, such as an operator request's id). Its id is not remembered (see
    ``Step.decision``), but for an operator's request (``remember``): its id can be no report's, and a
    refusal delivered again after the run changed must not act late."""
    history = (rejection(verdict, why, stage, attempt, **extra),)
    return Decision(verdict=verdict, history=history, remember=remember)


def context_problems(plan: Plan, context: Mapping[str, Any]) -> list[str]:
    schema = plan.context
    if schema is None:
        return []
    if certainly_fits(schema, dict(context)):
        return []
    validator = validator_for(schema)
    return [
        f"{'.'.join(str(p) for p in e.absolute_path) or 'context'}: "
        + (f"{WITHHELD} fails '{e.validator}'" if path_is_sensitive(schema, e.absolute_path) else e.message)
        for e in sorted(validator.iter_errors(dict(context)), key=lambda e: list(e.absolute_path))
    ]


@functools.lru_cache(maxsize=256)
def _release(run_id: str, shard: str, barrier: str, fence: str, tenant: str) -> Outgoing:
    """A barrier's release message. Every arrival at a bag names it (the store appends it after the
    last), so the same one is built once, not once per item (a hash per message id)."""
    return Outgoing(
        ids.release_id(run_id, barrier, fence),
        Kind.RELEASE,
        ("shard", shard),
        _of_tenant(bodies.attempt(run_id, barrier, fence), tenant),
    )


@functools.lru_cache(maxsize=256)
def _refill(run_id: str, shard: str, bag: str, fence: str, sent: int, tenant: str) -> Outgoing:
    """A bag's refill message. Every arrival while a refill is due names it (the store sends it once, at
    the arrival that makes it due), so the same one is built once, not once per item."""
    return Outgoing(
        ids.refill_id(run_id, bag, fence, sent),
        Kind.REFILL,
        ("shard", shard),
        _of_tenant(bodies.refill(run_id, bag, fence, sent), tenant),
    )


def _of_tenant(body: dict[str, Any], tenant: str) -> dict[str, Any]:
    """A continuation's body names its run's tenant (the envelope's, which its shard checks against the
    run's); a run of the default tenant's leaves it out, as messages did before tenants."""
    return body if tenant == DEFAULT_TENANT else {**body, "tenant": tenant}

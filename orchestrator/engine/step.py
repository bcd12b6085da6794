"""The builder one transition is assembled in, and the routing rules (what entering a target means).

Routing is recursive: entering a decision evaluates it and enters its target; entering a fork enters
every branch; entering a terminal sets the intent and starts finalisation. Everything entered in one
transition lands in the same Decision, which the store applies atomically.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from orchestrator.dsl.binding import bind, evaluate, validator_for
from orchestrator.engine import clocks, ids, sizes
from orchestrator.engine.model import (
    ACTIVE_STAGE_STATUSES,
    RUN,
    Arrival,
    BarrierInit,
    Clock,
    Decision,
    Expect,
    HistoryEntry,
    Intent,
    Key,
    Outgoing,
    RunSnapshot,
    RunStatus,
    StageRecord,
    StageStatus,
    Timer,
    Verdict,
    Write,
)
from orchestrator.errors import BindingError

TERMINALS = frozenset(i.value for i in Intent)
CANCELLABLE = ACTIVE_STAGE_STATUSES | {StageStatus.RETRY_SCHEDULED}
WORK_STAGE_TYPES = frozenset({"action", "worker", "map"})


def dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), sort_keys=True)


@dataclass
class Step:
    """One transition under construction."""

    plan: Mapping[str, Any]
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

    # ---- primitives --------------------------------------------------------------------------------

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
            fields["result"] = dumps(record.result)
        if record.error is not None:
            fields["error"] = record.error
        if record.items is not None:
            fields["items"] = str(record.items)
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

    def done_at(self, stage: Mapping[str, Any]) -> int | None:
        """When a stage that can be compensated completed (the undo order); None for the others."""
        return self.now_ms if stage.get("compensate") else None

    # ---- timers ------------------------------------------------------------------------------------

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
        for clock in clocks.attempt_clocks(self.plan["stages"].get(name, {})):
            self.clear_timer(clock, name, fence)

    # ---- bindings ----------------------------------------------------------------------------------

    def variables(self, **extra: Any) -> dict[str, Any]:
        names = set(self.run.stages) | set(self.overlay)
        stages = {}
        for name in names:
            rec = self.stage(name)
            if rec is not None:
                stages[name] = {"state": rec.status.value, "attempt": rec.attempt, "result": rec.result}
        return {"context": dict(self.run.context), "stages": stages, **extra}

    # ---- routing -----------------------------------------------------------------------------------

    def enter(
        self, source: str | None, target: str, outcome: str = "completed", why: str | None = None
    ) -> None:
        """Follow a route from ``source`` (None: the run's start) to ``target``; ``why`` explains a
        failure route and becomes the run's reason if it ends at the failed intent."""
        if self.intent is not None:
            return  # an intent was set earlier in this transition; nothing else starts
        if target in TERMINALS:
            reason = None if target == Intent.COMPLETED else f"{source}: {why or outcome}"
            self.set_intent(Intent(target), reason)
            return
        stage = self.plan["stages"][target]
        kind = stage["type"]
        if kind in WORK_STAGE_TYPES and self._reuse(target):
            return
        if kind == "join":
            self._arrive(source, target, stage, outcome)
        elif kind == "decision":
            self._decide(target, stage)
        elif kind == "fork":
            self._fork(target, stage)
        elif kind == "map":
            self._map(target, stage)
        else:
            self.dispatch(target, stage, attempt=1)

    def _decide(self, name: str, stage: Mapping[str, Any]) -> None:
        fence = ids.stage_fence(self.run.epoch, 1)
        previous = self.stage(name)
        self.expect(Key("stage", name), "fence", previous.fence if previous else None)
        variables = self.variables()
        for i, branch in enumerate(stage["branches"]):
            try:
                taken = evaluate(branch["when"], variables, f"{name}.branches[{i}].when")
            except BindingError as exc:
                self.set_stage(name, StageRecord(StageStatus.FAILED, 1, fence, error=str(exc)))
                self.record("decision.failed", name, error=str(exc))
                self.enter(name, stage["on_evaluation_error"], "failed", f"evaluation error: {exc}")
                return
            if not isinstance(taken, bool):
                error = f"branch {i} gave {taken!r}, not a boolean"
                self.set_stage(name, StageRecord(StageStatus.FAILED, 1, fence, error=error))
                self.record("decision.failed", name, error=error)
                self.enter(name, stage["on_evaluation_error"], "failed", f"evaluation error: {error}")
                return
            if taken:
                self.set_stage(name, StageRecord(StageStatus.COMPLETED, 1, fence, result={"branch": i}))
                self.record("decision.taken", name, branch=i, next=branch["next"])
                self.enter(name, branch["next"], why=f"branch {i} ({branch['when']}) was taken")
                return

    def _reuse(self, name: str) -> bool:
        """A work stage entered when it has already completed (and was not compensated) keeps its result
        and is not run again; the route goes on from it. Plans have no cycles, so within one epoch a stage
        is entered once: this is a re-driven run meeting what an earlier epoch did, in whichever
        transition of the new epoch reaches it."""
        rec = self.run.stages.get(name)
        if rec is None or rec.status is not StageStatus.COMPLETED:
            return False
        self.expect(Key("stage", name), "fence", rec.fence)
        self.record("stage.reused", name, rec.attempt, from_fence=rec.fence)
        self.enter(name, self.plan["stages"][name]["on_success"])
        return True

    def _fork(self, name: str, stage: Mapping[str, Any]) -> None:
        fence = ids.stage_fence(self.run.epoch, 1)
        previous = self.run.stages.get(name)  # set in an earlier epoch, when re-driven
        self.expect(Key("stage", name), "fence", previous.fence if previous else None)
        self.set_stage(name, StageRecord(StageStatus.COMPLETED, 1, fence))
        join = self._join_of(name)
        init = BarrierInit(Key("barrier", join), len(stage["branches"]))
        self.barriers.append(init)
        self.set_stage(join, StageRecord(StageStatus.RUNNING, 1, fence))
        self.record("fork.released", name, branches=list(stage["branches"]))
        for branch in stage["branches"]:
            self.enter(name, branch)
        early = self.early_arrivals.pop(join, [])
        if early:  # branches that arrived at once are members now; the barrier waits for the rest
            self.barriers.remove(init)
            self.barriers.append(BarrierInit(init.key, init.count - len(early), tuple(early)))
            if len(early) == init.count and self.intent is None:
                self.set_stage(join, StageRecord(StageStatus.COMPLETED, 1, fence))
                self.record("join.released", join, 1)
                self.enter(join, self.plan["stages"][join]["on_success"])

    def _join_of(self, fork: str) -> str:
        return next(
            str(n) for n, s in self.plan["stages"].items() if s["type"] == "join" and s["fork"] == fork
        )

    def _arrive(self, source: str | None, join: str, stage: Mapping[str, Any], outcome: str) -> None:
        branch = self.plan["stages"][source]["arrives_at"]["branch"] if source else ""
        if outcome not in stage["acceptable_terminal_states"]:
            self.record("join.failed", join, branch=branch, outcome=outcome)
            rec = self.stage(join)
            self.set_stage(join, StageRecord(StageStatus.FAILED, 1, rec.fence if rec else "", error=outcome))
            self.enter(join, stage["on_failure"], "failed", f"branch {branch!r} arrived {outcome}")
            return
        if any(b.key.name == join for b in self.barriers):
            # the branch arrives in the transition that opens the join: counted by the fork
            self.early_arrivals.setdefault(join, []).append(branch)
            self.record("branch.arrived", join, branch=branch, outcome=outcome, early=True)
            return
        rec = self.stage(join)
        fence = rec.fence if rec else ids.stage_fence(self.run.epoch, 1)
        release = Outgoing(
            ids.release_id(self.run.run_id, join, fence),
            "barrier.released",
            ("shard", self.run.shard),
            {"run_id": self.run.run_id, "stage": join, "fence": fence},
        )
        self.record("branch.arrived", join, branch=branch, outcome=outcome)
        self.arrival = Arrival(Key("barrier", join), branch, release)

    def _map(self, name: str, stage: Mapping[str, Any]) -> None:
        try:
            items = bind(stage["items"], self.variables(), None, f"{name}.items")
        except BindingError as exc:
            self.fail_to_start(name, stage, str(exc))
            return
        if not isinstance(items, list):
            self.fail_to_start(name, stage, f"items gave a {type(items).__name__}, not a list")
            return
        if len(items) > stage["max_items"]:
            self.fail_to_start(
                name, stage, f"items has {len(items)} entries, over max_items {stage['max_items']}"
            )
            return
        fence = ids.stage_fence(self.run.epoch, 1)
        previous = self.run.stages.get(name)  # set in an earlier epoch, when re-driven
        self.expect(Key("stage", name), "fence", previous.fence if previous else None)
        # items retried in an earlier epoch start again at attempt 1 under the new fence
        prefix = f"{name}:"
        retried = sorted(k for k in self.run.item_attempts if k.startswith(prefix))
        self.removes += [(Key("item", k), "attempt") for k in retried]
        if not items:
            self.set_stage(name, StageRecord(StageStatus.COMPLETED, 1, fence, result=[]))
            self.record("stage.completed", name, 1, items=0)
            self.enter(name, stage["on_success"])
            return
        inputs = []
        for index, item in enumerate(items):
            try:
                inputs.append(self.bind_input(name, stage, item=item, index=index))
            except BindingError as exc:
                self.fail_to_start(name, stage, str(exc))
                return
        tasks = [self.stage_task(name, stage, 1, fence, payload, i) for i, payload in enumerate(inputs)]
        problem = self.largest_too_big(tasks, inputs)
        if problem is not None:
            self.fail_to_start(name, stage, problem)
            return
        self.set_stage(name, StageRecord(StageStatus.DISPATCHED, 1, fence, items=len(items)))
        self.barriers.append(BarrierInit(Key("barrier", name), len(items)))
        self.outgoing += tasks
        self.record("stage.dispatched", name, 1, items=len(items), queue=stage["queue"])
        if stage.get("execution_deadline_ms"):  # a bag has one clock: from dispatch to its last item
            self.set_timer(Clock.EXECUTION, name, fence, stage["execution_deadline_ms"])

    # ---- work stages -------------------------------------------------------------------------------

    def bind_input(self, name: str, stage: Mapping[str, Any], **extra: Any) -> Any:
        ref = stage.get("action") or stage["worker"]
        schema = self.plan["contracts"][ref]["input_schema"]
        return bind(stage["input"], self.variables(**extra), schema, f"{name}.input")

    def largest_too_big(self, tasks: list[Outgoing], inputs: list[Any]) -> str | None:
        """Why one of a map's item tasks cannot be sent (None: all fit). Item tasks differ only in their
        input, so when all inputs together fit beside one task's identity, every task does; only a bag
        near the limit pays for measuring each task."""
        if sizes.body_bytes({"all": inputs}) + sizes.body_bytes(tasks[0].body) <= self.limits.max_body_bytes:
            return None
        for index, task in enumerate(tasks):
            problem = sizes.too_big(task.body, self.limits)
            if problem is not None:
                return f"the task of item {index} cannot be sent: {problem}"
        return None

    def dispatch(self, name: str, stage: Mapping[str, Any], attempt: int) -> None:
        try:
            payload = self.bind_input(name, stage)
        except BindingError as exc:
            self.fail_to_start(name, stage, str(exc))
            return
        previous = self.stage(name)
        fence = ids.stage_fence(self.run.epoch, attempt)
        task = self.stage_task(name, stage, attempt, fence, payload, None)
        problem = sizes.too_big(task.body, self.limits)
        if problem is not None:
            self.fail_to_start(name, stage, f"the task cannot be sent: {problem}")
            return
        self.expect(Key("stage", name), "fence", previous.fence if previous else None)
        self.set_stage(name, StageRecord(StageStatus.DISPATCHED, attempt, fence))
        self.outgoing.append(task)
        self.record("stage.dispatched", name, attempt, queue=stage["queue"])
        if stage.get("queue_deadline_ms"):
            self.set_timer(Clock.QUEUE, name, fence, stage["queue_deadline_ms"])

    def stage_task(
        self, name: str, stage: Mapping[str, Any], attempt: int, fence: str, payload: Any, item: int | None
    ) -> Outgoing:
        report = None
        if item is None and clocks.needs_acceptance(stage):
            # the worker reports acceptance, and heartbeats at a third of the timeout
            report = {"accept": True, "heartbeat_ms": stage.get("heartbeat_timeout_ms")}
        ref = stage.get("action") or stage["worker"]
        id_part = ids.item_part(item, attempt)
        return self.task(
            name, ref, stage["queue"], attempt, fence, payload, item=item, id_parts=(id_part,), report=report
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
    ) -> Outgoing:
        """A task message for contract ``ref``: its id is a pure function of run, label, fence and
        ``id_parts``, so building it again (a relay, a nudge) gives the same message, and it is the
        idempotency key."""
        message_id = ids.task_id(self.run.run_id, label, fence, *id_parts)
        body = {
            "run_id": self.run.run_id,
            "shard": self.run.shard,
            "stage": label,
            "attempt": attempt,
            "fence": fence,
            "item": item,
            "contract": ref,
            "digest": self.digest,
            "tenant": self.run.tenant,
            "input": payload,
            "idempotency_key": message_id,
        }
        if report is not None:
            body["report"] = report
        return Outgoing(message_id, "task", ("task", queue), body)

    def resend_task(self, name: str, stage: Mapping[str, Any], rec: StageRecord) -> Outgoing:
        """The current attempt's task again: same id, fence and input (the reconciler's nudge)."""
        return self.stage_task(name, stage, rec.attempt, rec.fence, self.bind_input(name, stage), None)

    def retry_item(
        self, name: str, stage: Mapping[str, Any], rec: StageRecord, item: int, failed: int
    ) -> None:
        """A map item failed and may pass on another attempt: only it runs again, after its backoff; the
        map's other items and its fence are untouched."""
        label = ids.item_label(name, item)
        delay = clocks.backoff_ms(stage["retry"], self.run.run_id, label, failed)
        self.write(Key("item", f"{name}:{item}"), attempt=str(failed + 1))
        self.set_timer(Clock.RETRY, label, rec.fence, delay)
        self.record("retry.scheduled", name, failed, item=item, next_attempt=failed + 1, delay_ms=delay)

    def dispatch_item(
        self, name: str, stage: Mapping[str, Any], rec: StageRecord, item: int, attempt: int
    ) -> None:
        try:
            items = bind(stage["items"], self.variables(), None, f"{name}.items")
            payload = self.bind_input(name, stage, item=items[item], index=item)
        except (BindingError, IndexError, TypeError) as exc:  # the items changed: nothing to retry
            self._fail_item_dispatch(name, stage, rec, item, attempt, str(exc), "binding")
            return
        task = self.stage_task(name, stage, attempt, rec.fence, payload, item)
        problem = sizes.too_big(task.body, self.limits)
        if problem is not None:
            error = f"the task cannot be sent: {problem}"
            self._fail_item_dispatch(name, stage, rec, item, attempt, error, "size")
            return
        self.outgoing.append(task)
        self.record("item.dispatched", name, attempt, item=item)

    def _fail_item_dispatch(
        self,
        name: str,
        stage: Mapping[str, Any],
        rec: StageRecord,
        item: int,
        attempt: int,
        error: str,
        reason: str,
    ) -> None:
        """A retried item cannot be dispatched: the map fails (another attempt would meet the same)."""
        self.set_stage(name, StageRecord(StageStatus.FAILED, rec.attempt, rec.fence, error=error))
        self.record("stage.failed", name, attempt, item=item, error=error, reason=reason)
        self.enter(name, stage["on_failure"], "failed", error)

    def fail_attempt(
        self,
        name: str,
        stage: Mapping[str, Any],
        rec: StageRecord,
        error: str,
        *,
        retryable: bool,
        status: StageStatus = StageStatus.FAILED,
    ) -> None:
        """The current attempt failed or timed out: schedule the next attempt through a durable timer if
        the policy allows and the failure may pass, else follow ``on_failure``."""
        self.clear_attempt_clocks(name, rec.fence)
        policy = stage["retry"]
        if retryable and rec.attempt < policy["max_attempts"] and stage["type"] != "map":
            delay = clocks.backoff_ms(policy, self.run.run_id, name, rec.attempt)
            waiting = StageRecord(StageStatus.RETRY_SCHEDULED, rec.attempt, rec.fence, error=error)
            self.set_stage(name, waiting)
            self.set_timer(Clock.RETRY, name, rec.fence, delay)
            self.record("retry.scheduled", name, rec.attempt, next_attempt=rec.attempt + 1, delay_ms=delay)
            return
        self.set_stage(name, StageRecord(status, rec.attempt, rec.fence, error=error))
        self.enter(name, stage["on_failure"], status.value, error)

    def fail_to_start(self, name: str, stage: Mapping[str, Any], error: str) -> None:
        """A stage whose input cannot be bound fails without being dispatched, and follows on_failure."""
        previous = self.stage(name)
        fence = ids.stage_fence(self.run.epoch, 1)
        self.expect(Key("stage", name), "fence", previous.fence if previous else None)
        self.set_stage(name, StageRecord(StageStatus.FAILED, 1, fence, error=error))
        self.record("stage.failed", name, 1, error=error, reason="binding")
        self.enter(name, stage["on_failure"], "failed", error)

    # ---- intent, finalisers, end -------------------------------------------------------------------

    def set_intent(self, intent: Intent, reason: str | None) -> None:
        reason = sizes.bounded(reason) if reason else reason
        if intent is Intent.COMPLETED and self.plan.get("output") is not None:
            try:
                output = bind(self.plan["output"], self.variables(), None, "output")
                self.write(RUN, output=dumps(output))
            except BindingError as exc:
                intent, reason = Intent.FAILED, f"output binding failed: {exc}"
        self.intent, self.reason = intent, reason
        self.expect(RUN, "intent", None)
        fields = {"intent": intent.value, "status": RunStatus.FINALISING.value}
        if reason:
            fields["reason"] = reason
        self.write(RUN, **fields)
        self.record("intent.set", intent=intent.value, reason=reason)
        if intent is Intent.FAILED:
            self._cancel_active()
            self.start_compensations()
            return
        self.start_finaliser(0)

    # ---- compensation ------------------------------------------------------------------------------

    def start_compensations(self) -> None:
        """Undo what the failed run completed: stages that declare ``compensate``, newest first, one at a
        time, before the finalisers. The order is fixed now and stored, so it never changes mid-way."""
        done = []
        for name, stage in self.plan["stages"].items():
            if not stage.get("compensate"):
                continue
            rec = self.stage(name)
            # the order holds only for the stages as read: one completing meanwhile conflicts
            self.expect(Key("stage", name), "status", rec.status.value if rec else None)
            if rec is not None and rec.status is StageStatus.COMPLETED:
                done.append((rec.completed_at or 0, name))
        order = [name for _, name in sorted(done, reverse=True)]
        if not order:
            self.start_finaliser(0)
            return
        self.write(RUN, compensations=dumps(order))
        self.record("compensation.started", stages=order)
        self.start_compensation(order, 0)

    def start_compensation(self, order: list[str] | tuple[str, ...], index: int) -> None:
        """Dispatch compensation ``index`` (or, past the last, the finalisers). One whose task cannot be
        sent fails like any compensation, and the next one runs."""
        for position in range(index, len(order)):
            self.write(RUN, compensation_index=str(position), phase="compensating")
            task = self.compensation_task(order[position], position)
            self.record("compensation.dispatched", task.body["stage"], contract=task.body["contract"])
            problem = sizes.too_big(task.body, self.limits)
            if problem is None:
                self.outgoing.append(task)
                return
            self.write(RUN, compensation_failed="1")
            error = f"its task cannot be sent: {problem}"
            self.record("compensation.failed", task.body["stage"], error=error)
        self.start_finaliser(0)

    def compensation_task(self, name: str, index: int) -> Outgoing:
        """The task undoing stage ``name`` (the same message whenever it is built)."""
        stage = self.plan["stages"][name]
        rec = self.stage(name)
        try:
            bound_input = self.bind_input(name, stage)  # the same input the stage was given
        except BindingError:
            bound_input = {}
        undo_input = {
            "run_id": self.run.run_id,
            "stage": name,
            "input": bound_input if isinstance(bound_input, dict) else {"value": bound_input},
            "result": rec.result if rec else None,
        }
        fence = ids.compensation_fence(self.run.epoch, index)
        ref = stage["compensate"]
        label = ids.compensation_label(name)
        return self.task(label, ref, self.plan["contracts"][ref]["queue"], 1, fence, undo_input)

    def _cancel_active(self) -> None:
        names = set(self.run.stages) | set(self.overlay)
        for name in sorted(names):
            rec = self.stage(name)
            stage = self.plan["stages"].get(name, {})
            if rec is None or rec.status not in CANCELLABLE:
                continue
            # cancel the attempt that was read; one that ended meanwhile conflicts (decided again)
            self.expect(Key("stage", name), "fence", rec.fence)
            self.expect(Key("stage", name), "status", rec.status.value)
            self.clear_attempt_clocks(name, rec.fence)
            if rec.status is StageStatus.RETRY_SCHEDULED:
                self.clear_timer(Clock.RETRY, name, rec.fence)
            self.set_stage(name, StageRecord(StageStatus.CANCELLED, rec.attempt, rec.fence))
            if stage.get("type") == "join" or rec.status is StageStatus.RETRY_SCHEDULED:
                continue  # nothing runs remotely: a barrier just never releases, a retry never starts
            self.record("cancellation.requested", name, rec.attempt, fence=rec.fence)
            self.request_cancel(name, rec.fence)

    def request_cancel(self, name: str, fence: str, cause: str = "") -> None:
        """Ask the workers to stop an attempt (broadcast: any worker running it stops). The attempt is
        fenced whatever they do; this only saves the work. ``cause``: the message that made us ask again
        (a worker still reporting on the attempt), so each request has an id of its own."""
        self.outgoing.append(
            Outgoing(
                ids.message_id("cancel", self.run.run_id, name, fence, cause),
                "cancel",
                ("events", f"cancel.{self.run.run_id}"),
                {"run_id": self.run.run_id, "stage": name, "fence": fence},
            )
        )

    def start_finaliser(self, index: int) -> None:
        """Dispatch finaliser ``index`` (or, past the last, finish). One whose task cannot be sent fails
        like any finaliser, and the next one runs: every finaliser is attempted."""
        finalisers = self.plan.get("finalisers") or []
        for position in range(index, len(finalisers)):
            self.write(RUN, finaliser_index=str(position), phase="finalising")
            task = self.finaliser_task(position)
            label = ids.finaliser_label(position)
            self.record("finaliser.dispatched", label, contract=finalisers[position])
            problem = sizes.too_big(task.body, self.limits)
            if problem is None:
                self.outgoing.append(task)
                return
            self.write(RUN, finaliser_failed="1")
            self.record("finaliser.failed", label, error=f"its task cannot be sent: {problem}")
        self.finish()

    def finaliser_task(self, index: int) -> Outgoing:
        """Finaliser ``index``'s task (the same message whenever it is built: a re-send is a duplicate)."""
        run_input = {
            "run_id": self.run.run_id,
            "definition": self.plan["name"],
            "definition_version": self.plan["version"],
            "digest": self.digest,
            "intent": (self.intent or self.run.intent or Intent.FAILED).value,
            "reason": self.reason or self.run.reason,
        }
        fence = ids.finaliser_fence(self.run.epoch, index)
        ref = self.plan["finalisers"][index]
        label = ids.finaliser_label(index)
        return self.task(label, ref, self.plan["contracts"][ref]["queue"], 1, fence, run_input)

    def finish(self) -> None:
        intent = self.intent or self.run.intent
        failed = self.run.finaliser_failed or self.writes.get(RUN, {}).get("finaliser_failed") == "1"
        status = RunStatus.COMPLETED if intent is Intent.COMPLETED and not failed else RunStatus.FAILED
        self.write(RUN, status=status.value, finished_at=str(self.now_ms))
        self.record(f"run.{status.value}")
        if self.plan.get("run_deadline_ms"):
            self.clear_timer(Clock.RUN, "", ids.run_fence(self.run.epoch))
        written = self.writes.get(RUN, {}).get("output")
        body = {
            "run_id": self.run.run_id,
            "definition": self.plan["name"],
            "state": status.value,
            "output": json.loads(written) if written else self.run.output,
            "reason": self.reason or self.run.reason,
        }
        if sizes.too_big(body, self.limits) is not None:
            # the run's record keeps the output; the event says where to read it rather than not arrive
            omitted = f"too large for a message; read it with 'saga status {self.run.run_id}'"
            body.update(output=None, output_omitted=omitted)
        self.outgoing.append(
            Outgoing(
                ids.message_id("event", self.run.run_id, status.value, self.run.epoch),
                "run.finished",
                ("events", f"run.{status.value}.{self.plan['name']}"),
                body,
            )
        )
        self.finished = True


def rejection(
    verdict: Verdict, why: str, stage: str | None, attempt: int | None = None, **extra: str
) -> HistoryEntry:
    detail = {"reason": verdict.value, "detail": why, **extra}
    return HistoryEntry("callback.rejected", stage, attempt, detail)


def rejected(
    verdict: Verdict, why: str, stage: str | None, attempt: int | None = None, **extra: str
) -> Decision:
    """An event that changes nothing: recorded in history with its reason (``extra``: what lets its
    sender find the answer, such as an operator request's id). Its id is not remembered (see
    ``Step.decision``)."""
    return Decision(
        verdict=verdict, history=(rejection(verdict, why, stage, attempt, **extra),), remember=False
    )


def context_problems(plan: Mapping[str, Any], context: Mapping[str, Any]) -> list[str]:
    schema = plan.get("context")
    if schema is None:
        return []
    validator = validator_for(schema)
    return [
        f"{'.'.join(str(p) for p in e.absolute_path) or 'context'}: {e.message}"
        for e in sorted(validator.iter_errors(dict(context)), key=lambda e: list(e.absolute_path))
    ]

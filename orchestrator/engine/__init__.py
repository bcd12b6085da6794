"""The pure state machine: ``advance(plan, digest, run, event, now_ms) -> Decision``.

No I/O, no clock, no randomness: the store loads the snapshot, the engine decides, the store applies the
decision atomically (checking every ``Expect`` first). The same event sequence always gives the same
decisions, so recorded histories replay in tests.

What the engine decides for each event:

* ``StartRun``: create the run (a start for an existing run is a duplicate), pinning the versions stored
  beside its plan and this engine's version; a context that fails the definition's schema, or that
  makes a task too big to send, creates the run with a failed intent, so the caller can see why.
* ``StageResult``: after an intent, late; for another fence, stale; for a settled stage, a duplicate;
  not the report of the task this run dispatched (its message id is derived from the task's), invalid;
  otherwise the result is accepted and the stage's route is entered (a map item is an arrival at the map's
  barrier instead). An accepted success whose result does not fit the output schema of the contract
  version the plan pins fails the attempt for good instead (``outputs``), as the worker SDK reports its
  own handler's breach; the schema errors are in history.
* ``BarrierReleased``: once the barrier has counted every member, the join or map stage completes and
  its ``on_success`` route is entered.
* ``BagRefill``: a bag larger than ``Limits.bag_window`` sends its items a window at a time; the arrival
  that leaves half a window of them in flight emits a refill (one per chunk, a deterministic id), which
  sends the next chunk while the bag is still open under the same fence.
* ``FinaliserResult`` (``CompensationResult``): the outcome is recorded and the next finaliser
  (compensation) dispatched, or the run finishes; a success whose result breaks its contract is a failure.

Every message a transition causes is measured (``sizes``): one that its reader would refuse as too
large is never sent; the step that would send it fails instead, with the reason.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from orchestrator.engine import door, liveness, nudge, outputs, redrive
from orchestrator.engine.builder import dumps, rejected, result_text
from orchestrator.engine.model import (
    ACTIVE_STAGE_STATUSES,
    FENCED_OFF,
    RUN,
    Arrival,
    BagRefill,
    BarrierReleased,
    CancelRun,
    Clock,
    CompensationResult,
    Decision,
    Event,
    FinaliserResult,
    Intent,
    Key,
    Nudge,
    Redrive,
    Refill,
    RunSnapshot,
    RunStatus,
    StageAccepted,
    StageHeartbeat,
    StageRecord,
    StageResult,
    StageStatus,
    StartRun,
    TimerFired,
    Verdict,
)
from orchestrator.engine.plan import Bag, Join, Plan, Work
from orchestrator.engine.step import Step
from orchestrator.versions import ENGINE_VERSION
from orchestrator.wire import ids, sizes

__all__ = ["advance"]


def advance(
    plan: Plan,
    digest: str,
    run: RunSnapshot | None,
    event: Event,
    now_ms: int,
    limits: sizes.Limits = sizes.DEFAULT_LIMITS,
) -> Decision:
    if isinstance(event, StartRun):
        return _start(plan, digest, run, event, now_ms, limits)
    if run is None:
        return rejected(Verdict.INVALID, "names no run", getattr(event, "stage", None))
    claimed = getattr(event, "digest", "")
    if claimed and claimed != run.digest:
        why = f"names plan {claimed}, but the run is pinned to {run.digest}"
        return rejected(Verdict.INVALID, why, getattr(event, "stage", None))
    contract = getattr(event, "contract", "")
    if contract:
        dispatched = dispatched_contract(plan, event)
        if dispatched is not None and contract != dispatched:
            # a worker key signs only for its pool's contracts: a report must be for a task of one of them
            why = f"names contract {contract}, but its task was for {dispatched}"
            return rejected(Verdict.INVALID, why, getattr(event, "stage", None))
    handler: Callable[[Step, Any], Decision] = _HANDLERS[type(event)]
    return handler(Step(plan, digest, run, now_ms, limits=limits), event)


def _start(
    plan: Plan,
    digest: str,
    run: RunSnapshot | None,
    event: StartRun,
    now_ms: int,
    limits: sizes.Limits,
) -> Decision:
    if run is not None:
        return rejected(Verdict.DUPLICATE, "the run already exists", None)
    fresh = RunSnapshot(
        run_id=event.run_id,
        shard=event.shard,
        digest=digest,
        status=RunStatus.RUNNING,
        context=event.context,
        tenant=event.tenant,
    )
    step = Step(plan, digest, fresh, now_ms, limits=limits)
    step.write(
        RUN,
        run_id=event.run_id,
        shard=event.shard,
        definition=plan.name,
        version=plan.version,
        digest=digest,
        status=RunStatus.RUNNING.value,
        context=dumps(dict(event.context)),
        tenant=event.tenant,
        epoch="1",
        created_at=str(now_ms),
        engine_version=ENGINE_VERSION,  # invariant 8: the run pins the engine that created it ...
    )
    if event.versions:  # ... and the versions recorded beside its plan (not in the digest)
        step.write(RUN, plan_versions=dumps(dict(event.versions)))
    by: dict[str, Any] = {"requested_by": event.requested_by} if event.requested_by else {}
    step.record("run.started", definition=plan.name, digest=digest, **by)
    if plan.run_deadline_ms:
        step.set_timer(Clock.RUN, "", ids.run_fence(1), plan.run_deadline_ms)
    problems = door.start_problems(plan, digest, event.context, limits, fresh)
    if problems:
        step.set_intent(Intent.FAILED, "; ".join(problems))
    else:
        step.enter(None, plan.entry)
    return step.decision(create=True)


def _stage_result(step: Step, event: StageResult) -> Decision:
    run = step.run
    stage = _reported_on(step, event)
    if isinstance(stage, Decision):
        return stage
    rec = run.stages[event.stage]  # dispatched: _reported_on found its record
    if event.cancelled and rec.fence == event.fence and rec.status in FENCED_OFF:
        item = {} if event.item is None else {"item": event.item}
        step.record("cancellation.acknowledged", event.stage, event.attempt, fence=event.fence, **item)
        return step.decision(Verdict.LATE)
    if run.intent is not None:
        return rejected(
            Verdict.LATE, f"the run already has the {run.intent.value} intent", event.stage, event.attempt
        )
    if rec.fence != event.fence:
        return rejected(
            Verdict.STALE, f"fence {event.fence} is not the current {rec.fence}", event.stage, event.attempt
        )
    if isinstance(stage, Bag):
        return _map_item(step, stage, rec, event)  # a map's items count their own attempts
    if event.attempt != rec.attempt:
        return rejected(
            Verdict.STALE,
            f"attempt {event.attempt} is not the current {rec.attempt}",
            event.stage,
            event.attempt,
        )
    if rec.status not in ACTIVE_STAGE_STATUSES:
        return rejected(
            Verdict.DUPLICATE, f"the attempt is already {rec.status.value}", event.stage, event.attempt
        )
    step.guard(event.stage, rec)
    breach = _breach(step, stage.contract, event.ok, event.result)
    if event.ok and breach is None:
        step.set_stage(
            event.stage,
            StageRecord(
                StageStatus.COMPLETED,
                rec.attempt,
                rec.fence,
                result=event.result,
                completed_at=step.done_at(stage),
            ),
        )
        step.record("stage.completed", event.stage, rec.attempt)
        step.clear_attempt_clocks(event.stage, rec.fence)
        step.enter(event.stage, stage.on_success)
    else:
        error = breach or sizes.bounded(event.error or "the worker reported a failure without a message")
        retryable = event.retryable and breach is None
        step.record(
            "stage.failed", event.stage, rec.attempt, error=error, retryable=retryable, **_cause(breach)
        )
        step.fail_attempt(event.stage, stage, rec, error, retryable=retryable)
    return step.decision()


def _breach(step: Step, ref: str, ok: bool, result: Any) -> str | None:
    """Why a successful report's result breaks the output contract its plan pins for ``ref`` (None: it
    fits, or the report is a failure). A breach fails the attempt for good, as the worker SDK reports
    its own handler's breach: no retry mends a handler that breaks its contract."""
    return outputs.output_problem(step.plan, ref, result) if ok else None


def _cause(breach: str | None) -> dict[str, Any]:
    """The history detail that tells a contract breach found here from a failure a worker reported."""
    return {} if breach is None else {"reason": "contract"}


def _reported_on(step: Step, event: StageResult) -> Work | Decision:
    """The work stage ``event`` reports on, or why it reports on no task this run dispatched."""
    stage = step.plan.stages.get(event.stage)
    if stage is None or event.stage not in step.run.stages:
        return rejected(Verdict.INVALID, f"stage {event.stage!r} was never dispatched", event.stage)
    if not isinstance(stage, Work):
        why = f"{event.stage!r} is a {stage.type}; no worker reports on it"
        return rejected(Verdict.INVALID, why, event.stage)
    item = event.item if isinstance(stage, Bag) else None
    task = ids.stage_task_id(step.run.run_id, event.stage, event.fence, item, event.attempt)
    if event.message_id != ids.result_id(task):
        return _not_a_report(event.message_id, task, event.stage, event.attempt)
    return stage


def _map_item(step: Step, stage: Bag, rec: StageRecord, event: StageResult) -> Decision:
    if rec.status not in ACTIVE_STAGE_STATUSES:
        return rejected(
            Verdict.DUPLICATE, f"the map is already {rec.status.value}", event.stage, event.attempt
        )
    if event.item is None or event.item < 0 or (rec.items is not None and event.item >= rec.items):
        return rejected(Verdict.INVALID, "a map item result must name its item", event.stage)
    if rec.sent is not None and event.item >= rec.sent:
        why = f"item {event.item} was not sent yet (the bag has sent items 0 to {rec.sent - 1})"
        return rejected(Verdict.INVALID, why, event.stage, event.attempt)
    current = step.run.item_attempts.get(f"{event.stage}:{event.item}", 1)
    if event.attempt != current:
        why = f"item {event.item} attempt {event.attempt} is not the current {current}"
        return rejected(Verdict.STALE, why, event.stage, event.attempt)
    item_key = Key("item", f"{event.stage}:{event.item}")
    step.expect(item_key, "attempt", None if current == 1 else str(current))
    breach = _breach(step, stage.contract, event.ok, event.result)
    if not event.ok or breach is not None:
        step.guard(event.stage, rec)
        step.absent.append((Key("barrier", event.stage), str(event.item)))  # an item that arrived stays
        reported = breach or sizes.bounded(event.error or "the worker reported a failure without a message")
        error = f"item {event.item}: {reported}"
        step.record("stage.failed", event.stage, current, item=event.item, error=reported, **_cause(breach))
        if event.retryable and breach is None and current < stage.retry.max_attempts:
            step.retry_item(event.stage, stage, rec, event.item, current)
        else:
            step.fail_attempt(event.stage, stage, rec, error, retryable=False)
        return step.decision()
    # Arrivals commute: checked against the map's own fence and status (another actor may have ended it
    # under the same fence: a deadline, an item's last failure) and the item's attempt, never the whole run.
    step.expect(Key("stage", event.stage), "fence", rec.fence)
    step.expect(RUN, "intent", None)
    step.expect(Key("stage", event.stage), "status", rec.status.value)
    release = step.release(event.stage, rec.fence)
    step.arrival = Arrival(
        Key("barrier", event.stage),
        str(event.item),
        release,
        result=result_text(event.result),
        refill=_refill_due(step, event.stage, rec),
    )
    return step.decision()


def _refill_due(step: Step, name: str, rec: StageRecord) -> Refill | None:
    """A chunked bag with items still to send: its next chunk goes out with the arrival that leaves half
    a window of the sent items in flight. The arrival holds only while the bag has sent what we read (a
    refill applied meanwhile moves the mark: the arrival is decided again)."""
    if rec.sent is None or rec.items is None or rec.sent >= rec.items:
        return None
    step.expect(Key("stage", name), "sent", str(rec.sent))
    return Refill(step.refill_at(rec, rec.sent), rec.items, step.refill(name, rec.fence, rec.sent))


def _bag_refill(step: Step, event: BagRefill) -> Decision:
    run = step.run
    rec = run.stages.get(event.stage)
    stage = step.plan.stages.get(event.stage)
    if not isinstance(stage, Bag) or rec is None:
        return rejected(Verdict.INVALID, f"{event.stage!r} is not a bag of this run", event.stage)
    closed = _closed_to(step, rec, event.stage, event.fence, "bag")
    if closed is not None:
        return closed
    if event.message_id != ids.refill_id(run.run_id, event.stage, event.fence, event.sent):
        why = f"message {event.message_id} is not the refill of bag {event.stage!r} from item {event.sent}"
        return rejected(Verdict.INVALID, why, event.stage)
    if rec.sent != event.sent:
        why = f"the bag has sent {rec.sent} of its {rec.items} items; this refill was for {event.sent}"
        return rejected(Verdict.DUPLICATE, why, event.stage)
    step.guard(event.stage, rec)
    step.expect(Key("stage", event.stage), "sent", str(event.sent))
    step.send_items(event.stage, stage, rec, event.sent)
    return step.decision()


def _closed_to(step: Step, rec: StageRecord, name: str, fence: str, what: str) -> Decision | None:
    """Why a continuation a barrier sent itself (its release, a bag's refill) no longer applies: the run
    has an intent, the barrier was re-opened under another fence, or it is settled. None: it applies."""
    if step.run.intent is not None:
        return rejected(Verdict.LATE, f"the run already has the {step.run.intent.value} intent", name)
    if rec.fence != fence:
        return rejected(Verdict.STALE, f"fence {fence} is not the current {rec.fence}", name)
    if rec.status not in ACTIVE_STAGE_STATUSES:
        return rejected(Verdict.DUPLICATE, f"the {what} is already {rec.status.value}", name)
    return None


def _barrier_released(step: Step, event: BarrierReleased) -> Decision:
    run = step.run
    rec = run.stages.get(event.stage)
    stage = step.plan.stages.get(event.stage)
    if not isinstance(stage, (Join, Bag)) or rec is None:
        return rejected(Verdict.INVALID, f"{event.stage!r} is not a barrier of this run", event.stage)
    closed = _closed_to(step, rec, event.stage, event.fence, "barrier")
    if closed is not None:
        return closed
    if event.message_id != ids.release_id(run.run_id, event.stage, event.fence):
        why = f"message {event.message_id} is not the release of barrier {event.stage!r} (fence {rec.fence})"
        return rejected(Verdict.INVALID, why, event.stage)
    remaining = run.barriers.get(event.stage)
    if remaining != 0:
        why = f"barrier {event.stage!r} still waits for {remaining} arrival(s); only its last one releases it"
        return rejected(Verdict.INVALID, why, event.stage)
    step.expect(Key("counter", event.stage), "remaining", "0")
    step.guard(event.stage, rec)
    if isinstance(stage, Join):
        step.release_join(event.stage, stage, rec)
        return step.decision()
    bag = stage
    result = run.map_results.get(event.stage)
    if result is not None and sizes.body_bytes({"result": result}) > step.limits.max_transition_bytes:
        why = (
            f"its {len(result):,} item results together are over the "
            f"{step.limits.max_transition_bytes:,}-byte limit for one transition (SAGA_MAX_TRANSITION_BYTES)"
        )
        step.fail_attempt(event.stage, bag, rec, why, retryable=False)
        return step.decision()
    step.set_stage(
        event.stage,
        StageRecord(
            StageStatus.COMPLETED, rec.attempt, rec.fence, result=result, completed_at=step.done_at(bag)
        ),
    )
    step.clear_attempt_clocks(event.stage, rec.fence)
    step.record("stage.completed", event.stage, rec.attempt)
    step.enter(event.stage, stage.on_success)
    return step.decision()


def _compensation_result(step: Step, event: CompensationResult) -> Decision:
    run = step.run
    label = ids.compensation_label(event.stage)
    refused = _not_the_current_compensation(step, event, label)
    if refused is not None:
        return refused
    step.expect(RUN, "compensation_index", str(run.compensation_index))
    step.expect(RUN, "status", run.status.value)
    rec = run.stages[event.stage]
    breach = _breach(step, step.plan.compensable[event.stage], event.ok, event.result)
    if event.ok and breach is None:
        step.set_stage(event.stage, dataclasses.replace(rec, status=StageStatus.COMPENSATED))
        step.record("compensation.completed", label)
    else:
        # never silently skipped: the stage stays completed (its effect may remain) and the run says so
        step.write(RUN, compensation_failed="1")
        error = breach or sizes.bounded(event.error or "no message")
        step.record("compensation.failed", label, error=error, **_cause(breach))
    if run.status is RunStatus.FAILED:
        # a poison message failed the run while this undo was in flight: its outcome is recorded (a
        # re-drive waits for it), and nothing else starts
        step.removes.append((RUN, "phase"))
        return step.decision()
    step.start_compensation(run.compensations, event.index + 1)
    return step.decision()


def _not_the_current_compensation(step: Step, event: CompensationResult, label: str) -> Decision | None:
    """Why a compensation report is not the one the run waits for (None: it is). A run that a poison
    message failed while compensating still takes the report of the undo that was in flight."""
    run = step.run
    poisoned = run.status is RunStatus.FAILED and run.phase == "compensating"
    compensating = run.status is RunStatus.FINALISING and run.intent is not None
    if not run.compensations or not (compensating or poisoned):
        return rejected(Verdict.DUPLICATE, f"the run is {run.status.value}, not compensating", label)
    current = ids.compensation_fence(run.epoch, run.compensation_index)
    if event.index != run.compensation_index or event.fence != current:
        verdict = Verdict.DUPLICATE if event.index < run.compensation_index else Verdict.STALE
        return rejected(verdict, f"compensation {event.index} is not the current one", label)
    if run.compensations[event.index] != event.stage:
        return rejected(Verdict.INVALID, f"compensation {event.index} is not for {event.stage!r}", label)
    task = ids.task_id(run.run_id, label, event.fence)
    if event.message_id != ids.result_id(task):
        return _not_a_report(event.message_id, task, label, None)
    return None


def _finaliser_result(step: Step, event: FinaliserResult) -> Decision:
    run = step.run
    name = ids.finaliser_label(event.index)
    if run.status is not RunStatus.FINALISING or run.intent is None:
        return rejected(Verdict.DUPLICATE, f"the run is {run.status.value}, not finalising", name)
    current = ids.finaliser_fence(run.epoch, run.finaliser_index)
    if event.index != run.finaliser_index or event.fence != current:
        verdict = Verdict.DUPLICATE if event.index < run.finaliser_index else Verdict.STALE
        return rejected(verdict, f"finaliser {event.index} is not the current one", name)
    task = ids.task_id(run.run_id, name, event.fence)
    if event.message_id != ids.result_id(task):
        return _not_a_report(event.message_id, task, name, None)
    step.expect(RUN, "finaliser_index", str(run.finaliser_index))
    step.expect(RUN, "status", RunStatus.FINALISING.value)
    breach = _breach(step, step.plan.finalisers[event.index], event.ok, event.result)
    if event.ok and breach is None:
        step.record("finaliser.completed", name)
    else:
        step.write(RUN, finaliser_failed="1")
        error = breach or sizes.bounded(event.error or "no message")
        step.record("finaliser.failed", name, error=error, **_cause(breach))
    step.start_finaliser(event.index + 1)
    return step.decision()


def _not_a_report(message_id: str, task: str, label: str, attempt: int | None) -> Decision:
    """A report's id is derived from its task's id (``ids.result_id``), which names the run, stage,
    fence and item: a message whose id does not match what it claims to answer is refused, however
    well it names the current attempt."""
    why = f"message {message_id} is not the report of task {task}, which its fields name"
    return rejected(Verdict.INVALID, why, label, attempt)


# What each event of an existing run means (a start is handled before a run exists).
_HANDLERS: dict[type, Callable[[Step, Any], Decision]] = {
    StageResult: _stage_result,
    BarrierReleased: _barrier_released,
    BagRefill: _bag_refill,
    FinaliserResult: _finaliser_result,
    CompensationResult: _compensation_result,
    StageAccepted: liveness.accepted,
    StageHeartbeat: liveness.heartbeat,
    TimerFired: liveness.timer_fired,
    CancelRun: liveness.cancel_run,
    Nudge: nudge.nudge,
    Redrive: redrive.redrive,
}


def dispatched_contract(plan: Plan, event: Event) -> str | None:
    """The contract (``name@version``) ``plan`` sends the task ``event`` reports on to (None: not a
    report, or one naming no task of the plan, refused on its own)."""
    if isinstance(event, FinaliserResult):
        return plan.finalisers[event.index] if 0 <= event.index < len(plan.finalisers) else None
    if isinstance(event, CompensationResult):
        return plan.compensable.get(event.stage)
    if isinstance(event, (StageResult, StageAccepted, StageHeartbeat)):
        stage = plan.work(event.stage)
        return stage.contract if stage is not None else None
    return None

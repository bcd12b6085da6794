"""Events about an attempt's liveness and the run's clocks: acceptance, heartbeats, fired timers and
cancellation requests.

Exactly one outcome per (run, stage, attempt): a result and a timeout for the same attempt both expect the
attempt's fence and status, so whichever commits first wins and the other is then stale. A fired timer
also claims its member in the shard's timer set, so a timer that was moved (a heartbeat) or cleared
(the result won) cannot act.
"""

from __future__ import annotations

from orchestrator.engine import clocks
from orchestrator.engine.builder import rejected
from orchestrator.engine.model import (
    ACTIVE_STAGE_STATUSES,
    FENCED_OFF,
    CancelRun,
    Clock,
    Decision,
    Intent,
    Key,
    RunStatus,
    StageAccepted,
    StageHeartbeat,
    StageRecord,
    StageStatus,
    TimerFired,
    Verdict,
)
from orchestrator.engine.plan import Bag, Work
from orchestrator.engine.step import Step
from orchestrator.wire import ids


def _attempt_problem(step: Step, stage: str, fence: str) -> tuple[Verdict, str] | None:
    """Why an acceptance or heartbeat names no live attempt (None: it does)."""
    rec = step.run.stages.get(stage)
    plan_stage = step.plan.work(stage)
    if rec is None or plan_stage is None or not plan_stage.needs_acceptance:
        return Verdict.INVALID, f"stage {stage!r} has no attempt that reports acceptance"
    if rec.fence != fence:
        return Verdict.STALE, f"fence {fence} is not the current {rec.fence}"
    if step.run.intent is not None:
        return Verdict.LATE, f"the run already has the {step.run.intent.value} intent"
    if rec.status not in ACTIVE_STAGE_STATUSES:
        return Verdict.LATE, f"the attempt is already {rec.status.value}"
    return None


def _recancel(step: Step, stage: str, fence: str, cause: str) -> None:
    """A worker is working on an attempt the orchestrator gave up on: it missed the cancel, say it again."""
    rec = step.run.stages.get(stage)
    if rec is not None and rec.fence == fence and rec.status in FENCED_OFF:
        step.request_cancel(stage, fence, cause)


def accepted(step: Step, event: StageAccepted) -> Decision:
    """The attempt started: its queue clock stops, its execution and heartbeat clocks start. The id of an
    acceptance is a function of the attempt, so a redelivered task's second acceptance is a duplicate."""
    if event.message_id != ids.acceptance_id(step.run.run_id, event.stage, event.fence):
        why = f"message {event.message_id} is not the acceptance of {event.stage!r} fence {event.fence}"
        return rejected(Verdict.INVALID, why, event.stage, event.attempt)
    problem = _attempt_problem(step, event.stage, event.fence)
    if problem is not None:
        _recancel(step, event.stage, event.fence, event.message_id)
        return step.reject(problem[0], problem[1], event.stage, event.attempt)
    rec = step.run.stages[event.stage]
    if rec.status is StageStatus.RUNNING:  # our acceptances repeat their id; another sender's might not
        return step.reject(Verdict.DUPLICATE, "the attempt was already accepted", event.stage, event.attempt)
    stage = step.plan.stages[event.stage]
    assert isinstance(stage, Work)  # _attempt_problem found a work stage of that name
    step.guard(event.stage, rec)
    step.set_stage(event.stage, StageRecord(StageStatus.RUNNING, rec.attempt, rec.fence))
    step.clear_timer(Clock.QUEUE, event.stage, rec.fence)
    if stage.execution_deadline_ms:
        step.set_timer(Clock.EXECUTION, event.stage, rec.fence, stage.execution_deadline_ms)
    _start_heartbeat_clock(step, event.stage, stage, rec.fence)
    step.record("stage.accepted", event.stage, rec.attempt)
    return step.decision()


def heartbeat(step: Step, event: StageHeartbeat) -> Decision:
    """Moves the heartbeat deadline (from now: a queue that lags must not time a live attempt out);
    nothing in history (a long task beats often), nothing remembered in the applied set. Only a beat sent
    after the latest one applied to the attempt counts, by the time it was sent: a copy sent again, or a
    beat overtaken by a later one, keeps no attempt alive. A worker that takes the task over after a
    crash sends later beats, whatever it counts them as."""
    step.remember = False
    if not ids.is_heartbeat_id(event.message_id, step.run.run_id, event.stage, event.fence):
        # only the attempt's own beats keep it alive; a forged one is recorded like any refusal
        why = f"message {event.message_id} is not a heartbeat of {event.stage!r} fence {event.fence}"
        return rejected(Verdict.INVALID, why, event.stage, event.attempt)
    problem = _attempt_problem(step, event.stage, event.fence)
    if problem is not None:
        _recancel(step, event.stage, event.fence, event.message_id)  # the heartbeat's reply: stop
        return step.decision(problem[0])
    rec = step.run.stages[event.stage]
    sent = event.issued_at_ms
    if sent is not None and sent <= _latest_beat(rec):
        return step.decision(Verdict.DUPLICATE)
    step.guard(event.stage, rec)
    if sent is not None:
        step.expect(Key("stage", event.stage), "beat", rec.beat)
        step.write(Key("stage", event.stage), beat=f"{rec.fence}|{sent}")
    _start_heartbeat_clock(step, event.stage, step.plan.work(event.stage), rec.fence)
    return step.decision()


def _latest_beat(rec: StageRecord) -> int:
    """When the latest beat of the record's own attempt was sent (-1: none yet; a former attempt's)."""
    fence, _, sent = (rec.beat or "").rpartition("|")
    return int(sent) if fence == rec.fence and sent.isdigit() else -1


def _start_heartbeat_clock(step: Step, name: str, stage: Work | None, fence: str) -> None:
    if stage is not None and stage.heartbeat_timeout_ms:
        step.set_timer(Clock.HEARTBEAT, name, fence, stage.heartbeat_timeout_ms)


def timer_fired(step: Step, event: TimerFired) -> Decision:
    step.remember = False  # the claim on the timer member is the dedupe
    step.claim = event.member
    step.untimers.add(event.member)  # whatever the verdict, this timer is done
    if event.clock is Clock.RUN:
        return _run_deadline(step, event)
    if event.clock is Clock.RETRY and ids.parse_item_label(event.stage) is not None:
        return _item_retry(step, event)
    rec = step.run.stages.get(event.stage)
    stage = step.plan.work(event.stage)
    if rec is None or stage is None or rec.fence != event.fence or step.run.intent is not None:
        return step.decision(Verdict.STALE)  # an older attempt's clock, or the run is ending
    if event.clock is Clock.RETRY:
        if rec.status is not StageStatus.RETRY_SCHEDULED:
            return step.decision(Verdict.STALE)
        step.guard(event.stage, rec)
        step.dispatch(event.stage, stage, rec.attempt + 1)
        return step.decision()
    if rec.status not in _WATCHED_BY[event.clock]:
        return step.decision(Verdict.STALE)
    step.guard(event.stage, rec)
    _time_out(step, event, stage, rec)
    return step.decision()


def _item_retry(step: Step, event: TimerFired) -> Decision:
    """A map item's backoff is over: dispatch its next attempt, if the map still waits for it."""
    parsed = ids.parse_item_label(event.stage)
    name, item = parsed if parsed is not None else ("", 0)
    rec = step.run.stages.get(name)
    attempt = step.run.item_attempts.get(f"{name}:{item}")
    live = rec is not None and rec.fence == event.fence and rec.status in ACTIVE_STAGE_STATUSES
    if rec is None or not live or attempt is None or step.run.intent is not None:
        return step.decision(Verdict.STALE)
    step.guard(name, rec)
    step.expect(Key("item", f"{name}:{item}"), "attempt", str(attempt))
    bag = step.plan.stages.get(name)
    if not isinstance(bag, Bag):
        return step.decision(Verdict.STALE)
    step.dispatch_item(name, bag, rec, item, attempt)
    return step.decision()


# The attempt states each clock watches: a queue clock only until acceptance.
_WATCHED_BY = {
    Clock.QUEUE: frozenset({StageStatus.DISPATCHED}),
    Clock.EXECUTION: ACTIVE_STAGE_STATUSES,
    Clock.HEARTBEAT: frozenset({StageStatus.RUNNING}),
}


def _time_out(step: Step, event: TimerFired, stage: Work, rec: StageRecord) -> None:
    """The attempt is fenced off: a later result from it is stale. The remote work may well still be
    running, so the workers are asked to stop it, and the next attempt (if any) gets a new fence."""
    limit = stage.deadline_ms(event.clock)
    error = clocks.WHAT_EXPIRED[event.clock].format(ms=limit)
    step.record("stage.timed_out", event.stage, rec.attempt, clock=event.clock.value, error=error)
    step.request_cancel(event.stage, rec.fence)
    step.fail_attempt(event.stage, stage, rec, error, retryable=True, status=StageStatus.TIMED_OUT)


def _run_deadline(step: Step, event: TimerFired) -> Decision:
    run = step.run
    current = event.fence == ids.run_fence(run.epoch)
    if not current or run.intent is not None or run.status is not RunStatus.RUNNING:
        return step.decision(Verdict.STALE)
    error = clocks.WHAT_EXPIRED[Clock.RUN].format(ms=step.plan.run_deadline_ms)
    step.record("run.timed_out", error=error)
    step.set_intent(Intent.FAILED, error)
    return step.decision()


def cancel_run(step: Step, event: CancelRun) -> Decision:
    run = step.run
    if run.intent is not None:
        why = f"the run already has the {run.intent.value} intent ({run.reason or 'no reason'})"
        # remembered: a refused request delivered again after a re-drive must not cancel the new epoch
        return rejected(Verdict.LATE, why, None, request=event.message_id, remember=True)
    reason = "cancelled" + (f": {event.reason}" if event.reason else "")
    step.record("cancel.requested", by=event.requested_by, why=event.reason)
    step.set_intent(Intent.FAILED, reason)
    return step.decision()

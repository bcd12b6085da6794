"""The reconciler's nudge: re-send what a stranded run waits for, with the same ids (a task that was only
slow becomes a duplicate), or fail the step whose message can no longer be sent.

A task that no longer fits a message (the limit was lowered after it was committed) is never sent again,
since its reader would only park another copy on saga.rejected: the step fails with the reason instead,
and a compensation or finaliser fails like any other and the next one runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.dsl.binding import bind
from orchestrator.engine.builder import rejected
from orchestrator.engine.model import (
    ACTIVE_STAGE_STATUSES,
    RUN,
    Decision,
    Key,
    Nudge,
    RunStatus,
    StageRecord,
    Verdict,
)
from orchestrator.engine.plan import Bag, Join, Work
from orchestrator.engine.step import Step
from orchestrator.errors import BindingError
from orchestrator.wire import sizes
from orchestrator.wire.outgoing import Outgoing


def nudge(step: Step, event: Nudge) -> Decision:
    """Re-send the tasks a stranded run waits for (a bag's missing items too)."""
    run = step.run
    if run.status in (RunStatus.COMPLETED, RunStatus.FAILED):
        return rejected(Verdict.LATE, f"the run is {run.status.value}", None)
    step.expect(RUN, "status", run.status.value)
    if run.status is RunStatus.FINALISING:
        _resend_ending(step)
    else:
        _resend_work(step)
    if not step.outgoing and not step.writes:
        return rejected(Verdict.INVALID, "nothing to re-send: no attempt is waiting on a worker", None)
    resent = [m.message_id for m in step.outgoing if m.kind in ("task", "barrier.released", "bag.refill")]
    step.record("run.nudged", resent=resent)
    return step.decision()


def _resend_ending(step: Step) -> None:
    """The compensation or finaliser being waited for."""
    run = step.run
    if run.phase == "compensating":
        index = run.compensation_index
        step.expect(RUN, "compensation_index", str(index))
        if step.send_or_why(step.compensation_task(run.compensations[index], index)) is not None:
            step.start_compensation(run.compensations, index)  # fails it with the reason, goes on
        return
    step.expect(RUN, "finaliser_index", str(run.finaliser_index))
    if step.send_or_why(step.finaliser_task(run.finaliser_index)) is not None:
        step.start_finaliser(run.finaliser_index)


@dataclass(frozen=True)
class _CannotSend:
    """A task the run waits for that can no longer be sent (or bound): its stage fails with why."""

    error: str
    attempt: int
    item: int | None = None


def _resend_work(step: Step) -> None:
    """Every open attempt's tasks again, and the release of a barrier that counted its last member but
    whose release never arrived. If one stage's task can no longer be sent, that stage fails and the
    transition does nothing else: its failure may end the run (cancelling the rest) or arrive at a join
    (one arrival per transition); a later nudge takes care of what is left."""
    resend: list[Outgoing] = []
    for name, rec in sorted(step.run.stages.items()):
        stage = step.plan.stages.get(name)
        if rec.status not in ACTIVE_STAGE_STATUSES:
            continue
        if isinstance(stage, (Join, Bag)) and step.run.barriers.get(name) == 0:
            step.guard(name, rec)
            step.expect(Key("counter", name), "remaining", "0")
            resend.append(step.release(name, rec.fence))
            continue
        if isinstance(stage, Bag):
            found = _items_again(step, name, stage, rec)
        elif isinstance(stage, Work):
            found = _task_again(step, name, stage, rec)
        else:
            continue
        if isinstance(found, _CannotSend):
            step.record(
                "stage.failed", name, found.attempt, item=found.item, error=found.error, reason="size"
            )
            step.fail_attempt(name, stage, rec, found.error, retryable=False)
            return
        resend += found
    step.outgoing += resend


def _items_again(step: Step, name: str, stage: Bag, rec: StageRecord) -> list[Outgoing] | _CannotSend:
    """The tasks of a bag's items sent and not arrived, each under its current attempt (same ids: an
    item that was only slow becomes a duplicate), and a chunked bag's refill once it is due (a refill
    already applied is refused as a duplicate)."""
    step.guard(name, rec)
    arrived = step.run.arrivals.get(name, frozenset())
    sent = rec.sent if rec.sent is not None else (rec.items or 0)
    missing = [i for i in range(sent) if str(i) not in arrived]
    refill = []
    if rec.items is not None and sent < rec.items and len(arrived) >= step.refill_at(rec, sent):
        refill = [step.refill(name, rec.fence, sent)]
    try:
        items = bind(stage.items, step.variables(), None, f"{name}.items")
        payloads = [step.bind_input(name, stage, item=items[i], index=i) for i in missing]
    except (BindingError, IndexError, TypeError) as exc:
        return _CannotSend(f"its items cannot be sent again: {exc}", rec.attempt)
    tasks = []
    for index, payload in zip(missing, payloads, strict=True):
        attempt = step.run.item_attempts.get(f"{name}:{index}", 1)
        task = step.stage_task(name, stage, attempt, rec.fence, payload, index)
        problem = sizes.too_big(task.body, step.limits)
        if problem is not None:
            return _CannotSend(f"the task of item {index} cannot be sent: {problem}", attempt, index)
        tasks.append(task)
    return tasks + refill


def _task_again(step: Step, name: str, stage: Work, rec: StageRecord) -> list[Outgoing] | _CannotSend:
    """An attempt's task again, unless it can no longer be sent (the message limit was lowered since,
    or it was committed before tasks were measured): sending it would only park another copy on
    saga.rejected."""
    step.guard(name, rec)
    task = step.resend_task(name, stage, rec)
    problem = sizes.too_big(task.body, step.limits)
    if problem is not None:
        return _CannotSend(f"the task cannot be sent: {problem}", rec.attempt)
    return [task]

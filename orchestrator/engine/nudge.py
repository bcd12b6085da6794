"""The reconciler's nudge: re-send what a stranded run waits for, with the same ids (a task that was only
slow becomes a duplicate), or fail the step whose message can no longer be sent.

A task that no longer fits a message (the limit was lowered after it was committed) is never sent again,
since its reader would only park another copy on saga.rejected: the step fails with the reason instead,
and a compensation or finaliser fails like any other and the next one runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from orchestrator.dsl.binding import bind
from orchestrator.engine import sizes
from orchestrator.engine.builder import rejected
from orchestrator.engine.model import (
    ACTIVE_STAGE_STATUSES,
    RUN,
    Decision,
    Nudge,
    RunStatus,
    StageRecord,
    Verdict,
)
from orchestrator.engine.step import Step
from orchestrator.errors import BindingError


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
    step.record("run.nudged", resent=[m.message_id for m in step.outgoing if m.kind == "task"])
    return step.decision()


def _resend_ending(step: Step) -> None:
    """The compensation or finaliser being waited for."""
    run = step.run
    if run.phase == "compensating":
        index = run.compensation_index
        step.expect(RUN, "compensation_index", str(index))
        task = step.compensation_task(run.compensations[index], index)
        if sizes.too_big(task.body, step.limits) is None:
            step.outgoing.append(task)
        else:
            step.start_compensation(run.compensations, index)  # fails it with the reason, goes on
        return
    step.expect(RUN, "finaliser_index", str(run.finaliser_index))
    task = step.finaliser_task(run.finaliser_index)
    if sizes.too_big(task.body, step.limits) is None:
        step.outgoing.append(task)
    else:
        step.start_finaliser(run.finaliser_index)


def _resend_work(step: Step) -> None:
    for name, rec in sorted(step.run.stages.items()):
        stage = step.plan["stages"].get(name, {})
        if rec.status not in ACTIVE_STAGE_STATUSES:
            continue
        if stage.get("type") in ("action", "worker"):
            _resend(step, name, stage, rec)
        elif stage.get("type") == "map":
            _resend_items(step, name, stage, rec)


def _resend_items(step: Step, name: str, stage: Mapping[str, Any], rec: StageRecord) -> None:
    """Re-send the tasks of a bag's items that have not arrived, each under its current attempt (same
    ids: an item that was only slow becomes a duplicate). One that can no longer be sent, or whose
    input no longer binds, fails the bag with why."""
    step.guard(name, rec)
    arrived = step.run.arrivals.get(name, frozenset())
    missing = [i for i in range(rec.items or 0) if str(i) not in arrived]
    try:
        items = bind(stage["items"], step.variables(), None, f"{name}.items")
        payloads = [step.bind_input(name, stage, item=items[i], index=i) for i in missing]
    except (BindingError, IndexError, TypeError) as exc:
        step.fail_attempt(name, stage, rec, f"its items cannot be sent again: {exc}", retryable=False)
        return
    tasks = []
    for index, payload in zip(missing, payloads, strict=True):
        attempt = step.run.item_attempts.get(f"{name}:{index}", 1)
        task = step.stage_task(name, stage, attempt, rec.fence, payload, index)
        problem = sizes.too_big(task.body, step.limits)
        if problem is not None:
            error = f"the task of item {index} cannot be sent: {problem}"
            step.record("stage.failed", name, attempt, item=index, error=error, reason="size")
            step.fail_attempt(name, stage, rec, error, retryable=False)
            return
        tasks.append(task)
    step.outgoing += tasks


def _resend(step: Step, name: str, stage: Mapping[str, Any], rec: StageRecord) -> None:
    """Re-send an attempt's task, unless it can no longer be sent (the message limit was lowered since,
    or it was committed before tasks were measured): then the attempt fails with why, since sending it
    again would only park another copy on saga.rejected."""
    step.guard(name, rec)
    task = step.resend_task(name, stage, rec)
    problem = sizes.too_big(task.body, step.limits)
    if problem is None:
        step.outgoing.append(task)
        return
    error = f"the task cannot be sent: {problem}"
    step.record("stage.failed", name, rec.attempt, error=error, reason="size")
    step.fail_attempt(name, stage, rec, error, retryable=False)

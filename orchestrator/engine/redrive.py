"""Re-drive: resume a failed run on its pinned plan, in a new epoch.

The plan is walked again from its entry. A work stage that completed in an earlier epoch (and was not
compensated) keeps its result and is not run again, in this transition and in every later one of the new
epoch (``Step.enter``); every other stage reached runs afresh with fences of the new epoch, so any report
still in flight from the old epoch is stale. Compensated stages run again (their effect was undone).
Finalisers run once per epoch, and the run deadline starts again.

A run whose context does not fit its definition's context schema cannot be re-driven: the context is
pinned with the run, so the new epoch could only fail the same way (or worse, complete on input the
definition refuses). The request is refused with the reason; start a new run with a valid context.
"""

from __future__ import annotations

import dataclasses

from orchestrator.engine import ids
from orchestrator.engine.builder import context_problems, rejected
from orchestrator.engine.model import RUN, Clock, Decision, Redrive, RunStatus, Verdict
from orchestrator.engine.step import Step

# Run fields that belong to an epoch's ending, cleared when the run lives again.
ENDING_FIELDS = (
    "intent",
    "reason",
    "finished_at",
    "output",
    "phase",
    "finaliser_index",
    "finaliser_failed",
    "compensations",
    "compensation_index",
    "compensation_failed",
)


def redrive(step: Step, event: Redrive) -> Decision:
    run = step.run
    if run.status is not RunStatus.FAILED:
        why = f"only a failed run can be re-driven; run {run.run_id} is {run.status.value}"
        return rejected(Verdict.INVALID, why, None, request=event.message_id)
    problems = context_problems(step.plan, run.context)
    if problems:
        why = (
            f"run {run.run_id} cannot be re-driven: its context does not fit the definition's context "
            f"schema ({'; '.join(problems)}), and a run keeps its context; start a new run instead"
        )
        return rejected(Verdict.INVALID, why, None, request=event.message_id)
    epoch = run.epoch + 1
    fresh = dataclasses.replace(
        run,
        epoch=epoch,
        status=RunStatus.RUNNING,
        intent=None,
        reason=None,
        output=None,
        phase="",
        finaliser_index=0,
        finaliser_failed=False,
        compensations=(),
        compensation_index=0,
        compensation_failed=False,
    )
    walk = Step(step.plan, step.digest, fresh, step.now_ms, persist=True, limits=step.limits)
    walk.expect(RUN, "status", RunStatus.FAILED.value)
    walk.expect(RUN, "epoch", str(run.epoch))
    walk.removes.extend((RUN, name) for name in ENDING_FIELDS)
    walk.write(RUN, epoch=str(epoch), status=RunStatus.RUNNING.value)
    walk.record(
        "run.redriven", epoch=epoch, by=event.requested_by, why=event.reason, request=event.message_id
    )
    if step.plan.get("run_deadline_ms"):
        walk.set_timer(Clock.RUN, "", ids.run_fence(epoch), step.plan["run_deadline_ms"])
    walk.enter(None, step.plan["entry"])
    return walk.decision()

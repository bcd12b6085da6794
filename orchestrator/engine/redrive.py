"""Re-drive: resume a failed run on its pinned plan, in a new epoch.

The plan is walked again from its entry. A work stage that completed in an earlier epoch (and was not
compensated) keeps its result and is not run again, in this transition and in every later one of the new
epoch (``Step.enter``); every other stage reached runs afresh with fences of the new epoch, so any report
still in flight from the old epoch is stale. Compensated stages run again (their effect was undone).
Finalisers run once per epoch, and the run deadline starts again.

A run whose start cannot pass the door (a context its definition's schema refuses, or that makes a task
too large to send) cannot be re-driven: the context is pinned with the run, so the new epoch could only
fail the same way (or worse, complete on input the definition refuses). The request is refused with the
reason; start a new run instead.

A run marked failed by a poison message ended without the usual fencing: work may still be in flight.
The re-drive fences it first (open attempts cancelled, their clocks cleared, their workers asked to
stop). A compensation in flight is different: its undo may still happen, after any redo, so the re-drive
is refused until that compensation has reported (the engine takes its report on the failed run), unless
the operator says it never will (``undo_lost``: its stage is then taken as undone, and runs again).

Operator requests are remembered even when refused (their ids are random, one per request), so a
refused request that the broker delivers again after the run changed cannot take effect late.
"""

from __future__ import annotations

import dataclasses

from orchestrator.engine import door
from orchestrator.engine.builder import rejected
from orchestrator.engine.model import RUN, Clock, Decision, Redrive, RunStatus, StageStatus, Verdict
from orchestrator.engine.step import Step
from orchestrator.wire import ids

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
        return refused(why, event)
    if run.phase == "compensating" and not event.undo_lost:
        undoing = ids.compensation_label(run.compensations[run.compensation_index])
        why = (
            f"run {run.run_id} was failed by a poison message while {undoing} was in flight: that undo "
            "may still run, so its stage can be neither reused nor run again yet; re-drive once it has "
            "reported (compensation.completed or compensation.failed in the run's history), or, if it "
            "never will (it was the poison message, or its task is lost), with --undo-lost"
        )
        return refused(why, event)
    # the door as at the start: the context alone (the stages' old results are not the new epoch's)
    problems = door.start_problems(
        step.plan, step.digest, run.context, step.limits, dataclasses.replace(run, stages={})
    )
    if problems:
        why = (
            f"run {run.run_id} cannot be re-driven: its start does not pass the door "
            f"({'; '.join(problems)}), and a run keeps its context; start a new run instead"
        )
        return refused(why, event)
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
    walk.cancel_active()  # a poisoned run ended with its work in flight
    if run.phase == "compensating":  # and the operator says its undo in flight will never report
        undoing = run.compensations[run.compensation_index]
        walk.set_stage(undoing, dataclasses.replace(run.stages[undoing], status=StageStatus.COMPENSATED))
        walk.record("compensation.abandoned", ids.compensation_label(undoing), by=event.requested_by)
    if step.plan.run_deadline_ms:
        walk.set_timer(Clock.RUN, "", ids.run_fence(epoch), step.plan.run_deadline_ms)
    walk.enter(None, step.plan.entry)
    return walk.decision()


def refused(why: str, event: Redrive) -> Decision:
    """A refused request, recorded under its id (so the CLI finds the answer) and remembered."""
    return rejected(Verdict.INVALID, why, None, request=event.message_id, remember=True)

"""How a run ends: the terminal intent, then compensations (a failed intent), then finalisers, then the
run's final status and its finished event. Every step of it is measured like any message: a compensation
or finaliser whose task cannot be sent fails with the reason, and the next one runs.
"""

from __future__ import annotations

import json

from orchestrator.dsl.binding import bind
from orchestrator.engine.builder import Builder, dumps
from orchestrator.engine.model import (
    ACTIVE_STAGE_STATUSES,
    RUN,
    Clock,
    Intent,
    Key,
    RunStatus,
    StageRecord,
    StageStatus,
)
from orchestrator.engine.plan import Join
from orchestrator.errors import BindingError
from orchestrator.wire import bodies, ids, sizes
from orchestrator.wire.kinds import Kind
from orchestrator.wire.outgoing import Outgoing

CANCELLABLE = ACTIVE_STAGE_STATUSES | {StageStatus.RETRY_SCHEDULED}


class Ending(Builder):
    """The builder's ending of a run (``Step`` routes into it)."""

    def set_intent(self, intent: Intent, reason: str | None) -> None:
        reason = sizes.bounded(reason) if reason else reason
        if intent is Intent.COMPLETED and self.plan.output is not None:
            try:
                output = bind(self.plan.output, self.variables(), None, "output")
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
            self.cancel_active()
            self.start_compensations()
            return
        self.start_finaliser(0)

    def start_compensations(self) -> None:
        """Undo what the failed run completed: stages that declare ``compensate``, newest first, one at a
        time, before the finalisers. The order is fixed now and stored, so it never changes mid-way."""
        done = []
        for name in self.plan.compensable:
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
            problem = self.send_or_why(task)
            if problem is None:
                return
            self.write(RUN, compensation_failed="1")
            error = f"its task cannot be sent: {problem}"
            self.record("compensation.failed", task.body["stage"], error=error)
        self.start_finaliser(0)

    def compensation_task(self, name: str, index: int) -> Outgoing:
        """The task undoing stage ``name`` (the same message whenever it is built)."""
        stage = self.plan.work(name)
        assert stage is not None, f"{name!r} is a compensable work stage of the plan"
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
        ref = self.plan.compensable[name]
        label = ids.compensation_label(name)
        return self.task(label, ref, self.plan.contracts[ref].queue, 1, fence, undo_input)

    def cancel_active(self) -> None:
        """Fence off every attempt still open (queued, running, waiting for its retry): cancelled, its
        clocks cleared, its workers asked to stop. Its later reports are late or stale."""
        names = set(self.run.stages) | set(self.overlay)
        for name in sorted(names):
            rec = self.stage(name)
            stage = self.plan.stages.get(name)
            if rec is None or rec.status not in CANCELLABLE:
                continue
            # cancel the attempt that was read; one that ended meanwhile conflicts (decided again)
            self.expect(Key("stage", name), "fence", rec.fence)
            self.expect(Key("stage", name), "status", rec.status.value)
            self.clear_attempt_clocks(name, rec.fence)
            if rec.status is StageStatus.RETRY_SCHEDULED:
                self.clear_timer(Clock.RETRY, name, rec.fence)
            self.set_stage(name, StageRecord(StageStatus.CANCELLED, rec.attempt, rec.fence))
            if isinstance(stage, Join) or rec.status is StageStatus.RETRY_SCHEDULED:
                continue  # nothing runs remotely: a barrier just never releases, a retry never starts
            self.record("cancellation.requested", name, rec.attempt, fence=rec.fence)
            self.request_cancel(name, rec.fence)

    def start_finaliser(self, index: int) -> None:
        """Dispatch finaliser ``index`` (or, past the last, finish). One whose task cannot be sent fails
        like any finaliser, and the next one runs: every finaliser is attempted."""
        finalisers = self.plan.finalisers
        for position in range(index, len(finalisers)):
            self.write(RUN, finaliser_index=str(position), phase="finalising")
            task = self.finaliser_task(position)
            label = ids.finaliser_label(position)
            self.record("finaliser.dispatched", label, contract=finalisers[position])
            problem = self.send_or_why(task)
            if problem is None:
                return
            self.write(RUN, finaliser_failed="1")
            self.record("finaliser.failed", label, error=f"its task cannot be sent: {problem}")
        self.finish()

    def finaliser_task(self, index: int) -> Outgoing:
        """Finaliser ``index``'s task (the same message whenever it is built: a re-send is a duplicate)."""
        run_input = {
            "run_id": self.run.run_id,
            "definition": self.plan.name,
            "definition_version": self.plan.version,
            "digest": self.digest,
            "intent": (self.intent or self.run.intent or Intent.FAILED).value,
            "reason": self.reason or self.run.reason,
        }
        fence = ids.finaliser_fence(self.run.epoch, index)
        ref = self.plan.finalisers[index]
        label = ids.finaliser_label(index)
        return self.task(label, ref, self.plan.contracts[ref].queue, 1, fence, run_input)

    def finish(self) -> None:
        intent = self.intent or self.run.intent
        failed = self.run.finaliser_failed or self.writes.get(RUN, {}).get("finaliser_failed") == "1"
        status = RunStatus.COMPLETED if intent is Intent.COMPLETED and not failed else RunStatus.FAILED
        # the phase ends with the run: a run left "compensating" would look poisoned mid-undo
        self.write(RUN, status=status.value, finished_at=str(self.now_ms), phase="")
        self.record(f"run.{status.value}")
        if self.plan.run_deadline_ms:
            self.clear_timer(Clock.RUN, "", ids.run_fence(self.run.epoch))
        written = self.writes.get(RUN, {}).get("output")
        output = json.loads(written) if written else self.run.output
        body = bodies.finished(
            self.run.run_id, self.plan.name, status.value, output, self.reason or self.run.reason
        )
        problem = sizes.too_big(body, self.limits)
        if problem is not None:
            # the run's record keeps the output; the event says where to read it rather than not arrive
            omitted = f"{problem}; read the output with 'saga status {self.run.run_id}'"
            body.update(output=None, output_omitted=omitted)
        self.outgoing.append(
            Outgoing(
                ids.message_id("event", self.run.run_id, status.value, self.run.epoch),
                Kind.FINISHED,
                ("events", f"run.{status.value}.{self.plan.name}"),
                body,
            )
        )
        self.finished = True

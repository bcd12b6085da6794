"""The routing rules: what entering a target means, and how work stages are dispatched and fail.

Routing is recursive: entering a decision evaluates it and enters its target; entering a fork enters
every branch; entering a terminal sets the intent and starts finalisation (``ending.py``). Everything
entered in one transition lands in the same Decision, which the store applies atomically.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from orchestrator.dsl.binding import bind, evaluate
from orchestrator.engine import clocks
from orchestrator.engine.ending import Ending
from orchestrator.engine.model import (
    ACTIVE_STAGE_STATUSES,
    Arrival,
    BarrierInit,
    Clock,
    Intent,
    Key,
    StageRecord,
    StageStatus,
)
from orchestrator.engine.plan import Bag, Fork, Join, Route, Work
from orchestrator.errors import BindingError
from orchestrator.wire import ids, sizes
from orchestrator.wire.outgoing import Outgoing

TERMINALS = frozenset(i.value for i in Intent)


class Step(Ending):
    """One transition under construction: the builder, its ending, and the routing rules."""

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
        stage = self.plan.stages[target]
        if isinstance(stage, Work) and self._reuse(target, stage):
            return
        if isinstance(stage, Join):
            self._arrive(source, target, stage, outcome)
        elif isinstance(stage, Route):
            self._decide(target, stage)
        elif isinstance(stage, Fork):
            self._fork(target, stage)
        elif isinstance(stage, Bag):
            self._map(target, stage)
        else:
            self.dispatch(target, stage, attempt=1)

    def _decide(self, name: str, stage: Route) -> None:
        fence = ids.stage_fence(self.run.epoch, 1)
        previous = self.stage(name)
        self.expect(Key("stage", name), "fence", previous.fence if previous else None)
        variables = self.variables()
        for i, branch in enumerate(stage.branches):
            try:
                taken = evaluate(branch.when, variables, f"{name}.branches[{i}].when")
            except BindingError as exc:
                self.set_stage(name, StageRecord(StageStatus.FAILED, 1, fence, error=str(exc)))
                self.record("decision.failed", name, error=str(exc))
                self.enter(name, stage.on_evaluation_error, "failed", f"evaluation error: {exc}")
                return
            if not isinstance(taken, bool):
                error = f"branch {i} gave {taken!r}, not a boolean"
                self.set_stage(name, StageRecord(StageStatus.FAILED, 1, fence, error=error))
                self.record("decision.failed", name, error=error)
                self.enter(name, stage.on_evaluation_error, "failed", f"evaluation error: {error}")
                return
            if taken:
                self.set_stage(name, StageRecord(StageStatus.COMPLETED, 1, fence, result={"branch": i}))
                self.record("decision.taken", name, branch=i, next=branch.next)
                self.enter(name, branch.next, why=f"branch {i} ({branch.when}) was taken")
                return

    def _reuse(self, name: str, stage: Work) -> bool:
        """A work stage that completed in an earlier epoch (and was not compensated) keeps its result and
        is not run again; the route goes on from it, in whichever transition of the re-driven epoch
        reaches it, not only the re-drive's own walk."""
        rec = self.stage(name)
        if rec is None or rec.status is not StageStatus.COMPLETED:
            return False
        epoch = ids.fence_epoch(rec.fence)
        if epoch is None or epoch >= self.run.epoch:
            return False  # completed in this epoch: the compiler keeps routes from entering it again
        self.expect(Key("stage", name), "fence", rec.fence)
        self.record("stage.reused", name, rec.attempt, from_fence=rec.fence)
        self.enter(name, stage.on_success)
        return True

    def _fork(self, name: str, stage: Fork) -> None:
        fence = ids.stage_fence(self.run.epoch, 1)
        previous = self.run.stages.get(name)  # set in an earlier epoch, when re-driven
        self.expect(Key("stage", name), "fence", previous.fence if previous else None)
        self.set_stage(name, StageRecord(StageStatus.COMPLETED, 1, fence))
        join = stage.join
        init = BarrierInit(Key("barrier", join), len(stage.branches))
        self.barriers.append(init)
        self.set_stage(join, StageRecord(StageStatus.RUNNING, 1, fence))
        self.record("fork.released", name, branches=list(stage.branches))
        for branch in stage.branches:
            self.enter(name, branch)
        early = self.early_arrivals.pop(join, [])
        if early:  # branches that arrived at once are members now; the barrier waits for the rest
            self.barriers.remove(init)
            self.barriers.append(BarrierInit(init.key, init.count - len(early), tuple(early)))
            if len(early) == init.count and self.intent is None:
                self.release_join(join, self._join(join), StageRecord(StageStatus.RUNNING, 1, fence))

    def _join(self, name: str) -> Join:
        stage = self.plan.stages[name]
        assert isinstance(stage, Join), f"{name!r} is a fork's join in the compiled plan"
        return stage

    def _arrive(self, source: str | None, join: str, stage: Join, outcome: str) -> None:
        end = self.plan.stages[source].arrives_at if source else None
        branch = end.branch if end else ""
        if outcome not in stage.acceptable_terminal_states:
            self.record("join.failed", join, branch=branch, outcome=outcome)
            rec = self.stage(join)
            self.set_stage(join, StageRecord(StageStatus.FAILED, 1, rec.fence if rec else "", error=outcome))
            self.enter(join, stage.on_failure, "failed", f"branch {branch!r} arrived {outcome}")
            return
        if any(b.key.name == join for b in self.barriers):
            # the branch arrives in the transition that opens the join: counted by the fork
            self.early_arrivals.setdefault(join, []).append(branch)
            self.record("branch.arrived", join, branch=branch, outcome=outcome, early=True)
            return
        rec = self.stage(join)
        self.record("branch.arrived", join, branch=branch, outcome=outcome)
        if rec is not None and self._last_to_arrive(join, rec):
            # This transition releases the join: the store counts the branch only while the count is
            # still 1, so it is the one call that takes it to 0, and no release message is needed.
            self.expect(Key("counter", join), "remaining", "1")
            self.guard(join, rec)
            self.arrival = Arrival(Key("barrier", join), branch, None)
            self.release_join(join, stage, rec)
            return
        fence = rec.fence if rec else ids.stage_fence(self.run.epoch, 1)
        self.arrival = Arrival(Key("barrier", join), branch, self.release(join, fence))

    def _last_to_arrive(self, join: str, rec: StageRecord) -> bool:
        """Whether the branch arriving now is the last one the open join ``join`` waits for, as read, and
        the join may be released in this transition (``Plan.released_inline``)."""
        return (
            join in self.plan.released_inline
            and self.arrival is None
            and self.run.barriers.get(join) == 1
            and rec.status in ACTIVE_STAGE_STATUSES
            and self.run.intent is None
            and self.intent is None
        )

    def release_join(self, name: str, stage: Join, rec: StageRecord) -> None:
        """Every branch of join ``name`` arrived: it completes (with no result of its own) and its route
        goes on."""
        self.set_stage(name, StageRecord(StageStatus.COMPLETED, rec.attempt, rec.fence))
        self.record("join.released", name, rec.attempt)
        self.enter(name, stage.on_success)

    def _map(self, name: str, stage: Bag) -> None:
        try:
            items = bind(stage.items, self.variables(), None, f"{name}.items")
        except BindingError as exc:
            self.fail_to_start(name, stage, str(exc))
            return
        if not isinstance(items, list):
            self.fail_to_start(name, stage, f"items gave a {type(items).__name__}, not a list")
            return
        if len(items) > stage.max_items:
            self.fail_to_start(
                name, stage, f"items has {len(items)} entries, over max_items {stage.max_items}"
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
            self.enter(name, stage.on_success)
            return
        # a bag larger than the window sends its first chunk now, the rest as items arrive (refill)
        sent = min(len(items), self.limits.bag_window)
        tasks = self._item_tasks(name, stage, fence, items, 0, sent)
        if isinstance(tasks, _Unsendable):
            self.fail_to_start(name, stage, tasks.error, tasks.reason)
            return
        chunked = sent < len(items)
        window = self.limits.bag_window if chunked else None
        record = StageRecord(
            StageStatus.DISPATCHED, 1, fence, items=len(items), sent=sent if chunked else None, window=window
        )
        self.set_stage(name, record)
        if not chunked and previous is not None and previous.sent is not None:
            # chunked in an earlier epoch
            self.removes += [(Key("stage", name), "sent"), (Key("stage", name), "window")]
        self.barriers.append(BarrierInit(Key("barrier", name), len(items)))
        self.outgoing += tasks
        self.record("stage.dispatched", name, 1, items=len(items), queue=stage.queue, **_chunk(sent, items))
        if stage.execution_deadline_ms:  # a bag has one clock: from dispatch to its last item
            self.set_timer(Clock.EXECUTION, name, fence, stage.execution_deadline_ms)

    def send_items(self, name: str, stage: Bag, rec: StageRecord, start: int) -> None:
        """A chunked bag's next chunk: the items from ``start`` on, a window of them at most. Items that
        cannot be bound or sent now fail the bag, as they would have at its start."""
        try:
            items = bind(stage.items, self.variables(), None, f"{name}.items")
        except BindingError as exc:
            items = exc
        if not isinstance(items, list) or len(items) != rec.items:
            why = f"items no longer gives the {rec.items} entries the bag began with ({items})"
            self.record("stage.failed", name, rec.attempt, error=why, reason="binding")
            self.fail_attempt(name, stage, rec, why, retryable=False)
            return
        stop = min(len(items), start + self.window_of(rec))
        tasks = self._item_tasks(name, stage, rec.fence, items, start, stop)
        if isinstance(tasks, _Unsendable):
            self.record("stage.failed", name, rec.attempt, error=tasks.error, reason=tasks.reason)
            self.fail_attempt(name, stage, rec, tasks.error, retryable=False)
            return
        self.set_stage(name, dataclasses.replace(rec, sent=stop))
        self.outgoing += tasks
        self.record("items.dispatched", name, rec.attempt, first=start, last=stop - 1, of=rec.items)

    def _item_tasks(
        self, name: str, stage: Bag, fence: str, items: list[Any], start: int, stop: int
    ) -> list[Outgoing] | _Unsendable:
        """The first-attempt tasks of items ``start`` to ``stop`` - 1, or why they cannot be sent."""
        tasks = []
        for index in range(start, stop):
            try:
                payload = self.bind_input(name, stage, item=items[index], index=index)
            except BindingError as exc:
                return _Unsendable(str(exc), "binding")
            tasks.append(self.stage_task(name, stage, 1, fence, payload, index))
        problem = self.bag_problem(tasks, start)
        return tasks if problem is None else _Unsendable(problem, "size")

    def bag_problem(self, tasks: list[Outgoing], first: int = 0) -> str | None:
        """Why a map's item tasks cannot be sent (None: they can): one is too large for a message, or
        together they are too large for the one transition that sends them (a chunk of the bag)."""
        total = 0
        for index, task in enumerate(tasks, first):
            size = sizes.body_bytes(task.body)
            if size > self.limits.max_body_bytes:
                return f"the task of item {index} cannot be sent: {sizes.too_big(task.body, self.limits)}"
            total += size
            if total > self.limits.max_transition_bytes:
                limit = self.limits.max_transition_bytes
                return (
                    f"its {len(tasks):,} tasks together are over the {limit:,}-byte limit for what one "
                    "transition sends (SAGA_MAX_TRANSITION_BYTES); bind smaller items, or pass large data "
                    "by reference"
                )
        return None

    def dispatch(self, name: str, stage: Work, attempt: int) -> None:
        try:
            payload = self.bind_input(name, stage)
        except BindingError as exc:
            self.fail_to_start(name, stage, str(exc))
            return
        previous = self.stage(name)
        fence = ids.stage_fence(self.run.epoch, attempt)
        problem = self.send_or_why(self.stage_task(name, stage, attempt, fence, payload, None))
        if problem is not None:
            self.fail_to_start(name, stage, f"the task cannot be sent: {problem}", "size")
            return
        self.expect(Key("stage", name), "fence", previous.fence if previous else None)
        self.set_stage(name, StageRecord(StageStatus.DISPATCHED, attempt, fence))
        self.record("stage.dispatched", name, attempt, queue=stage.queue)
        if stage.queue_deadline_ms:
            self.set_timer(Clock.QUEUE, name, fence, stage.queue_deadline_ms)

    def resend_task(self, name: str, stage: Work, rec: StageRecord) -> Outgoing:
        """The current attempt's task again: same id, fence and input (the reconciler's nudge)."""
        return self.stage_task(name, stage, rec.attempt, rec.fence, self.bind_input(name, stage), None)

    def retry_item(self, name: str, stage: Bag, rec: StageRecord, item: int, failed: int) -> None:
        """A map item failed and may pass on another attempt: only it runs again, after its backoff; the
        map's other items and its fence are untouched."""
        label = ids.item_label(name, item)
        delay = clocks.backoff_ms(stage.retry, self.run.run_id, label, failed)
        self.write(Key("item", f"{name}:{item}"), attempt=str(failed + 1))
        self.set_timer(Clock.RETRY, label, rec.fence, delay)
        self.record("retry.scheduled", name, failed, item=item, next_attempt=failed + 1, delay_ms=delay)

    def dispatch_item(self, name: str, stage: Bag, rec: StageRecord, item: int, attempt: int) -> None:
        try:
            items = bind(stage.items, self.variables(), None, f"{name}.items")
            payload = self.bind_input(name, stage, item=items[item], index=item)
        except (BindingError, IndexError, TypeError) as exc:  # the items changed: nothing to retry
            self._fail_item_dispatch(name, stage, rec, item, attempt, str(exc), "binding")
            return
        problem = self.send_or_why(self.stage_task(name, stage, attempt, rec.fence, payload, item))
        if problem is not None:
            error = f"the task cannot be sent: {problem}"
            self._fail_item_dispatch(name, stage, rec, item, attempt, error, "size")
            return
        self.record("item.dispatched", name, attempt, item=item)

    def _fail_item_dispatch(
        self,
        name: str,
        stage: Bag,
        rec: StageRecord,
        item: int,
        attempt: int,
        error: str,
        reason: str,
    ) -> None:
        """A retried item cannot be dispatched: the map fails (another attempt would meet the same)."""
        self.set_stage(name, StageRecord(StageStatus.FAILED, rec.attempt, rec.fence, error=error))
        self.record("stage.failed", name, attempt, item=item, error=error, reason=reason)
        self.enter(name, stage.on_failure, "failed", error)

    def fail_attempt(
        self,
        name: str,
        stage: Work,
        rec: StageRecord,
        error: str,
        *,
        retryable: bool,
        status: StageStatus = StageStatus.FAILED,
    ) -> None:
        """The current attempt failed or timed out: schedule the next attempt through a durable timer if
        the policy allows and the failure may pass, else follow ``on_failure``."""
        self.clear_attempt_clocks(name, rec.fence)
        policy = stage.retry
        if retryable and rec.attempt < policy.max_attempts and not isinstance(stage, Bag):
            delay = clocks.backoff_ms(policy, self.run.run_id, name, rec.attempt)
            waiting = StageRecord(StageStatus.RETRY_SCHEDULED, rec.attempt, rec.fence, error=error)
            self.set_stage(name, waiting)
            self.set_timer(Clock.RETRY, name, rec.fence, delay)
            self.record("retry.scheduled", name, rec.attempt, next_attempt=rec.attempt + 1, delay_ms=delay)
            return
        self.set_stage(name, StageRecord(status, rec.attempt, rec.fence, error=error))
        self.enter(name, stage.on_failure, status.value, error)

    def fail_to_start(self, name: str, stage: Work, error: str, reason: str = "binding") -> None:
        """A stage whose input cannot be bound (``reason`` binding), or whose task(s) cannot be sent
        (``size``), fails without being dispatched, and follows on_failure."""
        previous = self.stage(name)
        fence = ids.stage_fence(self.run.epoch, 1)
        self.expect(Key("stage", name), "fence", previous.fence if previous else None)
        self.set_stage(name, StageRecord(StageStatus.FAILED, 1, fence, error=error))
        self.record("stage.failed", name, 1, error=error, reason=reason)
        self.enter(name, stage.on_failure, "failed", error)


@dataclass(frozen=True)
class _Unsendable:
    """Why a bag's tasks cannot be sent: ``reason`` binding (an input) or size (a message, a chunk)."""

    error: str
    reason: str


def _chunk(sent: int, items: list[Any]) -> dict[str, int]:
    """The history detail of a bag entered in chunks: how many items it sent at once."""
    return {"sent": sent} if sent < len(items) else {}

"""Retries, deadlines, heartbeats and cancellation in the pure engine, with the in-memory store.

The simulator fires timers by moving its clock; tests that need a timer to fire at a particular moment
(before a heartbeat moved it, after the result removed it) build the ``TimerFired`` themselves.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from orchestrator.engine import clocks
from orchestrator.engine.model import (
    CancelRun,
    Clock,
    TimerFired,
    Verdict,
)
from orchestrator.engine.plan import Retry
from orchestrator.store.replies import TIMER_GONE
from tests.conftest import compile_yaml
from tests.unit.engine_sim import Sim, heartbeat, report, typed

PROBE = """
name: probe
version: "1"
entry: render
context: {{ type: object, properties: {{ modelId: {{ type: string }} }}, required: [modelId] }}
{run}
stages:
  - name: render
    type: worker
    worker: thumbnail.render@3
    input: {{ modelId: "${{context.modelId}}" }}
{extra}
    on_success: completed
    on_failure: failed
finalisers: [audit.run-terminal@1]
terminals: [completed, failed]
"""


def probe(*extra: str, run: str = "", **kwargs: Any) -> Sim:
    plan = compile_yaml(PROBE.format(run=run, extra="\n".join(f"    {line}" for line in extra)))
    sim = Sim(plan.plan, plan.digest, **kwargs)
    sim.start({"modelId": "m-1"})
    sim.deliver_at(0)  # the start: render is dispatched
    return sim


def kinds(sim: Sim) -> list[str]:
    return sim.kinds()


def test_a_retryable_failure_waits_its_backoff_then_runs_a_new_attempt_with_a_new_fence() -> None:
    sim = probe(
        "retry: { max_attempts: 3, initial_backoff_ms: 1000, backoff_multiplier: 3 }",
        fail_stages=frozenset({"render"}),
    )
    sim.run()
    assert sim.status == "failed"
    dispatched = sim.entries("stage.dispatched", "render")
    assert [d["attempt"] for d in dispatched] == ["1", "2", "3"]
    fences = [t.body["fence"] for t in sim.tasks if t.body["stage"] == "render"]
    assert fences == ["1.1", "1.2", "1.3"]
    scheduled = sim.entries("retry.scheduled", "render")
    render = typed(sim.plan).work("render")
    assert render is not None
    policy = render.retry
    assert [s["detail"]["delay_ms"] for s in scheduled] == [
        clocks.backoff_ms(policy, sim.run_id, "render", n) for n in (1, 2)
    ]
    # the next attempt went out no earlier than its backoff allowed
    for retry, dispatch in zip(scheduled, dispatched[1:], strict=True):
        assert dispatch["at"] - retry["at"] >= retry["detail"]["delay_ms"]
    assert not sim.store.timers


def test_a_late_report_of_a_retried_attempt_is_stale() -> None:
    sim = probe("retry: { max_attempts: 2, initial_backoff_ms: 10 }", fail_stages=frozenset({"render"}))
    first_task = sim.tasks[0]
    sim.deliver_task("render")  # attempt 1 fails, retry scheduled
    sim.fire_next_timer()  # attempt 2 dispatched
    late = report(sim.run_id, "render", str(first_task.body["fence"]), True, {"thumbnailUri": "x"})
    handled = sim.handle(late)
    assert handled.verdict is Verdict.STALE
    assert sim.record["s:render:status"] == "dispatched" and sim.record["s:render:attempt"] == "2"


def test_a_permanent_failure_is_not_retried() -> None:
    sim = probe("retry: { max_attempts: 5, initial_backoff_ms: 10 }")
    fence = str(sim.tasks[0].body["fence"])
    sim.handle(report(sim.run_id, "render", fence, False, error="bad data", retryable=False))
    assert sim.record["intent"] == "failed"
    assert not sim.entries("retry.scheduled")


def test_a_queue_deadline_times_the_attempt_out_and_its_later_result_is_late() -> None:
    sim = probe("queue_deadline_ms: 500")
    task = sim.pending[0]
    handled = sim.fire_next_timer()
    assert handled.verdict is Verdict.APPLIED
    timed_out = sim.entries("stage.timed_out", "render")
    assert [t["detail"]["clock"] for t in timed_out] == ["queue"]
    assert sim.record["s:render:status"] == "timed-out" and sim.record["intent"] == "failed"
    assert [c.body["stage"] for c in sim.cancels] == ["render"]  # the work may run anyway: ask it to stop
    sim.deliver(task)  # a worker takes it after all
    sim.run()
    assert sim.status == "failed"
    assert {h.verdict for h in sim.handled[-3:]} >= {Verdict.LATE}


def test_a_heartbeat_moves_the_timer_so_an_old_firing_claims_nothing() -> None:
    sim = probe("heartbeat_timeout_ms: 900")
    sim.deliver_where(lambda d: d.kind == "task")
    sim.deliver_where(lambda d: d.kind == "event" and type(d.event).__name__ == "StageAccepted")
    member = clocks.member(sim.run_id, Clock.HEARTBEAT, "render", "1.1")
    first_due = sim.store.timers[member]
    sim.clock += 500  # half-way to the deadline, the handler beats
    sim.handle(heartbeat(sim.run_id, "render", "1.1"))
    assert sim.store.timers[member] > first_due
    sim.clock = first_due  # the timer loop read the old due time and fires now
    handled = sim.handle(TimerFired(f"timer-{member}", Clock.HEARTBEAT, "render", "1.1", member))
    assert handled.code == TIMER_GONE
    assert sim.record["s:render:status"] == "running"
    assert not sim.entries("stage.timed_out")
    assert "heartbeat" not in " ".join(kinds(sim))  # heartbeats leave no trace in history


def test_a_heartbeat_sent_again_or_overtaken_keeps_no_attempt_alive() -> None:
    sim = probe("heartbeat_timeout_ms: 900")
    sim.deliver_where(lambda d: d.kind == "task")
    sim.deliver_where(lambda d: d.kind == "event" and type(d.event).__name__ == "StageAccepted")
    member = clocks.member(sim.run_id, Clock.HEARTBEAT, "render", "1.1")
    start = sim.clock
    sim.clock += 300
    beat = heartbeat(sim.run_id, "render", "1.1", beat=2, issued_at_ms=start + 290)
    assert sim.handle(beat).verdict is Verdict.APPLIED
    due = sim.store.timers[member]
    # When the same beat is sent again later, and one sent before it arrives after it
    sim.clock += 300
    copy = sim.handle(beat)
    overtaken = sim.handle(heartbeat(sim.run_id, "render", "1.1", beat=1, issued_at_ms=start + 100))
    # Then neither moves the deadline: a replayed beat keeps no dead attempt alive
    assert copy.verdict is overtaken.verdict is Verdict.DUPLICATE
    assert sim.store.timers[member] == due
    # And a beat sent later does, from when it arrives (a lagging queue times no live attempt out),
    # whatever number it has (a worker that took the task over after a crash counts from 1 again)
    later = sim.handle(heartbeat(sim.run_id, "render", "1.1", beat=1, issued_at_ms=start + 400))
    assert later.verdict is Verdict.APPLIED
    assert sim.store.timers[member] == sim.clock + 900
    assert "heartbeat" not in " ".join(kinds(sim))  # still nothing in history


def test_a_new_attempt_takes_beats_afresh() -> None:
    sim = probe("heartbeat_timeout_ms: 900", "retry: { max_attempts: 2, initial_backoff_ms: 10 }")
    sim.deliver_where(lambda d: d.kind == "task")
    sim.deliver_where(lambda d: d.kind == "event" and type(d.event).__name__ == "StageAccepted")
    sim.handle(heartbeat(sim.run_id, "render", "1.1", issued_at_ms=sim.clock + 10_000))  # clock ahead
    sim.fire_next_timer()  # no beat for 900 ms: the attempt times out, a retry is scheduled
    sim.fire_next_timer()  # attempt 2 dispatched, fence 1.2
    sim.deliver_where(lambda d: d.kind == "task")
    sim.deliver_where(lambda d: d.kind == "event" and type(d.event).__name__ == "StageAccepted")
    assert sim.record["s:render:fence"] == "1.2"
    beat = heartbeat(sim.run_id, "render", "1.2", issued_at_ms=sim.clock)
    assert sim.handle(beat).verdict is Verdict.APPLIED


def test_a_result_that_beat_its_timer_leaves_the_timer_nothing_to_do() -> None:
    sim = probe("execution_deadline_ms: 1000", "queue_deadline_ms: 1000")
    sim.deliver_task("render")  # accepted, then completed
    assert sim.entries("stage.completed", "render")
    queue = clocks.member(sim.run_id, Clock.QUEUE, "render", "1.1")
    execution = clocks.member(sim.run_id, Clock.EXECUTION, "render", "1.1")
    assert queue not in sim.store.timers and execution not in sim.store.timers
    sim.clock += 10_000
    handled = sim.handle(TimerFired(f"timer-{execution}", Clock.EXECUTION, "render", "1.1", execution))
    assert handled.code == TIMER_GONE and not sim.entries("stage.timed_out")


def test_the_run_deadline_fails_the_run_and_cancels_the_running_stage() -> None:
    sim = probe(run="run_deadline_ms: 2000")
    sim.fire_next_timer()
    assert sim.record["intent"] == "failed" and sim.record["reason"] == "run deadline of 2000 ms passed"
    assert sim.record["s:render:status"] == "cancelled"
    assert [c.body["stage"] for c in sim.cancels] == ["render"]
    sim.run()
    assert sim.status == "failed" and sim.entries("finaliser.completed")


def test_cancelling_a_run_sets_the_failed_intent_once_and_a_second_request_is_late() -> None:
    sim = probe()
    first = sim.handle(CancelRun("cancel-1", "operator says stop", "ops@host"))
    assert first.verdict is Verdict.APPLIED
    assert sim.record["reason"] == "cancelled: operator says stop"
    requested = sim.entries("cancel.requested")
    assert requested[0]["detail"] == {"by": "ops@host", "why": "operator says stop"}
    second = sim.handle(CancelRun("cancel-2", "again"))
    assert second.verdict is Verdict.LATE
    # the worker stops and says so: recorded as the acknowledgement, not applied
    fence = str(sim.tasks[0].body["fence"])
    ack = sim.handle(report(sim.run_id, "render", fence, False, error="cancelled", cancelled=True))
    assert ack.verdict is Verdict.LATE
    assert sim.entries("cancellation.acknowledged", "render")
    sim.run()
    assert sim.status == "failed"


@given(
    initial=st.integers(0, 100_000),
    multiplier=st.floats(1.0, 10.0),
    cap=st.integers(0, 1_000_000),
    jitter=st.floats(0.0, 1.0),
    attempt=st.integers(1, 30),
    run_id=st.text(max_size=20),
)
def test_backoff_is_capped_exponential_minus_at_most_its_jitter_and_deterministic(
    initial: int, multiplier: float, cap: int, jitter: float, attempt: int, run_id: str
) -> None:
    policy = Retry(
        initial_backoff_ms=initial, backoff_multiplier=multiplier, max_backoff_ms=cap, jitter=jitter
    )
    delay = clocks.backoff_ms(policy, run_id, "s", attempt)
    nominal = min(float(cap), initial * multiplier ** (attempt - 1))
    assert int(nominal * (1 - jitter)) - 1 <= delay <= nominal
    assert delay == clocks.backoff_ms(policy, run_id, "s", attempt)


@given(st.text(), st.sampled_from(list(Clock)), st.text(), st.text(alphabet="0123456789.frun", max_size=8))
def test_timer_members_round_trip(run_id: str, clock: Clock, stage: str, fence: str) -> None:
    parsed = clocks.parse_member(clocks.member(run_id, clock, stage, fence))
    if "|" in stage or "|" in fence:
        return  # stage names and fences never hold the separator (the compiler's name rules)
    assert parsed == (run_id, clock, stage, fence)


# ---- an acceptance that may wait ---------------------------------------------------------------------


def test_only_a_stage_without_a_queue_clock_lets_its_acceptance_wait() -> None:
    report = probe("execution_deadline_ms: 1000").pending[0].task.body["report"]  # type: ignore[union-attr]
    assert report == {"accept": True, "heartbeat_ms": None, "accept_after_ms": 50}
    timed = probe("execution_deadline_ms: 1000", "queue_deadline_ms: 1000").pending[0].task
    assert timed is not None  # its queue clock stops when the handler starts: no wait
    assert "accept_after_ms" not in timed.body["report"]


def test_a_result_without_an_acceptance_completes_the_attempt_and_clears_every_clock() -> None:
    sim = probe("execution_deadline_ms: 1000", "heartbeat_timeout_ms: 900")
    delivery = sim.pending.pop(0)
    assert delivery.task is not None
    handled = sim.handle(sim.work(delivery.task))  # the handler returned before its acceptance was due
    assert handled.verdict is Verdict.APPLIED
    assert sim.entries("stage.completed", "render") and not sim.entries("stage.accepted")
    assert not [m for m in sim.store.timers if "render" in m]
    sim.run()
    assert sim.status == "completed"

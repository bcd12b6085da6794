"""The reconciler's nudge in the pure engine: it re-sends what a stranded run waits for (tasks, a bag's
missing items, a barrier's lost release) and fails a step whose message can no longer be sent, one
failure per transition (engine/nudge.py)."""

from __future__ import annotations

from unittest import mock

from orchestrator.engine.model import BarrierReleased, Nudge
from orchestrator.engine.step import Step
from orchestrator.wire import sizes
from tests.conftest import compile_yaml
from tests.unit.engine_sim import Sim
from tests.unit.redrive_cases import compiled, drive, in_order

TWO_BRANCHES = """
    name: two-branches
    version: "1.0.0"
    entry: split
    stages:
      - name: split
        type: fork
        branches: [a, b]
      - name: a
        type: worker
        queue: metadata
        worker: metadata.extract@2
        input: { modelId: "${context.modelId}" }
        on_success: meet
        on_failure: meet
      - name: b
        type: worker
        queue: analysis
        worker: semantic.analyse@4
        input: { modelId: "${context.modelId}" }
        on_success: meet
        on_failure: meet
      - name: meet
        type: join
        required: [a, b]
        acceptable_terminal_states: [completed, failed]
        on_success: completed
"""


def test_a_lost_release_is_sent_again_for_a_join_and_for_a_bag() -> None:
    for name, context, barrier in (
        ("model-ingest", {"modelId": "m-1"}, "derive-join"),
        ("thumbnail-batch", {"modelIds": ["a", "b"]}, "render-all"),
    ):
        plan = compiled(name)
        sim = Sim(plan.plan, plan.digest)
        sim.start(context)
        # A join's last branch releases it in its own transition; one that arrived under an earlier
        # release, whose engine sent every release as a message, left a message that can be lost.
        with mock.patch.object(Step, "_last_to_arrive", return_value=False):
            drive_until_release(sim, barrier)
        assert sim.record[f"b:{barrier}"] == "0"
        handled = sim.handle(Nudge("nudge-1"))
        (release,) = [m for m in handled.published if m.kind == "barrier.released"]
        assert release.body["stage"] == barrier
        drive(sim, in_order)
        assert sim.status == "completed", name


def drive_until_release(sim: Sim, barrier: str) -> None:
    """Deliver in order until the barrier's release is pending, then lose it (a purged queue)."""
    for _ in range(200):
        for d in sim.pending:
            if isinstance(d.event, BarrierReleased) and d.event.stage == barrier:
                sim.pending.remove(d)
                return
        sim.deliver_at(0)
    raise AssertionError(f"{barrier} never released")


def test_two_branches_that_no_longer_fit_fail_one_nudge_each_and_the_join_still_releases() -> None:
    plan = compile_yaml(TWO_BRANCHES)
    sim = Sim(plan.plan, plan.digest)
    sim.start({"modelId": "m" * 20_000})
    sim.deliver_at(0)
    sim.pending.clear()  # both tasks lost, and the limit lowered below them
    sim.limits = sizes.Limits(16_384)
    sim.handle(Nudge("nudge-1"))
    assert sorted(h["stage"] for h in sim.entries("stage.failed")) == ["a"]
    assert sim.record["b:meet"] == "1"
    sim.handle(Nudge("nudge-2"))
    assert sim.record["b:meet"] == "0"
    drive(sim, in_order)
    assert sim.status == "completed" and sim.snapshot().stages["meet"].status.value == "completed"

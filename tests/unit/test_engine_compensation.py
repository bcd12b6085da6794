"""Saga compensation in the pure engine: completed stages undone newest first, once each, before the
finalisers; a failed compensation is recorded and leaves the run failed."""

from __future__ import annotations

from orchestrator.engine.model import CompensationResult, Verdict
from tests.conftest import compile_yaml
from tests.unit.engine_sim import Sim

CHAIN = """
name: chain
version: "1"
entry: render
context: { type: object, properties: { modelId: { type: string } }, required: [modelId] }
stages:
  - name: render
    type: worker
    worker: thumbnail.render@3
    input: { modelId: "${context.modelId}" }
    compensate: thumbnail.discard@1
    on_success: publish
    on_failure: failed
  - name: publish
    type: action
    action: catalogue.publish@2
    input: { modelId: "${context.modelId}" }
    compensate: catalogue.unpublish@1
    on_success: analyse
    on_failure: failed
  - name: analyse
    type: worker
    worker: semantic.analyse@4
    input: { modelId: "${context.modelId}" }
    on_success: completed
    on_failure: failed
finalisers: [audit.run-terminal@1]
terminals: [completed, failed]
"""


def chain(**kwargs: object) -> Sim:
    plan = compile_yaml(CHAIN)
    sim = Sim(plan.plan, plan.digest, **kwargs)  # type: ignore[arg-type]
    sim.start({"modelId": "m-1"})
    return sim


def test_a_failed_run_undoes_its_completed_stages_newest_first_before_the_finalisers() -> None:
    sim = chain(fail_stages=frozenset({"analyse"}))
    sim.run()
    assert sim.status == "failed"
    kinds = sim.kinds()
    dispatched = [h["stage"] for h in sim.entries("compensation.dispatched")]
    assert dispatched == ["compensate:publish", "compensate:render"]
    assert kinds.index("compensation.completed") < kinds.index("finaliser.dispatched")
    assert sim.record["s:publish:status"] == "compensated"
    assert sim.record["s:render:status"] == "compensated"
    # the compensation got the stage's own input and result
    undo = next(t for t in sim.tasks if t.body["stage"] == "compensate:publish")
    assert undo.body["input"]["input"] == {"modelId": "m-1"}
    assert undo.body["input"]["result"]["catalogueId"] == "cat-m-1"


def test_a_completed_run_undoes_nothing() -> None:
    sim = chain()
    sim.run()
    assert sim.status == "completed"
    assert not sim.entries("compensation.dispatched")


def test_a_failed_compensation_is_recorded_and_the_rest_still_run() -> None:
    sim = chain(fail_stages=frozenset({"analyse", "compensate:publish"}))
    sim.run()
    assert sim.status == "failed"
    failed = sim.entries("compensation.failed")
    assert [h["stage"] for h in failed] == ["compensate:publish"]
    assert sim.record["compensation_failed"] == "1"
    assert sim.record["s:publish:status"] == "completed"  # its effect may remain: not marked undone
    assert sim.record["s:render:status"] == "compensated"
    assert sim.entries("finaliser.completed")


def test_a_duplicate_or_stale_compensation_report_changes_nothing() -> None:
    sim = chain(fail_stages=frozenset({"analyse"}))
    for _ in range(20):  # until the first compensation is dispatched
        if any(t.body["stage"] == "compensate:publish" for t in sim.tasks):
            break
        sim.deliver_at(0)
    first = next(t for t in sim.tasks if t.body["stage"] == "compensate:publish")
    fence = str(first.body["fence"])
    stale = sim.handle(CompensationResult("stale-c", "publish", 0, "0.c0", True))
    assert stale.verdict is Verdict.STALE
    wrong = sim.handle(CompensationResult("wrong-c", "render", 0, fence, True))
    assert wrong.verdict is Verdict.INVALID
    sim.run()
    again = sim.handle(CompensationResult("again-c", "publish", 0, fence, True))
    assert again.verdict is Verdict.DUPLICATE
    assert len(sim.entries("compensation.completed")) == 2

"""Re-drive in the pure engine: a failed run resumes in a new epoch; completed stages keep their results,
failed and compensated ones run again; old-epoch reports are stale; finalisers run once per epoch."""

from __future__ import annotations

from orchestrator.engine.model import CancelRun, Redrive, Verdict
from orchestrator.store.replies import DUPLICATE
from orchestrator.wire.sizes import Limits
from tests.conftest import DEFINITIONS, compile_yaml
from tests.unit.engine_sim import Sim, report
from tests.unit.redrive_cases import cases, fail, in_order
from tests.unit.test_engine import compiled, sim_for


def failed_ingest() -> Sim:
    """model-ingest whose metadata branch fails: the run fails, the rendered thumbnail is discarded."""
    sim = sim_for("model-ingest", {"modelId": "m-1"}, fail_stages=frozenset({"technical-metadata"}))
    sim.run()
    assert sim.status == "failed"
    assert sim.record["s:render-thumbnail:status"] == "compensated"
    return sim


def test_a_redriven_run_reuses_what_completed_and_reruns_what_failed_or_was_undone() -> None:
    sim = failed_ingest()
    old_tasks = list(sim.tasks)
    sim.fail_stages = frozenset()  # the fault is fixed
    handled = sim.handle(Redrive("redrive-1", "metadata service fixed", "ops@host"))
    assert handled.verdict is Verdict.APPLIED
    sim.run()
    assert sim.status == "completed"
    assert sim.record["epoch"] == "2"
    redriven = sim.entries("run.redriven")
    assert redriven[0]["detail"] == {
        "epoch": 2,
        "by": "ops@host",
        "why": "metadata service fixed",
        "request": "redrive-1",
    }
    # cache-lookup and the semantic branch completed and were kept (the branch in the later transition
    # that re-entered the fork, not only in the re-drive's own walk); render was compensated, so it ran
    # again, and the failed metadata branch ran again
    reused = [h["stage"] for h in sim.entries("stage.reused")]
    assert reused == ["cache-lookup", "semantic-analysis"]
    new_tasks = [t.body["stage"] for t in sim.tasks[len(old_tasks) :]]
    assert not {"cache-lookup", "semantic-analysis"} & set(new_tasks)
    assert {"render-thumbnail", "technical-metadata", "publish"} <= set(new_tasks)
    assert sim.record["s:render-thumbnail:fence"] == "2.1"
    # finalisers once per epoch
    assert [h["stage"] for h in sim.entries("finaliser.completed")] == ["finaliser:0", "finaliser:0"]
    assert sim.output == {"modelId": "m-1", "catalogueId": "cat-m-1"}


def test_a_report_from_the_old_epoch_is_stale_after_a_redrive() -> None:
    sim = failed_ingest()
    old = next(t for t in sim.tasks if t.body["stage"] == "technical-metadata")
    sim.fail_stages = frozenset()
    sim.handle(Redrive("redrive-1"))
    for _ in range(50):  # until the new epoch dispatched technical-metadata again
        if sim.record["s:technical-metadata:fence"] == "2.1":
            break
        sim.deliver_at(0)
    late = report(sim.run_id, "technical-metadata", str(old.body["fence"]), True, {"faces": 1, "vertices": 1})
    assert sim.handle(late).verdict is Verdict.STALE
    sim.run()
    assert sim.status == "completed"


def test_only_a_failed_run_can_be_redriven() -> None:
    sim = sim_for("model-ingest", {"modelId": "m-2"})
    sim.run()
    assert sim.status == "completed"
    refused = sim.handle(Redrive("redrive-1"))
    assert refused.verdict is Verdict.INVALID
    assert sim.record["epoch"] == "1" and sim.status == "completed"


def test_a_run_redriven_with_the_fault_still_there_fails_again_in_its_new_epoch() -> None:
    sim = failed_ingest()
    sim.handle(Redrive("redrive-1"))
    sim.run()
    assert sim.status == "failed" and sim.record["epoch"] == "2"
    assert len(sim.entries("run.failed")) == 2
    # the second failure undid the second render too, once
    assert [h["stage"] for h in sim.entries("compensation.completed")] == ["compensate:render-thumbnail"] * 2


def test_a_refused_cancel_delivered_again_after_a_redrive_does_nothing() -> None:
    """A request refused while the run was failed, delivered again once the run lives again (the
    orchestrator died between recording the refusal and acking it), must not act late: operator
    requests are remembered even when refused."""
    sim = failed_ingest()
    cancel = CancelRun("cancel-req-1", "stop it", "ops@host")
    assert sim.handle(cancel).verdict is Verdict.LATE
    sim.fail_stages = frozenset()
    assert sim.handle(Redrive("redrive-1")).took_effect
    again = sim.handle(cancel)
    assert again.code == DUPLICATE and "intent" not in sim.record
    sim.run()
    assert sim.status == "completed"


def test_a_run_that_failed_at_the_door_for_size_is_not_redriven() -> None:
    plan = compiled("model-ingest")
    sim = Sim(plan.plan, plan.digest, limits=Limits(16_384))
    sim.start({"modelId": "é" * 8000})
    sim.run()
    assert sim.status == "failed" and "the task cannot be sent" in sim.record["reason"]
    record = dict(sim.record)
    refused = sim.handle(Redrive("redrive-1"))
    assert (
        refused.verdict is Verdict.INVALID and "does not pass the door" in sim.history[-1]["detail"]["detail"]
    )
    assert sim.record == record


def test_a_poisoned_run_is_fenced_before_its_new_epoch() -> None:
    """A poison message fails a run with work in flight (here: the failure route's notify task, with its
    queue clock). The re-drive cancels that attempt and its clock, so neither can act in the new epoch."""
    case = next(c for c in cases() if c.id == "failure-route[fail render, poison at 4]")
    sim = case.sim()
    in_flight = fail(sim, case, in_order)
    assert sim.status == "failed" and sim.record["s:notify:status"] == "dispatched"
    assert any(d.stage == "notify" for d in in_flight) and sim.store.timers
    sim.fail_stages = frozenset()
    assert sim.handle(Redrive("redrive-1")).took_effect
    assert sim.record["s:notify:status"] == "cancelled" and not any("notify" in t for t in sim.store.timers)
    assert [c.body["stage"] for c in sim.cancels] == ["notify"]
    sim.pending += in_flight
    sim.run()
    assert sim.status == "completed" and sim.record["s:notify:status"] == "cancelled"


def test_a_failed_run_that_undid_stages_and_has_no_finalisers_can_be_redriven() -> None:
    """Its phase ends with it: left 'compensating', it would look poisoned mid-undo for ever."""
    text = (DEFINITIONS / "model-ingest.yaml").read_text().replace("finalisers: [audit.run-terminal@1]", "")
    plan = compile_yaml(text)
    sim = Sim(plan.plan, plan.digest, fail_stages=frozenset({"publish"}))
    sim.start({"modelId": "m-1"})
    sim.run()
    assert sim.status == "failed" and sim.entries("compensation.completed")
    assert sim.record.get("phase") == ""
    sim.fail_stages = frozenset()
    assert sim.handle(Redrive("redrive-1")).took_effect
    sim.run()
    assert sim.status == "completed"


def test_a_run_poisoned_mid_undo_whose_undo_is_lost_is_redriven_only_when_the_operator_says_so() -> None:
    case = next(
        c for c in cases() if c.id == "model-ingest[fail publish, poison while undoing render-thumbnail]"
    )
    sim = case.sim()
    in_flight = fail(sim, case, in_order)
    assert sim.record["phase"] == "compensating" and in_flight  # the undo's task: lost, say
    sim.fail_stages = frozenset()
    assert sim.handle(Redrive("redrive-1")).verdict is Verdict.INVALID
    assert "--undo-lost" in sim.history[-1]["detail"]["detail"]
    applied = sim.handle(Redrive("redrive-2", "the undo was the poison message", "ops@host", undo_lost=True))
    assert applied.took_effect
    (abandoned,) = sim.entries("compensation.abandoned")
    assert abandoned["stage"] == "compensate:render-thumbnail" and abandoned["detail"] == {"by": "ops@host"}
    sim.run()
    assert sim.status == "completed"
    assert sim.record["s:render-thumbnail:fence"] == "2.1"  # taken as undone: rendered again

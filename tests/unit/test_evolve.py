"""``evolve``: the engine's cheap copy-with-changes of its frozen values, against ``dataclasses.replace``."""

from __future__ import annotations

import dataclasses

import pytest

from orchestrator.engine.model import (
    RUN,
    Decision,
    Expect,
    RunSnapshot,
    RunStatus,
    StageRecord,
    StageStatus,
    Verdict,
    evolve,
)


def snapshot() -> RunSnapshot:
    stage = StageRecord(status=StageStatus.RUNNING, attempt=1, fence="1.1")
    return RunSnapshot("run-1", "fast.0", "d" * 64, RunStatus.RUNNING, {"a": 1}, stages={"render": stage})


def test_evolve_gives_what_replace_gives_and_leaves_the_original_as_it_was() -> None:
    before = snapshot()
    changes = {"status": RunStatus.COMPLETED, "barriers": {"join": 1}}
    after = evolve(before, **changes)
    assert after == dataclasses.replace(before, **changes)
    assert type(after) is RunSnapshot
    assert before.status is RunStatus.RUNNING and before.barriers == {}
    with pytest.raises(dataclasses.FrozenInstanceError):
        after.status = RunStatus.FAILED  # type: ignore[misc]


def test_evolve_of_a_decision_keeps_every_other_field() -> None:
    decision = Decision(Verdict.APPLIED, expects=(Expect(RUN, "status", "running"),))
    guarded = evolve(decision, expects=(*decision.expects, Expect(RUN, "rev", "3")))
    assert guarded == dataclasses.replace(decision, expects=guarded.expects)
    assert len(decision.expects) == 1


def test_evolve_refuses_a_field_the_class_does_not_have() -> None:
    with pytest.raises(TypeError, match="RunSnapshot has no field nonsense"):
        evolve(snapshot(), nonsense=1)

"""The fault suite's shared check of releases, on runs written by hand: a completed run released every
bag it opened once, unless the bag failed and a join that accepts a failed branch let the run complete
(then it was never released)."""

from __future__ import annotations

from typing import Any

from tests.faults.invariants import Event, RunView, _accepted_once

PLAN: dict[str, Any] = {"stages": {"bag": {"type": "map"}, "after": {"type": "action"}}}


def run(bag_status: str, events: list[str]) -> RunView:
    history = [Event("run.started", "", None, {})]
    history += [Event(kind, "bag", 1, {}) for kind in events]
    history.append(Event("run.completed", "", None, {}))
    record = {"status": "completed", "s:bag:status": bag_status}
    return RunView("r", "fast.0", record, history, PLAN)


def test_a_completed_bag_released_once_is_fine() -> None:
    assert _accepted_once(run("completed", ["stage.dispatched", "stage.completed"])) == []


def test_a_completed_bag_never_released_is_found() -> None:
    assert _accepted_once(run("completed", ["stage.dispatched"])) == [
        "bag bag released 0 times (dispatched 1)"
    ]


def test_a_failed_bag_of_a_completed_run_is_not_expected_released() -> None:
    assert _accepted_once(run("failed", ["stage.dispatched", "stage.failed"])) == []


def test_a_failed_bag_that_was_released_is_found() -> None:
    found = _accepted_once(run("failed", ["stage.dispatched", "stage.completed"]))
    assert found == ["bag bag released 1 times (dispatched 1)"]

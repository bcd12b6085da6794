"""Re-drive from everywhere: every way an example run can fail (``redrive_cases``), delivered in any order,
then re-driven once the cause is removed.

For each case the re-drive must apply at once (the engine never decides a transition its own snapshot
contradicts, so a sequential run never meets a conflict), no work stage that completed and was not
compensated may be dispatched again, and the run must end as a fresh run with the same context ends
(state, output and every stage's result), with one intent, one end and each finaliser once in its new
epoch. A run whose failure is in its own data ends the same way again; one whose context the definition
refuses is not re-driven at all, and the refusal says why. Every case is run in order (so each one is
checked on every run of the suite) and, under Hypothesis, in any order with duplicates; the Lua library
and its Python port are compared on the same cases in ``tests/integration/test_store.py``.
"""

from __future__ import annotations

import functools
import json
import random
from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.engine.model import Redrive, StageStatus, Verdict
from tests.unit.engine_sim import Sim, replay
from tests.unit.redrive_cases import Case, Chooser, cases, drive, fail, in_order, settle_undo

CASES = cases()
WORK = ("action", "worker", "map")


def fresh(case: Case) -> tuple[str, Any, dict[str, Any]]:
    """How a run with the case's context ends when nothing fails: state, output, work stage results."""
    return _fresh(case.definition, json.dumps(case.context, sort_keys=True))


@functools.cache
def _fresh(definition: str, context_json: str) -> tuple[str, Any, dict[str, Any]]:
    context = json.loads(context_json)
    sim = Case(definition, context, "fresh").sim()
    sim.start(context)
    drive(sim, in_order)
    return sim.status, sim.output, work_results(sim)


def work_results(sim: Sim) -> dict[str, Any]:
    stages = sim.snapshot().stages
    return {
        name: rec.result
        for name, rec in stages.items()
        if sim.plan["stages"][name]["type"] in WORK and rec.status is StageStatus.COMPLETED
    }


def check_redrive(case: Case, choose: Chooser, *, duplicates: bool = False) -> None:
    sim = case.sim()
    in_flight = settle_undo(sim, fail(sim, case, choose), choose)
    before = dict(sim.record)
    if sim.status != "failed" or (case.inherent and before["reason"].startswith("invalid context")):
        # Then a re-drive is refused with the reason, and changes nothing
        refused = sim.handle(Redrive("redrive-1", "try again", "ops@host"))
        assert refused.verdict is Verdict.INVALID, refused
        detail = sim.history[-1]["detail"]
        assert detail["request"] == "redrive-1"
        assert ("context" if sim.status == "failed" else "only a failed run") in detail["detail"]
        assert sim.record == before
        return

    kept = {
        name
        for name, rec in sim.snapshot().stages.items()
        if sim.plan["stages"][name]["type"] in WORK and rec.status is StageStatus.COMPLETED
    }
    # When the cause is removed and the run re-driven
    sim.fail_stages = sim.fail_items = sim.lost_stages = frozenset()
    first_task, first_event = len(sim.tasks), len(sim.handled)
    redriven = sim.handle(Redrive("redrive-1", "fixed", "ops@host"))
    assert redriven.took_effect and redriven.conflicts == 0, redriven
    sim.pending += in_flight  # what a poisoned epoch left in flight arrives in the new one
    drive(sim, choose, races=False)  # a fresh run, compared below, has every worker in time

    # Then it applied without a conflict, ran nothing that had completed, and ended as a fresh run does
    assert all(h.conflicts == 0 for h in sim.handled[first_event:])
    again = {str(t.body["stage"]) for t in sim.tasks[first_task:]}
    assert not kept & again, f"completed stages dispatched again: {kept & again}"
    if case.inherent:
        assert sim.status == "failed" and sim.record["reason"] == before["reason"]
    else:
        status, output, results = fresh(case)
        assert (sim.status, sim.output) == (status, output)
        # the new epoch's path (what it ran, and what it reused) is a fresh run's path; stages only an
        # earlier epoch's failure route reached keep their records
        start = max(i for i, h in enumerate(sim.history) if h["kind"] == "run.redriven")
        path = {h["stage"] for h in sim.history[start:] if h["kind"] in ("stage.completed", "stage.reused")}
        assert {n: r for n, r in work_results(sim).items() if n in path} == results
    check_epoch(sim)
    if not duplicates:
        # A task delivered again long after its report (a worker that died between its report and its
        # ack) can still act, an undo included: effects are guarded by their idempotency key and fence,
        # not by the orchestrator. So the order of effects is checked where each is delivered once.
        check_undo_order(sim)
    # and a second re-drive of an ended (or failed again) run is decided like any other
    assert sim.record["epoch"] == "2"
    check_replay(sim)


def check_epoch(sim: Sim) -> None:
    """The new epoch ended once, after one intent, with each finaliser once and in order, each barrier
    released at most once and each attempt (or item) settled at most once."""
    history = sim.history
    start = max(i for i, h in enumerate(history) if h["kind"] == "run.redriven")
    epoch = history[start:]
    kinds = [h["kind"] for h in epoch]
    assert kinds.count("intent.set") == 1
    assert kinds.count("run.completed") + kinds.count("run.failed") == 1
    dispatched = [h["stage"] for h in epoch if h["kind"] == "finaliser.dispatched"]
    assert dispatched == [f"finaliser:{i}" for i in range(len(sim.plan.get("finalisers") or []))]
    releases = Counter(h["stage"] for h in epoch if h["kind"] == "join.released")
    assert all(n == 1 for n in releases.values()), releases
    outcome_kinds = ("stage.completed", "stage.failed", "stage.timed_out")
    settled = Counter(
        (h["stage"], h["attempt"], h["detail"].get("item")) for h in epoch if h["kind"] in outcome_kinds
    )
    assert all(n == 1 for n in settled.values()), settled
    end = next(i for i, h in enumerate(epoch) if h["kind"] in ("run.completed", "run.failed"))
    assert {h["kind"] for h in epoch[end + 1 :]} <= {"callback.rejected", "cancellation.acknowledged"}


def check_undo_order(sim: Sim) -> None:
    """Every stage that ends completed did its work after the last time it was undone: an undo still in
    flight when the run was re-driven must not leave a reused stage's effect undone."""
    calls = [(stage, ok) for stage, _, ok, _ in sim.calls]
    for name, rec in sim.snapshot().stages.items():
        if rec.status is not StageStatus.COMPLETED or not sim.plan["stages"][name].get("compensate"):
            continue
        done = [i for i, (stage, ok) in enumerate(calls) if stage == name and ok]
        undone = [i for i, (stage, ok) in enumerate(calls) if stage == f"compensate:{name}" and ok]
        assert not undone or (done and done[-1] > undone[-1]), (name, done, undone)


def check_replay(sim: Sim) -> None:
    """The same events against a fresh store decide the same: re-drives replay like any history."""
    store, handled = replay(sim.plan, sim.digest, sim.run_id, sim.log)
    assert store.runs[sim.run_id].record == sim.record
    assert store.runs[sim.run_id].history == sim.history
    assert [h.decision for h in handled] == [h.decision for h in sim.handled]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_every_failure_redriven_in_order_ends_as_a_fresh_run_would(case: Case) -> None:
    check_redrive(case, in_order)


@pytest.mark.parametrize("case", CASES[::3], ids=[c.id for c in CASES[::3]])
def test_every_failure_redriven_newest_first(case: Case) -> None:
    check_redrive(case, lambda options, pending: (options[0], pending - 1))


@settings(max_examples=150, deadline=None)
@given(case=st.sampled_from(CASES), seed=st.integers(0, 2**32 - 1))
def test_every_failure_redriven_in_any_order_with_duplicates(case: Case, seed: int) -> None:
    rng = random.Random(seed)
    weights = {"deliver": 10, "timer": 1, "duplicate": 2}

    def choose(options: list[str], pending: int) -> tuple[str, int]:
        action = rng.choices(options, [weights[o] for o in options])[0]
        return action, rng.randrange(max(pending, 1) * 4)

    check_redrive(case, choose, duplicates=True)


def test_the_cases_reach_every_kind_of_failure() -> None:
    """The case list is not vacuous: every cause kind occurs, and most runs do fail."""
    causes = Counter(c.cause.split(" ")[0] for c in CASES)
    assert {"fail", "lose", "cancel", "poison", "data"} <= set(causes), causes
    assert any(c.poison_undoing for c in CASES)
    assert any("undo" in c.cause for c in CASES) and any("item" in c.cause for c in CASES)
    failed = 0
    for case in CASES:
        sim = case.sim()
        fail(sim, case, in_order)
        failed += sim.status == "failed"
    assert failed >= len(CASES) * 3 // 4, (failed, len(CASES))

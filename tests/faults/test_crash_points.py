"""A process killed (-9, from inside) at each named crash point under load loses and repeats nothing.

orchestrator/faults.py puts its crash points where a crash is hardest to survive: a batch taken but not
decided (after-consume), transitions committed but nothing published or acked (after-commit), messages
handed to the broker with their confirms unseen (before-confirm), confirmed but not marked sent
(after-confirm), and a worker's effect done with its result unpublished (worker-after-effect).

Each case drives one stack of its own: a healthy orchestrator and worker take a load of model-ingest runs
and one thumbnail-batch bag; mid-load the process of the case's role (orchestrator or worker) is drained
(SIGTERM) and replaced by one started with SAGA_CRASH_POINTS set to the point, while more runs are started.
That process dies the first time it reaches the point; the test checks that it did (exit code and log),
starts a healthy one, and checks that every run converges with every invariant of DESIGN.md section 3.
"""

from __future__ import annotations

import signal

import pytest

from orchestrator import faults
from orchestrator.faults import WORKER_POINTS
from tests.faults import invariants
from tests.faults.harness import (
    FaultSeed,
    await_convergence,
    history_total,
    invariant_violations,
    log_tail,
    mixed_workload,
    start_all,
)
from tests.faults.invariants import assert_no_violations
from tests.faults.lifecycle import (
    load_in_flight,
    serve,
    terminal_count,
    wait_for_crash,
)
from tests.integration.stack import Stack

pytestmark = pytest.mark.services

RUNS = 40  # model-ingest runs, of which DURING are started while the crashing process is in charge
DURING = 10
CRASH_WITHIN_S = 60.0  # a liveness bound: work is waiting in the queues when the crashing process starts
CONVERGE_S = 90.0  # a liveness bound for after the restart, far above what recovery takes
# The points at which the crashed batch had committed: it left unsent outbox entries (and see
# must_record_a_duplicate for when it must be recorded as a duplicate).
COMMITTED = ("after-commit", "before-confirm", "after-confirm")


def must_record_a_duplicate(point: str, crash_log: str) -> bool:
    """Whether what the crash left must be recorded as a duplicate before the runs converge. After the
    commit the batch's deliveries come back (they were not acked yet), first in their queue, and their
    transitions are already applied; unless the batch was one of due timers, which has no delivery to
    come back (the log line says so). At the later points they were acked (the ack leaves in the same
    write as the publishes): only the unsent outbox entries come back, sent again by the relay, and a
    task among them runs again and reports after its run may have converged, while a message whose
    frames never left before the kill is sent for the first time. Nothing of that is certain, so only
    the invariants are checked there."""
    return point == "after-commit" and f"in {faults.TIMER_BATCH}" not in crash_log


def duplicates_recorded(runs: list[invariants.RunView]) -> int:
    return sum(
        1
        for run in runs
        for e in run.history
        if e.kind == "callback.rejected" and e.detail.get("reason") == "duplicate"
    )


@pytest.mark.parametrize(
    "point", ["after-consume", "after-commit", "before-confirm", "after-confirm", "worker-after-effect"]
)
def test_a_crash_at_a_named_point_under_load_loses_and_repeats_nothing(
    point: str, fault_seed: FaultSeed
) -> None:
    """Drives 40 model-ingest runs (30 before the crash, 10 started while the crashing process is in
    charge) and one thumbnail-batch bag of 150-250 items, 41 runs in all. Asserts: the crashing process
    died by SIGKILL at ``point`` (exit code and log); what the point implies happened (after-consume:
    it committed nothing; the committed points: it left unsent outbox entries, and the healthy process
    recorded the batch that came back as duplicates (after-commit, unless the batch was one of due
    timers, which has no delivery to come back); worker-after-effect: it recorded an
    effect it never reported); then every run completed, each join and bag released once with exactly its
    members, at most one accepted result per (run, stage, attempt), one effect per idempotency key, no
    unsent outbox entry, no dead letter and nothing on saga.rejected."""
    rng = fault_seed.rng
    role = "worker" if point in WORKER_POINTS else "orchestrator"
    stack = Stack(f"crash-{point}")
    try:
        stack.setup()
        serve(stack)
        work = mixed_workload(stack, rng, runs=RUNS, during=DURING, bag_items=rng.randint(150, 250))
        # Given a load in flight: the crash comes once a seeded number of runs have finished, so that it
        # finds runs at every stage (finished, mid-way, not created yet) and the bag part-way
        start_all(stack.settings, work.before)
        load_in_flight(stack, work.run_ids, rng.randint(1, (RUNS - DURING) // 2))
        # When the role's healthy process hands over (SIGTERM drains it) to one that crashes at the point,
        # and services keep starting runs meanwhile (so work waits for it whatever the timing)
        assert stack.stop(role, signal.SIGTERM) == 0, log_tail(stack, role)
        start_all(stack.settings, work.during)
        history_before = history_total(stack.redis, stack.prefix)
        effects_before = sum(stack.world.effect_counts().values())
        crashing = f"crashing-{role}"
        env = {"SAGA_CRASH_POINTS": point}
        if role == "worker":
            stack.start_worker(crashing, extra_env=env)
        else:
            stack.start_orchestrator(crashing, extra_env=env)
        crashed = wait_for_crash(stack, crashing, point, CRASH_WITHIN_S)
        assert_no_violations(crashed, f"the crash at {point} (seed {fault_seed.seed})")

        # Then the crash left what the point implies
        history_at_crash = history_total(stack.redis, stack.prefix)
        unsent_at_crash = invariants.unsent(stack.redis, stack.prefix)
        effects_at_crash = sum(stack.world.effect_counts().values())
        print(
            f"{point}: {terminal_count(stack, work.run_ids)} of {len(work.run_ids)} runs finished at the "
            f"crash; history {history_before} -> {history_at_crash} events; "
            f"unsent {sum(len(e) for e in unsent_at_crash.values())}; effects {effects_before} -> "
            f"{effects_at_crash}"
        )
        left = []
        if point == "after-consume" and history_at_crash != history_before:
            left.append(f"{history_at_crash - history_before} events committed before the batch was decided")
        if point in COMMITTED and not unsent_at_crash:
            left.append("no unsent outbox entry: the crash did not come between commit and mark-sent")
        if role == "worker" and effects_at_crash <= effects_before:
            left.append("the crashing worker recorded no effect before dying after one")
        assert_no_violations(left, f"what a crash at {point} leaves (seed {fault_seed.seed})")

        # And a healthy process (the relay, redeliveries, the worker's idempotency keys) recovers it all
        if role == "worker":
            stack.start_worker()
        else:
            stack.start_orchestrator()
        what = f"after a crash at {point} (seed {fault_seed.seed})"
        await_convergence(stack, work.run_ids, what, CONVERGE_S, logs=(role,))
        violations = invariant_violations(stack, work.run_ids)
        runs = invariants.load_runs(stack.redis, stack.prefix, work.run_ids)
        if must_record_a_duplicate(point, stack.log(crashing)) and not duplicates_recorded(runs):
            violations.append("the committed but unacked batch came back, yet no duplicate was recorded")
        assert_no_violations(violations, f"the invariants after a crash at {point} (seed {fault_seed.seed})")
    finally:
        stack.teardown()

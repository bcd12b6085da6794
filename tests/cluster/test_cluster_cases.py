"""The long end-to-end cases on the module's three-primary Redis Cluster: a live shard's slot migrated to
another primary under load, a bag of 1,000 items, the fault suite's storm of duplicated, reordered, stale
and late reports, and the orchestrator killed (-9) between commit and publish.

Each case drives a stack of its own (vhost, key prefix) on the one cluster, with the fault suite's
workloads, helpers and invariant checks (``tests/faults/``), so a case here differs from its one-Redis
twin only in where the state lives.
"""

from __future__ import annotations

import signal

import pytest

from orchestrator.client import SyncClient
from tests.cluster.cluster import LocalCluster
from tests.cluster.scenarios import (
    CONVERGE_S,
    assert_converged_and_sound,
    redis_trouble_logged,
    serving_stack,
    shard_slot,
    under_load,
)
from tests.faults import invariants
from tests.faults.harness import (
    FaultSeed,
    history_total,
    invariant_violations,
    log_tail,
    mixed_workload,
    start_all,
)
from tests.faults.invariants import assert_no_violations
from tests.faults.lifecycle import load_in_flight, terminal_count, wait_for_crash
from tests.faults.test_crash_points import duplicates_recorded
from tests.faults.test_storm import storm_scenario

pytestmark = [pytest.mark.services, pytest.mark.long]


@pytest.mark.parametrize(
    ("batch", "pause_s"),
    [(10, 0.05), (2, 0.25)],
    ids=["brisk", "slow"],
)
def test_a_live_shards_slot_migrated_under_load_loses_nothing(
    cluster: LocalCluster, fault_seed: FaultSeed, batch: int, pause_s: float
) -> None:
    """Moves the slot of shard fast.0's hash tag to another primary while 100 model-ingest runs and a bag
    of 80 items are in flight (20 runs started during the move), as ``redis-cli --cluster reshard`` does:
    SETSLOT IMPORTING / MIGRATING, MIGRATE ... KEYS ``batch`` keys at a time with ``pause_s`` between
    batches, SETSLOT NODE on every primary: about 130 keys in about 1 s (brisk) or 16 s (slow).
    Meanwhile the orchestrator's calls on that slot meet ASK (a key already moved) and TRYAGAIN (a
    transition whose keys are split between the two nodes, or not all there yet), and the shard waits.
    Asserts: keys moved, the slot ended on the target with no key left on the source; every run
    completed; each join and bag released once with exactly its members, at most one accepted result per
    (run, stage, attempt), one effect per idempotency key, no unsent outbox entry, no dead letter.

    Not covered, because it fails: a move lasting over about 100 s (batch 1, pause 1 s) dead-letters
    messages, one delivery returned per 5 s step timeout against the delivery limit of 20
    (docs/architecture.md, "Redis Cluster")."""
    with serving_stack(cluster, "cluster-migrate") as stack:
        slot = shard_slot(stack, "fast.0")
        source = cluster.primary_of_slot(slot)
        target = next(p for p in cluster.primary_ports() if p != source)
        moved: list[int] = []
        scenario = under_load(
            stack,
            fault_seed,
            lambda: moved.append(cluster.migrate_slot(slot, target, batch=batch, pause_s=pause_s)),
            shards={"fast.0"},
            tag="cm",
        )
        print(f"slot {slot}: {moved[0]} keys moved from {source} to {target} in {scenario.fault_s:.1f} s")
        assert moved[0] > 0
        assert cluster.primary_of_slot(slot) == target
        with cluster.node(source) as old:
            assert old.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == 0
        assert_converged_and_sound(
            stack, scenario.work.run_ids, f"after slot {slot} moved (seed {fault_seed.seed})"
        )
        print(f"{len(redis_trouble_logged(stack))} batches returned to the queue on Redis trouble")


def test_a_bag_of_1000_items_joins_once_in_order(cluster: LocalCluster) -> None:
    """One thumbnail-batch run of 1,000 items (one map stage, one barrier of 1,000 members in one slot).
    Asserts: it completed with the 1,000 results in item order, the bag released once with exactly its
    members, one effect per item, no unsent outbox entry, no dead letter."""
    with serving_stack(cluster, "cluster-bag") as stack, SyncClient(stack.settings) as client:
        ids = [f"item-{i:04d}" for i in range(1000)]
        run_id = client.start("thumbnail-batch", {"modelIds": ids})
        result = client.wait(run_id, timeout_s=CONVERGE_S)
        assert result.state == "completed", result
        assert result.output["count"] == 1000
        assert result.output["thumbnails"] == [{"thumbnailUri": f"thumbs/{i}.png"} for i in ids]
        assert [e["kind"] for e in stack.history(run_id)].count("stage.completed") == 1
        assert_converged_and_sound(stack, [run_id], "after a bag of 1,000 items")


def test_a_storm_of_duplicated_reordered_stale_and_late_reports_changes_nothing(
    cluster: LocalCluster, fault_seed: FaultSeed
) -> None:
    """The fault suite's storm (``tests/faults/test_storm.py``) on the cluster: 60 model-ingest runs and 3
    bags of 30-80 items under several hundred replayed, stale, settled and late reports and duplicate
    starts, all correctly signed. Asserts: some of every kind were sent; every run completed with the
    output its workers computed; no result or barrier member holds a forged value; every storm message
    was recorded as a refused callback of its run; and every invariant of the fault suite."""
    with serving_stack(cluster, "cluster-storm") as stack:
        violations, run_ids = storm_scenario(stack, fault_seed)
        violations += invariant_violations(stack, run_ids)
        assert_no_violations(violations, f"the invariants after a storm (seed {fault_seed.seed})")


def test_the_orchestrator_killed_between_commit_and_publish_loses_and_repeats_nothing(
    cluster: LocalCluster, fault_seed: FaultSeed
) -> None:
    """The fault suite's crash point ``after-commit`` (``tests/faults/test_crash_points.py``) on the
    cluster: with 30 model-ingest runs and a bag of 150-250 items in flight, the healthy orchestrator is
    drained (SIGTERM) and replaced by one that kills itself (-9) after its first batch's transitions
    committed on the cluster and before anything was published or acked, while 10 more runs are started.
    Asserts: it died by SIGKILL at the point (exit code and log) and left unsent outbox entries; a healthy
    orchestrator then relays them and recognises the redelivered batch as duplicates; every run completed
    with every invariant of the fault suite."""
    point = "after-commit"
    rng = fault_seed.rng
    with serving_stack(cluster, "cluster-crash") as stack:
        work = mixed_workload(stack, rng, runs=40, during=10, bag_items=rng.randint(150, 250), tag="cc")
        start_all(stack.settings, work.before)
        load_in_flight(stack, work.run_ids, rng.randint(1, 15))
        assert stack.stop("orchestrator", signal.SIGTERM) == 0, log_tail(stack, "orchestrator")
        start_all(stack.settings, work.during)
        history_before = history_total(stack.redis, stack.prefix)
        stack.start_orchestrator("crashing-orchestrator", extra_env={"SAGA_CRASH_POINTS": point})
        crashed = wait_for_crash(stack, "crashing-orchestrator", point, 60.0)
        assert_no_violations(crashed, f"the crash at {point} (seed {fault_seed.seed})")

        unsent = invariants.unsent(stack.redis, stack.prefix)
        history_at_crash = history_total(stack.redis, stack.prefix)
        print(
            f"{terminal_count(stack, work.run_ids)} of {len(work.run_ids)} runs finished at the crash; "
            f"history {history_before} -> {history_at_crash} events; "
            f"unsent {sum(len(e) for e in unsent.values())}"
        )
        assert unsent, "no unsent outbox entry: the crash did not come between commit and publish"
        assert history_at_crash > history_before, "the crashing orchestrator committed nothing"

        stack.start_orchestrator()
        assert_converged_and_sound(stack, work.run_ids, f"after a crash at {point} (seed {fault_seed.seed})")
        runs = invariants.load_runs(stack.redis, stack.prefix, work.run_ids)
        assert duplicates_recorded(runs), "the committed but unacked batch came back, yet no duplicate"

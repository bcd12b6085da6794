"""A Redis Cluster primary lost under load (one replica per primary, ``cluster-node-timeout`` 2 s): the
orchestrator rides out the failover and every run completes, with the fault suite's invariants holding
over all of them; the promoted replica serves the Functions library (replicated like data).

Each case drives a stack of its own on the module's cluster: about 100 model-ingest runs (half with a slow
stage, so that they stay in flight) and a bag of 80 items, all on the two live shards of class fast. Once
a few runs have finished, the primary that serves shard fast.0's slot (and fast.1's) is lost while 20 more
runs are started; it is never the primary of the demo's effect ledger (``{demo}``), whose loss would fail
the demo handlers' tasks (the demo world, not the orchestrator, would be under test then).

Replication is asynchronous and nothing here persists: a write the killed primary acknowledged but had not
yet sent to its replica is lost in the failover, which is Redis's documented behaviour (docs/architecture.md,
"Redis Cluster"). The hard-kill case still asserts that nothing is lost: on loopback the window is the
moment between the primary writing a reply and writing the same change to its replica, and no run has hit
it so far. Should that case ever fail with runs stuck (not finished, or never created) and no dead letter
while the coordinated case (no such window) passes, suspect this window before the orchestrator.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.cluster.cluster import LocalCluster, running_cluster
from tests.cluster.scenarios import (
    LIVE_SHARDS,
    assert_converged_and_sound,
    demo_slot,
    has_library,
    redis_trouble_logged,
    serving_stack,
    shard_slot,
    under_load,
)
from tests.faults.harness import FaultSeed
from tests.integration.stack import Stack, poll

pytestmark = [pytest.mark.services, pytest.mark.long]

NODE_TIMEOUT_MS = 2_000
PROMOTION_S = 60.0  # a liveness bound: a replica takes over a few node timeouts after its primary died


@pytest.fixture(scope="module")
def replicated() -> Iterator[LocalCluster]:
    with running_cluster(replicas=1, node_timeout_ms=NODE_TIMEOUT_MS) as found:
        yield found


def victim(cluster: LocalCluster, stack: Stack) -> tuple[int, int, set[str]]:
    """The primary serving shard fast.0's slot, its replica, and the live shards that primary serves."""
    primary = cluster.primary_of_slot(shard_slot(stack, "fast.0"))
    assert primary != cluster.primary_of_slot(demo_slot(stack)), "fast.0 and {demo} share a primary"
    replicas = cluster.replicas_of(primary)
    assert len(replicas) == 1, f"primary {primary} has replicas {replicas}"
    poll(lambda: cluster.in_sync(replicas[0]), 30, what=f"replica {replicas[0]} in sync with {primary}")
    shards = {s for s in LIVE_SHARDS if cluster.primary_of_slot(shard_slot(stack, s)) == primary}
    return primary, replicas[0], shards


def test_a_coordinated_failover_under_load_loses_nothing(
    replicated: LocalCluster, fault_seed: FaultSeed
) -> None:
    """CLUSTER FAILOVER on the replica of fast.0's primary while 100 runs and a bag are in flight: the
    primary stops taking writes, its replica catches up and takes over, clients are sent on with MOVED.
    Asserts: the replica became the primary of the slot (the old primary its replica) and holds the
    Functions library; every run completed; each join and bag released once with exactly its members,
    at most one accepted result per (run, stage, attempt), one effect per idempotency key, no unsent
    outbox entry, no dead letter."""
    with serving_stack(replicated, "cluster-failover") as stack:
        primary, replica, shards = victim(replicated, stack)
        scenario = under_load(
            stack, fault_seed, lambda: replicated.failover(replica, PROMOTION_S), shards=shards, tag="cf"
        )
        assert replicated.primary_of_slot(shard_slot(stack, "fast.0")) == replica
        assert has_library(replicated, replica), "the promoted replica has no Functions library"
        assert_converged_and_sound(
            stack, scenario.work.run_ids, f"after a coordinated failover (seed {fault_seed.seed})"
        )
        assert replicated.replicas_of(replica) == [primary], "the old primary is not the new one's replica"
        print(f"{len(redis_trouble_logged(stack))} batches returned to the queue on Redis trouble")


def test_a_primary_killed_under_load_is_replaced_by_its_replica_and_every_run_completes(
    replicated: LocalCluster, fault_seed: FaultSeed
) -> None:
    """SIGKILL of the primary serving fast.0's slot while 100 runs and a bag are in flight: its replica is
    promoted (automatic failover, node timeout 2 s), and meanwhile every shard of that primary gets
    connection errors, then CLUSTERDOWN. Asserts: the replica became the primary of the slot and holds
    the Functions library; every run completed, with every invariant of the coordinated case."""
    with serving_stack(replicated, "cluster-kill") as stack:
        primary, replica, shards = victim(replicated, stack)

        def kill() -> None:
            replicated.kill(primary)
            replicated.wait_promoted(replica, PROMOTION_S)

        scenario = under_load(stack, fault_seed, kill, shards=shards, tag="ck")
        assert replicated.primary_of_slot(shard_slot(stack, "fast.0")) == replica
        assert has_library(replicated, replica), "the promoted replica has no Functions library"
        assert_converged_and_sound(
            stack, scenario.work.run_ids, f"after a primary was killed (seed {fault_seed.seed})"
        )
        print(f"{len(redis_trouble_logged(stack))} batches returned to the queue on Redis trouble")

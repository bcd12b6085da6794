"""What the long cluster scenarios share: a stack serving on a test cluster, and a load of runs with a fault
injected into the cluster while they are in flight, checked afterwards with the fault suite's invariants.

The load, the starts, the convergence wait and the invariant checks are the fault suite's own
(``tests/faults/harness.py``, ``lifecycle.py``, ``invariants.py``), on a Redis Cluster instead of one Redis.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import redis
from redis.cluster import ClusterNode, RedisCluster

from orchestrator.store.keys import ShardKeys
from orchestrator.store.redis_store import LIBRARY_NAME
from tests.cluster.cluster import LocalCluster, key_slot
from tests.faults import invariants
from tests.faults.harness import (
    FaultSeed,
    Workload,
    await_convergence,
    invariant_violations,
    log_tail,
    mixed_workload,
    start_all,
)
from tests.faults.invariants import assert_no_violations
from tests.faults.lifecycle import load_in_flight, serve
from tests.integration.stack import Stack
from workers.demo.effects import DemoWorld, demo_key

LIVE_SHARDS = ("fast.0", "fast.1")  # model-ingest and thumbnail-batch are class fast; 2 shards per class
CONVERGE_S = 180.0  # a liveness bound after the fault, far above what recovery takes on 2 cores


class SplittingCluster(RedisCluster):
    """A cluster client whose MGET takes keys of any slots, split per slot (``mget_nonatomic``), as a
    plain Redis takes them: the fault suite's helpers MGET run-id index keys, which spread over every
    slot (``tests/faults/lifecycle.py``: ``terminal_count``)."""

    def mget(self, keys: Any, *args: Any) -> Any:
        return self.mget_nonatomic(keys, *args)


def splitting_client(cluster: LocalCluster) -> redis.Redis:
    nodes = [ClusterNode("127.0.0.1", p) for p in cluster.live_ports()]
    return cast(redis.Redis, SplittingCluster(startup_nodes=nodes, decode_responses=True))


@contextmanager
def serving_stack(cluster: LocalCluster, name: str) -> Iterator[Stack]:
    """A stack of its own (vhost, key prefix) on ``cluster``, its orchestrator and worker serving every
    shard and task queue; torn down afterwards (processes, vhost, keys), also on failure. The test's own
    client (``stack.redis``, and the demo world's) is a :class:`SplittingCluster`."""
    stack = Stack(name, redis_url=cluster.url)
    stack.redis.close()
    stack.redis = splitting_client(cluster)
    stack.world = DemoWorld(stack.redis, stack.prefix)
    try:
        stack.setup()
        serve(stack)
        yield stack
    finally:
        stack.teardown()


def shard_slot(stack: Stack, shard: str) -> int:
    """The slot every key of ``shard`` lives in (its hash tag)."""
    return key_slot(ShardKeys(stack.prefix, shard).outbox())


def demo_slot(stack: Stack) -> int:
    """The slot of the demo's effect ledger, which the demo workers' handlers write on every task."""
    return key_slot(demo_key(stack.prefix, "effects"))


def has_library(cluster: LocalCluster, port: int) -> bool:
    with cluster.node(port) as node:
        return bool(node.function_list(library=LIBRARY_NAME))


def in_flight_on(stack: Stack, run_ids: list[str], shards: set[str]) -> int:
    """How many of the runs exist on one of ``shards`` and have not finished yet."""
    return sum(
        1
        for run in invariants.load_runs(stack.redis, stack.prefix, run_ids)
        if run.shard in shards and run.status not in invariants.TERMINAL
    )


@dataclass
class Scenario:
    work: Workload
    in_flight: int  # runs of the faulted shards in flight when the fault began
    fault_s: float  # how long the fault took (kill to promotion, or the migration)


def under_load(
    stack: Stack,
    seed: FaultSeed,
    fault: Callable[[], None],
    *,
    shards: set[str],
    runs: int = 100,
    during: int = 20,
    bag_items: int = 80,
    tag: str = "c",
) -> Scenario:
    """Start ``runs - during`` model-ingest runs and a bag (half the runs with a slow stage), wait until a
    few finished, then run ``fault`` while the other ``during`` runs are started beside it; returns once
    both are done. The fault must find runs of ``shards`` in flight, or the test would prove nothing."""
    rng = seed.rng
    work = mixed_workload(stack, rng, runs=runs, during=during, bag_items=bag_items, tag=tag)
    start_all(stack.settings, work.before)
    load_in_flight(stack, work.run_ids, rng.randint(3, 15))
    in_flight = in_flight_on(stack, work.run_ids, shards)
    errors: list[BaseException] = []

    def start_during() -> None:
        try:
            start_all(stack.settings, work.during)
        except BaseException as exc:
            errors.append(exc)

    starter = threading.Thread(target=start_during)
    began = time.monotonic()
    starter.start()
    try:
        fault()
    finally:
        fault_s = time.monotonic() - began
        starter.join(180)
    if errors:
        raise errors[0]
    print(f"fault took {fault_s:.1f} s; {in_flight} runs of {sorted(shards)} in flight (seed {seed.seed})")
    assert in_flight > 0, f"no run of {sorted(shards)} was in flight when the fault began"
    return Scenario(work, in_flight, fault_s)


def assert_converged_and_sound(stack: Stack, run_ids: list[str], what: str) -> None:
    """Every run completed and every outbox drained within the bound; then every invariant of the fault
    suite over all runs of the stack, and no dead letter."""
    await_convergence(stack, run_ids, what, CONVERGE_S, logs=("orchestrator", "worker"))
    violations = invariant_violations(stack, run_ids)
    if violations:
        print(f"orchestrator log, last lines:\n{log_tail(stack, 'orchestrator', 60)}")
    assert_no_violations(violations, f"the invariants {what}")


def redis_trouble_logged(stack: Stack) -> list[str]:
    """The orchestrator's log lines that say a Redis step failed and its deliveries went back."""
    return [line for line in stack.log("orchestrator").splitlines() if "Redis failed" in line]

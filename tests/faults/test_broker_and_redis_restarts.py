"""The two servers restarted under load: the machine's RabbitMQ, and a Redis killed with -9.

* RabbitMQ (``rabbitmqctl stop_app`` / ``start_app``): every AMQP connection drops at once; quorum queues
  keep their messages. The orchestrator and the worker must reconnect and consume again by themselves,
  deliveries they held come back (a redelivery is a recognised duplicate), and nothing is dead-lettered:
  a disconnect is not a failure of the message.
* Redis (appendonly yes, appendfsync always): kill -9 loses no write it acknowledged. The orchestrator
  stops consuming while it is gone and carries on once it is back on the same port and data dir.

The broker is shared by every vhost on this machine: it is started again in ``finally`` and waited for,
whatever happens to the test.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis

from orchestrator.client import SyncClient
from orchestrator.store.keys import ShardKeys, index_key
from tests.faults import invariants
from tests.faults.harness import (
    FaultSeed,
    await_convergence,
    history_total,
    invariant_violations,
    log_tail,
    mixed_workload,
    redis_server,
    sleep_until,
    start_all,
)
from tests.faults.invariants import assert_no_violations
from tests.faults.lifecycle import (
    broker_restarted,
    consumer_counts,
    is_shard_queue,
    is_task_queue,
    load_in_flight,
    serve,
    terminal_count,
    wait_until_consuming,
)
from tests.integration.stack import Stack, poll
from workers.demo.effects import DemoWorld

pytestmark = pytest.mark.services

RUNS = 40  # model-ingest runs, of which DURING are started around the fault
DURING = 10
RECONNECT_S = 60.0  # liveness bounds, far above what a reconnect or a recovery takes; not timing claims
CONVERGE_S = 90.0
MAIN_REDIS = "redis://127.0.0.1:6379/0"


# ---- RabbitMQ -----------------------------------------------------------------------------------------


def test_a_broker_restart_under_load_reconnects_and_every_run_converges(fault_seed: FaultSeed) -> None:
    """Drives 40 model-ingest runs (30 before the restart, 10 after it) and one thumbnail-batch bag of
    150-250 items, 41 runs in all; the broker is down 1-5 s (seeded). Asserts: the orchestrator and the
    worker consume every one of their queues again after the restart, with no process restarted by the
    test; then every run completed, each join and bag released once with exactly its members, at most
    one accepted result per (run, stage, attempt), one effect per idempotency key, no unsent outbox
    entry, no dead letter and nothing on saga.rejected."""
    rng = fault_seed.rng
    stack = Stack("broker-restart")
    try:
        stack.setup()
        serve(stack)
        work = mixed_workload(stack, rng, runs=RUNS, during=DURING, bag_items=rng.randint(150, 250))
        start_all(stack.settings, work.before)
        load_in_flight(stack, work.run_ids, rng.randint(1, (RUNS - DURING) // 2))

        # When the broker stops with runs in flight, and starts again a few seconds later
        down_s = rng.uniform(1.0, 5.0)
        history_at_stop = history_total(stack.redis, stack.prefix)
        with broker_restarted(down_s):
            in_flight = len(work.run_ids) - terminal_count(stack, work.run_ids)
        print(f"broker down {down_s:.1f} s with {in_flight} of {len(work.run_ids)} runs not finished")

        # Then both processes consume their queues again, by themselves
        def every_queue_served() -> bool:
            counts = consumer_counts(stack, lambda q: is_shard_queue(q) or is_task_queue(q))
            return bool(counts) and all(counts.values())

        try:
            poll(every_queue_served, RECONNECT_S, interval_s=0.5, what="every queue to be consumed again")
        except AssertionError:
            unserved = consumer_counts(stack, lambda q: is_shard_queue(q) or is_task_queue(q))
            for name in ("orchestrator", "worker"):
                print(f"{name} log, last lines:\n{log_tail(stack, name)}")
            assert_no_violations(
                [f"queue {q} has no consumer" for q, n in sorted(unserved.items()) if not n]
                + [f"history grew by {history_total(stack.redis, stack.prefix) - history_at_stop} events"],
                f"the reconnect {RECONNECT_S:.0f} s after a broker restart (seed {fault_seed.seed})",
            )
        # ... and runs started now go through like the others
        start_all(stack.settings, work.during)
        what = f"after a broker restart (seed {fault_seed.seed})"
        await_convergence(stack, work.run_ids, what, CONVERGE_S, logs=("orchestrator", "worker"))
        violations = invariant_violations(stack, work.run_ids)
        assert_no_violations(violations, f"the invariants after a broker restart (seed {fault_seed.seed})")
    finally:
        stack.teardown()


# ---- Redis -----------------------------------------------------------------------------------------------


History = list[tuple[str, dict[str, str]]]  # a run's history stream: (stream id, fields) per event


def histories(r: redis.Redis, prefix: str, run_ids: list[str]) -> dict[str, History]:
    """Every created run's history as Redis holds it now (stream ids and fields)."""
    found: dict[str, History] = {}
    for run_id in run_ids:
        shard: str | None = r.get(index_key(prefix, run_id))  # type: ignore[assignment]
        if shard is not None:
            events: History = r.xrange(ShardKeys(prefix, shard).history(run_id))  # type: ignore[assignment]
            found[run_id] = events
    return found


def lost_writes(before: dict[str, History], after: dict[str, History]) -> list[str]:
    """What Redis had acknowledged before the kill and no longer holds: a run's claim, or a history event
    (history is append-only, so what was there must still open the run's history, in order)."""
    found = []
    for run_id, events in before.items():
        now = after.get(run_id)
        if now is None:
            found.append(f"run {run_id}: its claim is gone ({len(events)} history events before the kill)")
        elif now[: len(events)] != events:
            found.append(f"run {run_id}: history had {len(events)} events before the kill, now {len(now)}")
    return found


def test_a_redis_kill_9_under_load_loses_nothing_and_every_run_converges(
    fault_seed: FaultSeed, tmp_path: Path
) -> None:
    """Drives 40 model-ingest runs (30 before the kill, 10 started while Redis is down) and one
    thumbnail-batch bag of 150-250 items, 41 runs in all, on a Redis of the test's own (AOF, fsync
    always) killed with -9 for 1-4 s (seeded) and restarted on its port and data dir. The demo's effect
    ledger, standing for the world outside, lives in the machine's Redis and is not killed. Asserts:
    every claim and history event Redis held just before the kill is still there after it; the
    orchestrator noticed; every run completed, each join and bag released once with exactly its
    members, at most one accepted result per (run, stage, attempt), one effect per idempotency key, no
    unsent outbox entry, no dead letter and nothing on saga.rejected."""
    rng = fault_seed.rng
    ledger = redis.Redis.from_url(MAIN_REDIS, decode_responses=True)
    with redis_server(tmp_path) as server:
        stack = Stack("redis-kill", redis_url=server.url)
        # The worker's effects and fault knobs go to the machine's Redis, which stays up: a handler whose
        # effect store died with the orchestrator's Redis would fail its stage, which is not this test.
        stack.world = DemoWorld(ledger, stack.prefix)
        try:
            stack.setup()
            stack.start_orchestrator()
            stack.start_worker(extra_env={"SAGA_REDIS_URL": MAIN_REDIS})
            wait_until_consuming(stack, is_shard_queue)
            wait_until_consuming(stack, is_task_queue)
            work = mixed_workload(stack, rng, runs=RUNS, during=DURING, bag_items=rng.randint(150, 250))
            with SyncClient(stack.settings) as client:
                # one client for the whole test: it knows the active version when Redis is gone
                for start in work.before:
                    client.start(start.definition, start.context, idempotency_key=start.key)
                load_in_flight(stack, work.run_ids, rng.randint(1, (RUNS - DURING) // 2))

                # When Redis is killed with runs in flight (what it held just before is what it had
                # acknowledged: with fsync always, all of it must survive)
                before = histories(stack.redis, stack.prefix, work.run_ids)
                server.kill()
                killed_at = time.monotonic()
                for start in work.during:  # services keep starting runs: the broker holds them
                    client.start(start.definition, start.context, idempotency_key=start.key)
                sleep_until(killed_at + rng.uniform(1.0, 4.0))
                server.start()
                print(
                    f"Redis killed for {time.monotonic() - killed_at:.1f} s with "
                    f"{sum(map(len, before.values()))} history events of {len(before)} runs"
                )

            # Then nothing it had acknowledged is lost, and every run converges
            lost = lost_writes(before, histories(stack.redis, stack.prefix, work.run_ids))
            assert_no_violations(lost, f"what Redis held before a kill -9 (seed {fault_seed.seed})")
            await_convergence(
                stack, work.run_ids, f"after a Redis kill -9 (seed {fault_seed.seed})", CONVERGE_S
            )
            violations = invariants.check_runs(stack.redis, stack.prefix, work.run_ids, effects=False)
            runs = invariants.load_runs(stack.redis, stack.prefix, work.run_ids)
            violations += invariants.effect_violations(ledger, stack.prefix, runs)
            violations += invariants.dead_letters(stack.queue_depths())
            log = stack.log("orchestrator")
            if "Redis unreachable" not in log and "Redis failed" not in log:
                violations.append("the orchestrator never noticed that Redis was gone")
            assert_no_violations(violations, f"the invariants after a Redis kill -9 (seed {fault_seed.seed})")
        finally:
            if server.process is None or server.process.poll() is not None:
                server.start()  # the test failed while it was down: teardown deletes the keys in it
            stack.teardown()
            demo = list(ledger.scan_iter(match=f"{stack.prefix}:demo:*", count=1000))
            if demo:
                ledger.delete(*demo)
            ledger.close()

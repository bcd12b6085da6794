"""A paused active orchestrator, replaced by its standby, comes back with stale decisions (invariant 2).

Single active consumer makes one orchestrator consume each shard queue; a second one on the same shards
waits as the standby. SIGSTOP freezes the active one as a long GC pause or a frozen VM would: its AMQP
heartbeat stops (SAGA_AMQP_HEARTBEAT_S=2 here), the broker drops its connection, hands its unacked
deliveries back and makes the standby active. On SIGCONT the old process carries on with what it held:
deliveries the standby has had again since, and any decision it had not written yet. Those late writes
must lose to the dedupe and the compare-and-set in Lua (a duplicate or a conflict, never a second
release or a second accepted result), and the process must come back as the new standby.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections import Counter

import pytest

from orchestrator.store.keys import ShardKeys
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
    active_consumers,
    consumer_counts,
    is_shard_queue,
    is_task_queue,
    load_in_flight,
    named_amqp_url,
    terminal_count,
    unacked_by_connection,
    wait_until_consuming,
)
from tests.integration.stack import Stack, poll

pytestmark = pytest.mark.services

RUNS = 40  # model-ingest runs, of which DURING are started while the active orchestrator is frozen
DURING = 10
HEARTBEAT_S = 2
REDIS_TIMEOUT_S = 60
FREEZE_TRIES = 30  # attempts at catching the active orchestrator with deliveries in hand
TAKEOVER_S = 60.0  # liveness bounds, far above what a 2 s heartbeat needs; not timing claims
CONVERGE_S = 90.0


def freeze_at_work(stack: Stack, name: str, rng: random.Random) -> tuple[int, int, int]:
    """SIGSTOP orchestrator ``name`` at a moment it holds unacked deliveries, so that the pause finds it
    with work in hand; returns (when it was frozen, in ms; how many deliveries it held; tries). Its
    channels are asked while it is frozen (it cannot ack meanwhile); if it held nothing it is thawed,
    well within a heartbeat, and frozen again a moment later. The last try stays frozen regardless."""
    pid = stack.processes[name].pid
    for tries in range(1, FREEZE_TRIES + 1):
        os.kill(pid, signal.SIGSTOP)
        paused_ms = int(time.time() * 1000)
        held = unacked_by_connection(stack).get(name, 0)
        if held or tries == FREEZE_TRIES:
            return paused_ms, held, tries
        os.kill(pid, signal.SIGCONT)
        time.sleep(rng.uniform(0.02, 0.3))
    raise AssertionError("unreachable")


def written_after(
    stack: Stack, run_ids: list[str], paused_ms: int, resumed_ms: int
) -> tuple[Counter[str], int]:
    """What the runs' histories got after the resume (a stream id is Redis's clock at the write), by kind
    (refusals by reason); and how many of those events were decided before the pause (``at`` is the
    deciding process's clock): writes the old process had prepared, which Lua can only have refused.
    Evidence of the late writes, printed; the invariants are what must hold whatever they were."""
    kinds: Counter[str] = Counter()
    prepared = 0
    for run_id in run_ids:
        shard = stack.shard_of(run_id)
        if shard is None:
            continue
        events: list[tuple[str, dict[str, str]]] = stack.redis.xrange(  # type: ignore[assignment]
            ShardKeys(stack.prefix, shard).history(run_id), min=f"{resumed_ms}-0"
        )
        for _, fields in events:
            reason = json.loads(fields.get("detail") or "{}").get("reason")
            kinds[f"{fields['kind']} ({reason})" if reason else fields["kind"]] += 1
            prepared += int(fields["at"]) <= paused_ms
    return kinds, prepared


def test_a_paused_active_orchestrator_loses_to_its_standby_and_its_late_writes_change_nothing(
    fault_seed: FaultSeed,
) -> None:
    """Drives 40 model-ingest runs (30 before the pause, 10 during it) and one thumbnail-batch bag of
    150-250 items, 41 runs in all, with two orchestrators on every shard. Asserts: the first one started
    is the active consumer of every shard queue and holds unacked deliveries when it is frozen; the
    standby becomes active on every shard queue and commits transitions while the old one is frozen; the
    old one, resumed, comes back as a consumer again without taking the queues back; then every run
    completed, each join and bag released once with exactly its members, at most one accepted result per
    (run, stage, attempt), one effect per idempotency key, no unsent outbox entry, no dead letter and
    nothing on saga.rejected."""
    rng = fault_seed.rng
    # A Redis timeout longer than the freeze: only the broker notices it (Redis cuts are test_redis_cut's),
    # and each shard loop of the old process comes back on its own, not pushed by a Redis error
    env = {"SAGA_AMQP_HEARTBEAT_S": str(HEARTBEAT_S), "SAGA_REDIS_TIMEOUT_S": str(REDIS_TIMEOUT_S)}
    stack = Stack("standby", env=env)
    frozen: int | None = None
    try:
        stack.setup()
        # Given two orchestrators on the same shards, the first one started active on every shard queue
        # both pinned to every shard: one active and one standby per shard (unpinned processes would
        # divide the shards between them instead)
        every = f"0-{stack.settings.shard_count - 1}"
        stack.start_orchestrator(
            "first", "--shards", every, extra_env={"SAGA_AMQP_URL": named_amqp_url(stack, "first")}
        )
        wait_until_consuming(stack, is_shard_queue)
        stack.start_orchestrator(
            "second", "--shards", every, extra_env={"SAGA_AMQP_URL": named_amqp_url(stack, "second")}
        )
        wait_until_consuming(stack, is_shard_queue, at_least=2)
        active = active_consumers(stack)
        assert set(active.values()) == {"first"}, f"the first orchestrator is not active everywhere: {active}"
        stack.start_worker()
        wait_until_consuming(stack, is_task_queue)
        work = mixed_workload(stack, rng, runs=RUNS, during=DURING, bag_items=rng.randint(150, 250))
        start_all(stack.settings, work.before)
        load_in_flight(stack, work.run_ids, rng.randint(1, (RUNS - DURING) // 2))

        # When the active orchestrator freezes with deliveries in its hands
        frozen = stack.processes["first"].pid
        paused_ms, held, tries = freeze_at_work(stack, "first", rng)
        assert held, f"the active orchestrator held no delivery in {tries} freezes: it was idle"
        in_flight = len(work.run_ids) - terminal_count(stack, work.run_ids)
        history_at_pause = history_total(stack.redis, stack.prefix)
        start_all(stack.settings, work.during)

        # Then the broker gives every shard queue to the standby, which moves the runs on
        poll(
            lambda: set(active_consumers(stack).values()) == {"second"},
            TAKEOVER_S,
            interval_s=0.5,
            what="the standby to become the active consumer of every shard queue",
        )
        took_over_s = time.time() - paused_ms / 1000
        progress = rng.randint(20, 200)  # how far the standby gets before the old one wakes up (seeded)
        poll(
            lambda: history_total(stack.redis, stack.prefix) >= history_at_pause + progress,
            TAKEOVER_S,
            interval_s=0.1,
            what=f"the standby to commit {progress} events while the old active one is frozen",
        )
        # ... and the old one wakes up with what it held: deliveries the standby has had again since, and
        # whatever it had decided and not yet written
        os.kill(frozen, signal.SIGCONT)
        resumed_ms = int(time.time() * 1000)
        frozen = None
        print(
            f"frozen (try {tries}) holding {held} deliveries, {in_flight} of {len(work.run_ids)} runs in "
            f"flight; standby active after {took_over_s:.1f} s; resumed after "
            f"{(resumed_ms - paused_ms) / 1000:.1f} s"
        )

        # And every run converges, with every invariant held: the late writes changed nothing
        what = f"after a standby takeover (seed {fault_seed.seed})"
        await_convergence(stack, work.run_ids, what, CONVERGE_S, logs=("first", "second"))
        after, prepared = written_after(stack, work.run_ids, paused_ms, resumed_ms)
        print(f"written after the resume: {dict(after)}; {prepared} of them decided before the pause")
        violations = invariant_violations(stack, work.run_ids)
        # ... and the old one serves again, as the new standby: SAC does not hand a queue back to a
        # returning consumer, and a process that never consumes again leaves its shards without a standby
        try:
            poll(
                lambda: all(n == 2 for n in consumer_counts(stack, is_shard_queue).values()),
                TAKEOVER_S,
                interval_s=0.5,
                what="the resumed orchestrator to consume again",
            )
        except AssertionError:
            counts = consumer_counts(stack, is_shard_queue)
            violations.append(f"the resumed orchestrator does not consume every shard queue again: {counts}")
            print(f"first log, last lines:\n{log_tail(stack, 'first')}")
        active = active_consumers(stack)
        if set(active.values()) != {"second"}:
            violations.append(f"the standby is not the active consumer of every shard queue: {active}")
        assert_no_violations(violations, f"the invariants after a standby takeover (seed {fault_seed.seed})")
    finally:
        if frozen is not None:
            os.kill(frozen, signal.SIGCONT)  # a stopped process would sit out the SIGTERM of teardown
        stack.teardown()

"""A seeded storm of duplicated, reordered, stale and late completions against many live runs
(invariants 4, 5, 6, 10).

A tap queue, bound to ``saga.runs`` beside the shard queues, copies every report the workers send. While
the runs go on, the storm publishes, straight onto the shard queues (the default exchange, so the tap
never sees its own messages) and in a shuffled order at random later moments:

* replays: the very bytes of a real report (result or acceptance), one to three times;
* stale reports: a real report's identity with an older fence, a new id and a forged value;
* settled reports: a report, under a new id, on an attempt (or map item) that has already been settled,
  with a forged value or a failure;
* late reports: once every run has ended, more replays;
* duplicate starts: a run started again with its idempotency key.

Every one of them is correctly signed: what keeps them out is the fence, the dedupe and the barrier's
membership, not the signature. None may change a result or release a join or bag twice.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aio_pika
import pytest

from orchestrator.bus import batch, names
from orchestrator.bus.envelope import Envelope, encode
from orchestrator.bus.names import Names
from orchestrator.client import Client, status_document
from orchestrator.store.keys import ShardKeys
from orchestrator.wire.kinds import Kind
from tests.faults import invariants
from tests.faults.harness import FaultSeed, Start, log_tail, start_all
from tests.faults.invariants import assert_no_violations
from tests.faults.lifecycle import is_shard_queue, is_task_queue, terminal_count, wait_until_consuming
from tests.integration.stack import Stack

NAMES = Names()  # the stack runs in the default namespace, on a vhost of its own

pytestmark = pytest.mark.services

INGESTS = 60  # model-ingest runs
BAGS = 3  # thumbnail-batch runs of 30-80 items
TAP = "storm.tap"
MARKER = "STORM"  # in every forged value: a stored result containing it was changed by the storm
STORM_MAX_S = 120.0  # liveness bounds, far above what the load takes; not timing claims
CONVERGE_S = 90.0
REPLAYED = (Kind.RESULT.value, Kind.ACCEPTED.value)
WORK_FENCE = re.compile(r"^(\d+)\.(\d+)$")  # a work stage attempt's fence: <epoch>.<attempt>


@dataclass
class Planned:
    """One storm message, due at a loop time; ``build`` makes its bytes, or None while it is not safe
    to send yet (a settled report on an attempt that is still open)."""

    due: float
    run_id: str
    shard: str
    kind: str  # replay, stale, settled, late
    report: dict[str, Any]
    raw: bytes
    tries: int = 0


@dataclass
class Storm:
    stack: Stack
    rng: random.Random
    planned: list[Planned] = field(default_factory=list)
    captured: list[tuple[dict[str, Any], bytes]] = field(default_factory=list)
    sent: Counter[str] = field(default_factory=Counter)  # run id -> storm messages that reached its shard
    kinds: Counter[str] = field(default_factory=Counter)
    dropped: int = 0  # settled reports whose attempt never settled: not sent, not counted
    forged: int = 0

    # ---- planning ----------------------------------------------------------------------------------

    def capture(self, raw: bytes, now: float) -> None:
        report = json.loads(raw)
        body = report.get("body") or {}
        if report.get("kind") not in REPLAYED or body.get("cancelled"):
            return  # a cancelled attempt's report is recorded as an acknowledgement, not a rejection
        self.captured.append((report, raw))
        rng = self.rng
        if rng.random() < 0.6:
            for _ in range(rng.choice((1, 1, 2, 3))):
                self._plan(now + rng.uniform(0.0, 3.0), "replay", report, raw)
        stage = str(report.get("stage") or "")
        if report["kind"] != Kind.RESULT.value or not WORK_FENCE.match(str(report.get("fence"))):
            return  # forgeries only for work stages' results (not finalisers or compensations)
        if rng.random() < 0.3:
            self._plan(now + rng.uniform(0.0, 3.0), "stale", report, raw)
        if rng.random() < 0.3 and stage:
            self._plan(now + rng.uniform(0.2, 3.0), "settled", report, raw)

    def late(self, now: float) -> None:
        """Once every run has ended: replay a sample of everything captured once more."""
        captured = self.captured
        for report, raw in self.rng.sample(captured, k=min(len(captured), len(captured) // 4)):
            self._plan(now + self.rng.uniform(0.0, 1.0), "late", report, raw)

    def _plan(self, due: float, kind: str, report: dict[str, Any], raw: bytes) -> None:
        self.planned.append(Planned(due, report["run_id"], report["shard"], kind, report, raw))

    # ---- building ----------------------------------------------------------------------------------

    def build(self, p: Planned) -> bytes | None:
        if p.kind in ("replay", "late"):
            return p.raw
        envelope = Envelope.model_validate(p.report)
        self.forged += 1
        if p.kind == "stale":
            epoch, attempt = (int(n) for n in WORK_FENCE.match(envelope.fence or "").groups())  # type: ignore[union-attr]
            older = f"{epoch}.{attempt - 1}" if attempt > 1 else f"{epoch - 1}.{attempt}"
            forged = envelope.model_copy(
                update={
                    "message_id": f"storm-stale-{self.forged}",
                    "fence": older,
                    "attempt": max(1, attempt - 1),
                    "body": {"ok": True, "result": {"forged": MARKER}},
                }
            )
        else:
            if not self._settled(envelope):
                return None
            body = (
                {"ok": False, "error": f"{MARKER}: a forged failure", "retryable": False}
                if self.rng.random() < 0.5
                else {"ok": True, "result": {"forged": MARKER}}
            )
            forged = envelope.model_copy(update={"message_id": f"storm-settled-{self.forged}", "body": body})
        return encode(self.stack.signer.sign(forged))

    def _settled(self, report: Envelope) -> bool:
        """Whether the attempt (or map item) the report names can no longer take a report: the run has an
        intent, the stage moved to another fence, the item arrived, or the attempt is no longer open.
        Read from Redis, where the orchestrator has committed it: it never goes back."""
        keys = ShardKeys(self.stack.prefix, report.shard)
        record: dict[str, str] = self.stack.redis.hgetall(keys.run(report.run_id))  # type: ignore[assignment]
        stage = report.stage or ""
        if record.get("intent") or record.get("s:" + stage + ":fence") != report.fence:
            return True
        if report.item is not None and str(report.item) in invariants.barrier_members(
            self.stack.redis, keys, report.run_id, stage
        ):
            return True
        return record.get("s:" + stage + ":status") not in ("dispatched", "running")

    # ---- sending -----------------------------------------------------------------------------------

    async def send_due(self, channel: aio_pika.abc.AbstractChannel, now: float) -> None:
        due = [p for p in self.planned if p.due <= now]
        self.planned = [p for p in self.planned if p.due > now]
        self.rng.shuffle(due)  # reordered: among themselves, and after whatever the runs did meanwhile
        for p in due:
            raw = self.build(p)
            if raw is None:
                p.tries += 1
                if p.tries < 20:
                    p.due = now + self.rng.uniform(0.1, 0.5)
                    self.planned.append(p)
                else:
                    self.dropped += 1
                continue
            await channel.default_exchange.publish(
                aio_pika.Message(raw, delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
                routing_key=NAMES.shard_queue(p.shard),
                mandatory=True,
            )
            self.sent[p.run_id] += 1
            self.kinds[p.kind] += 1


async def storm_until_done(stack: Stack, storm: Storm, run_ids: list[str], restarts: list[Start]) -> None:
    """Run the storm while the runs go on; once they have all ended, replay a last, late part of it."""
    connection = await aio_pika.connect(stack.settings.amqp_url)
    try:
        channel = await connection.channel(publisher_confirms=True)
        tap = await channel.get_queue(TAP, ensure=False)
        loop = asyncio.get_running_loop()
        started = loop.time()
        restart_at = sorted(started + storm.rng.uniform(0.0, 5.0) for _ in restarts)
        ended_at: float | None = None
        async with Client(stack.settings) as client:
            while loop.time() - started < STORM_MAX_S:
                now = loop.time()
                while (message := await tap.get(no_ack=True, fail=False)) is not None:
                    for raw in reports_in(message):
                        storm.capture(raw, now)
                while restarts and restart_at and restart_at[0] <= now:
                    restart_at.pop(0)
                    start = restarts.pop()
                    await client.start(start.definition, start.context, idempotency_key=start.key)
                    storm.sent[start.run_id] += 1
                    storm.kinds["restart"] += 1
                await storm.send_due(channel, now)
                if ended_at is None and terminal_count(stack, run_ids) == len(run_ids):
                    ended_at = now
                    storm.late(now)
                if ended_at is not None and not storm.planned:
                    return
                await asyncio.sleep(0.02)
    finally:
        await connection.close()


def storm_workload(stack: Stack, rng: random.Random) -> tuple[list[Start], dict[str, Any]]:
    """Model-ingest runs (some cache hits, half with a slow stage, so that reports of a run interleave
    with the storm's) and a few bags; with each run's expected output."""
    starts: list[Start] = []
    expected: dict[str, Any] = {}
    for i in range(INGESTS):
        model = f"{'cached-' if rng.random() < 0.15 else ''}storm-{i}"
        if rng.random() < 0.5:
            stack.world.set_fault(
                model,
                rng.choice(("thumbnail.render", "semantic.analyse", "metadata.extract", "catalogue.publish")),
                delay_ms=rng.randint(100, 1500),
            )
        start = Start("model-ingest", {"modelId": model}, f"storm-ingest-{i}")
        starts.append(start)
        expected[start.run_id] = {"modelId": model, "catalogueId": f"cat-{model}"}
    for b in range(BAGS):
        items = [f"storm-bag{b}-{i}" for i in range(rng.randint(30, 80))]
        for item in rng.sample(items, k=len(items) // 5):
            stack.world.set_fault(item, "thumbnail.render", delay_ms=rng.randint(50, 800))
        start = Start("thumbnail-batch", {"modelIds": items}, f"storm-bag-{b}")
        starts.append(start)
        expected[start.run_id] = {
            "count": len(items),
            "thumbnails": [{"thumbnailUri": f"thumbs/{item}.png"} for item in items],
        }
    return starts, expected


def reports_in(message: aio_pika.abc.AbstractIncomingMessage) -> list[bytes]:
    """The reports a tapped message carries: itself, or each one in a worker's container."""
    if batch.is_container(message.headers):
        return batch.unpack(message.body, message.headers or {}, len(message.body))
    return [message.body]


def declare_tap(stack: Stack) -> None:
    """A queue that gets a copy of everything published to the shards through ``saga.runs``."""

    async def go() -> None:
        connection = await aio_pika.connect(stack.settings.amqp_url)
        try:
            channel = await connection.channel()
            queue = await channel.declare_queue(TAP, durable=False)
            runs = await channel.get_exchange(NAMES.runs_exchange, ensure=False)
            for shard in names.parse_shards("", stack.settings.shard_classes, stack.settings.shard_count):
                await queue.bind(runs, routing_key=shard)
        finally:
            await connection.close()

    asyncio.run(go())


def storm_violations(stack: Stack, storm: Storm, expected: dict[str, Any]) -> list[str]:
    """Each run's output is what its workers computed, no stored result or barrier member holds a forged
    value, and every storm message that reached a run's shard was recorded as refused."""
    found = []
    for run in invariants.load_runs(stack.redis, stack.prefix, list(expected)):
        if run.shard is None:
            continue  # check_runs names it
        output = status_document(run.record)["output"]
        if output != expected[run.run_id]:
            found.append(f"run {run.run_id}: output {str(output)[:200]}, expected {expected[run.run_id]}")
        changed = [f for f, v in run.record.items() if MARKER in v]
        keys = ShardKeys(stack.prefix, run.shard)
        for name, stage in run.plan.get("stages", {}).items():
            if stage.get("type") in ("join", "map"):
                members = invariants.barrier_members(stack.redis, keys, run.run_id, name)
                changed += [f"{name}[{m}]" for m, v in members.items() if MARKER in v]
        if changed:
            found.append(f"run {run.run_id}: forged values stored in {changed[:5]}")
        refused = run.count("callback.rejected")
        if refused < storm.sent[run.run_id]:
            found.append(f"run {run.run_id}: {storm.sent[run.run_id]} storm messages, {refused} recorded")
    return found


def test_a_storm_of_duplicated_reordered_stale_and_late_reports_changes_nothing(
    fault_seed: FaultSeed,
) -> None:
    """Drives 60 model-ingest runs and 3 thumbnail-batch bags of 30-80 items, 63 runs in all, under a
    storm of several hundred replayed, stale, settled and late reports and duplicate starts (seeded).
    Asserts: the storm sent some of every kind; every run completed with the output its workers
    computed; no result or barrier member holds a forged value; every storm message was recorded as a
    refused callback of its run; each join and bag released once with exactly its members, at most one
    accepted result per (run, stage, attempt), one effect per idempotency key, no unsent outbox entry,
    no dead letter and nothing on saga.rejected."""
    stack = Stack("storm")
    try:
        stack.setup()
        stack.start_orchestrator()
        stack.start_worker()
        wait_until_consuming(stack, is_shard_queue)
        wait_until_consuming(stack, is_task_queue)
        violations, run_ids = storm_scenario(stack, fault_seed)
        violations += invariants.check_runs(stack.redis, stack.prefix, run_ids, all_runs=True)
        violations += invariants.dead_letters(stack.queue_depths())
        assert_no_violations(violations, f"the invariants after a storm (seed {fault_seed.seed})")
    finally:
        stack.teardown()


def storm_scenario(stack: Stack, fault_seed: FaultSeed) -> tuple[list[str], list[str]]:
    """The storm on a serving stack (shared with the Redis Cluster suite): starts the workload, storms
    it until done, asserts liveness and that every kind was sent, and returns what the storm's own
    checks found (empty when sound) and the run ids, for the caller's invariant checks."""
    rng = fault_seed.rng
    declare_tap(stack)
    starts, expected = storm_workload(stack, rng)
    run_ids = [s.run_id for s in starts]
    restarts = rng.sample(starts, k=len(starts) // 5)
    storm = Storm(stack, rng)
    # Given many live runs
    start_all(stack.settings, starts)
    # When the storm hits their shards while they go on, and after they have ended
    asyncio.run(storm_until_done(stack, storm, run_ids, restarts))
    print(
        f"storm: {sum(storm.sent.values())} messages {dict(storm.kinds)} from {len(storm.captured)} "
        f"captured reports; {storm.dropped} settled reports never safe to send"
    )
    # Then every run completed as if there had been no storm, and every storm message was refused
    pending = invariants.wait_for_convergence(stack.redis, stack.prefix, run_ids, CONVERGE_S)
    if pending:
        print(f"orchestrator log, last lines:\n{log_tail(stack, 'orchestrator')}")
    assert_no_violations(pending, f"liveness under a storm (seed {fault_seed.seed})")
    assert {"replay", "stale", "settled", "late", "restart"} <= set(storm.kinds), storm.kinds
    # (the storm's last messages may still be queued: give them the same liveness bound)
    deadline = time.monotonic() + CONVERGE_S
    while storm_violations(stack, storm, expected) and time.monotonic() < deadline:
        time.sleep(0.5)
    violations = storm_violations(stack, storm, expected)
    runs = invariants.load_runs(stack.redis, stack.prefix, run_ids)
    reasons = Counter(
        e.detail.get("reason") for r in runs for e in r.history if e.kind == "callback.rejected"
    )
    print(f"recorded refusals by reason: {dict(reasons)} (storm sent {sum(storm.sent.values())})")
    return violations, run_ids

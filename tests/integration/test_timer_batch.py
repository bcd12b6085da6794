"""A shard's due timers fire as one batch, each its own transition (real Redis): every run's timeout
and retry goes through, a timer fired again changes nothing, and the timers of runs that are gone, or
that are no timers of ours, are dropped."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis.asyncio as aioredis

from orchestrator.bus.publisher import outgoing_from_payload
from orchestrator.client import start_envelope
from orchestrator.engine import clocks
from orchestrator.engine.model import Clock
from orchestrator.shard.processor import Processor
from tests.conftest import compile_yaml
from tests.integration.stack import publish_active
from tests.integration.test_kept_records import CountingStore, settled_and_sound, with_store
from tests.integration.test_nudge_race import SHARD, SIGNER

pytestmark = pytest.mark.services

QUEUED = """
    name: queued-probe
    version: "1.0.0"
    entry: look
    stages:
      - name: look
        type: action
        action: cache.lookup@1
        input: { modelId: "${context.modelId}" }
        queue_deadline_ms: 1000
        retry: { max_attempts: 2, initial_backoff_ms: 500, jitter: 0 }
        on_success: completed
"""
NOW = 1_800_000_000_000


def test_due_timers_fire_as_one_batch_and_those_of_no_run_here_are_dropped() -> None:
    async def main(store: CountingStore, client: aioredis.Redis) -> None:
        now = [NOW]
        processor = Processor(store, lambda: now[0])
        plan = compile_yaml(QUEUED)
        runs = [f"timers-{uuid.uuid4().hex[:8]}" for _ in range(5)]
        await publish_active(store, plan)
        starts = [start_envelope(SIGNER, r, "queued-probe", plan.digest, {"modelId": r}) for r in runs]
        await processor.handle_batch(SHARD, starts)
        await store.mark_sent(SHARD, list(await store.outbox(SHARD)))
        # When no worker took any task within the queue deadline
        now[0] = NOW + 1_001
        (due,) = await store.due_timers([SHARD], now[0])
        assert sorted(due) == sorted(clocks.member(r, Clock.QUEUE, "look", "1.1") for r in runs)
        gone = clocks.member("no-such-run", Clock.QUEUE, "look", "1.1")
        strange = "not-a-timer"
        for member in (gone, strange):
            await client.zadd(store.keys(SHARD).timers(), {member: now[0] - 1})
        outcomes = await processor.fire_timers(SHARD, [*due, gone, strange])
        # Then every run's attempt timed out in that one batch, and its retry is set
        assert [o.verdict.value if o.verdict else None for o in outcomes] == ["applied"] * 5 + [None, None]
        for run in runs:
            kinds = [e["kind"] for e in await store.history(SHARD, run)]
            assert kinds[-2:] == ["stage.timed_out", "retry.scheduled"], kinds
        # and the timers of no run here, or no timer at all, are gone
        timers = await client.zrange(store.keys(SHARD).timers(), 0, -1)
        assert gone not in timers and strange not in timers
        # When the backoffs are over, the second attempts go out, again as one batch
        now[0] += 600
        await store.mark_sent(SHARD, list(await store.outbox(SHARD)))
        (retries,) = await store.due_timers([SHARD], now[0])
        assert len(retries) == 5
        await processor.fire_timers(SHARD, retries)
        tasks = [outgoing_from_payload(p) for p in (await store.outbox(SHARD)).values()]
        assert sorted((t.body["run_id"], t.body["attempt"]) for t in tasks) == sorted((r, 2) for r in runs)
        # and a timer fired again (another process fired it meanwhile) changes nothing
        again = await processor.fire_timers(SHARD, retries)
        assert {o.verdict.value if o.verdict else None for o in again} == {"stale"}, again
        await settled_and_sound(processor, store, client, runs, "completed")

    asyncio.run(with_store(main))

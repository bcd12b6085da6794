"""A nudge that meets a conflict decides again on a fresh read that still knows which of a bag's items
arrived, so it re-sends only the missing ones (real Redis, a real competing transition)."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from orchestrator.bus.envelope import Signer, decode, signed_message
from orchestrator.bus.publisher import envelope_for, outgoing_from_payload
from orchestrator.client import start_envelope
from orchestrator.settings import DEVELOPMENT_SIGNING_KEY
from orchestrator.shard.processor import Processor
from orchestrator.store.redis_store import ApplyResult, RedisStore
from orchestrator.wire import ids
from tests.conftest import compile_yaml
from tests.faults import invariants
from tests.integration.stack import publish_active
from tests.unit.engine_sim import handler_output

pytestmark = pytest.mark.services

SHARD = "fast.0"
REDIS_URL = "redis://127.0.0.1:6379/0"
SIGNER = Signer.from_settings((DEVELOPMENT_SIGNING_KEY,))
SPLIT = """
    name: split-bag
    version: "1.0.0"
    entry: split
    stages:
      - name: split
        type: fork
        branches: [one, bag]
      - name: one
        type: action
        action: cache.lookup@1
        input: { modelId: "one" }
        on_success: meet
      - name: bag
        type: map
        worker: thumbnail.render@3
        queue: tasks.parallel
        items: "${context.modelIds}"
        max_items: 10
        input: { modelId: "${item}" }
        on_success: meet
      - name: meet
        type: join
        required: [one, bag]
        on_success: completed
"""


class RacingStore(RedisStore):
    """The store, but just before the first transition it applies, another delivery commits first."""

    competitor: Any = None

    async def apply_many(self, *args: Any, **kwargs: Any) -> list[ApplyResult]:
        if self.competitor is not None:
            competitor, self.competitor = self.competitor, None
            await competitor()
        return await super().apply_many(*args, **kwargs)


def test_a_nudge_retried_after_a_conflict_still_re_sends_only_the_missing_items() -> None:
    async def main() -> None:
        client = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
        store = RacingStore(client, prefix=f"t{uuid.uuid4().hex}")
        processor = Processor(store, lambda: int(time.time() * 1000))
        plan = compile_yaml(SPLIT)
        run_id = f"race-{uuid.uuid4().hex[:8]}"
        try:
            await store.load_library()
            await publish_active(store, plan)
            start = start_envelope(SIGNER, run_id, "split-bag", plan.digest, {"modelIds": ["a", "b", "c"]})
            await processor.handle_batch(SHARD, [start])
            tasks = {
                (m.body["stage"], m.body["item"]): m
                for m in map(outgoing_from_payload, (await store.outbox(SHARD)).values())
            }
            await store.mark_sent(SHARD, [m.message_id for m in tasks.values()])
            await processor.handle_batch(SHARD, [report(tasks["bag", 0])])  # item 0 arrived
            # When a nudge reads the run, then 'one' completes before the nudge commits (a conflict)
            store.competitor = lambda: processor.handle_batch(SHARD, [report(tasks["one", None])])
            outcome = await processor.nudge(SHARD, run_id, "nudge-1")
            # Then the retried nudge sent the missing items again, and only them
            sent = sorted((m.body["stage"], m.body["item"]) for m in outcome.publish if m.kind == "task")
            assert sent == [("bag", 1), ("bag", 2)]
            # and the run completes; the fault suite's shared invariants hold over it
            await answer_everything(store, processor)
            with redis.Redis.from_url(REDIS_URL, decode_responses=True) as r:
                violations = invariants.check_runs(r, store.prefix, [run_id], effects=False)
            invariants.assert_no_violations(violations, "a nudge racing a result")
        finally:
            keys = [k async for k in client.scan_iter(match=f"{store.prefix}:*")]
            if keys:
                await client.delete(*keys)
            await client.aclose()

    asyncio.run(main())


async def answer_everything(store: RedisStore, processor: Processor) -> None:
    """Deliver what the shard's outbox holds (tasks answered as a worker would) until it is empty."""
    for _ in range(20):
        entries = [outgoing_from_payload(p) for p in (await store.outbox(SHARD)).values()]
        if not entries:
            return
        await store.mark_sent(SHARD, [m.message_id for m in entries])
        for message in entries:
            if message.kind == "task":
                await processor.handle_batch(SHARD, [report(message)])
            elif message.kind == "barrier.released":
                await processor.handle_batch(SHARD, [envelope_for(message, SIGNER, 0)])
    raise AssertionError("the run did not settle")


def report(task: Any) -> Any:
    """The worker's report of ``task``, as the shard decodes it."""
    body = task.body
    fields = {n: body[n] for n in ("run_id", "shard", "stage", "attempt", "fence", "item", "digest")}
    result = handler_output(str(body["contract"]), body["input"])
    raw = signed_message(
        SIGNER,
        kind="result",
        message_id=ids.result_id(task.message_id),
        body={"ok": True, "result": result},
        **fields,
    )
    return decode(raw, SIGNER, 1_048_576)

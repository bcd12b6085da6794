"""Poison messages on the real services: a verified message whose transition fails on every delivery
(here: its run's record is corrupt) is dead-lettered after the delivery limit, its run is marked failed
with the reason, and the shard's other runs are not held up."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from orchestrator.bus import names
from orchestrator.bus.names import Names
from orchestrator.client import SyncClient
from orchestrator.store.keys import ShardKeys
from tests.integration.stack import Stack, poll, running

NAMES = Names()  # the stack runs in the default namespace, on a vhost of its own

pytestmark = pytest.mark.services


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with running("poison") as s:
        yield s


def test_a_poison_message_is_dead_lettered_and_fails_only_its_own_run(stack: Stack) -> None:
    with SyncClient(stack.settings) as client:
        stack.world.set_fault("poison-1", "thumbnail.render", delay_ms=1500)
        victim = client.start("model-ingest", {"modelId": "poison-1"})
        poll(
            lambda: stack.record(victim).get("s:render-thumbnail:status") == "running",
            20,
            what="render running",
        )
        # corrupt state (a bug, not bad input): every transition of this run now raises
        shard = stack.record(victim)["shard"]
        stack.redis.hset(ShardKeys(stack.prefix, shard).run(victim), "s:render-thumbnail:status", "bogus")
        others = [client.start("model-ingest", {"modelId": f"healthy-{i}"}) for i in range(10)]
        # the render result fails on every delivery, then its run is marked failed with the reason
        poll(lambda: stack.record(victim).get("status") == "failed", 60, what="the victim marked failed")
        record = stack.record(victim)
        assert record["reason"].startswith("poison message result-")
        assert "every delivery" in record["reason"]
        assert [e for e in stack.history(victim) if e["kind"] == "message.poisoned"]
        # and the message waits in the shard's dead-letter queue for a human (saga dead-letters)
        dlq = names.dead_letter_queue(NAMES.shard_queue(shard))
        poll(lambda: stack.queue_depths().get(dlq, 0) == 1, 30, what="the poison message dead-lettered")
        # the shard's other runs were not held up
        assert all(client.wait(run_id, timeout_s=60).state == "completed" for run_id in others)
        assert stack.queue_depths().get(NAMES.shard_queue(shard), 0) == 0

"""Invariant 10's infrastructure half: Redis going away never dead-letters a healthy message.

The stack runs against a Redis of its own (another loopback port, appendonly with fsync on every
write, so its state survives the restart). While runs are in flight Redis is killed; the orchestrator
must stop consuming rather than nack-loop (a nack loop burns delivery limits and dead-letters healthy
messages), and every run must complete once Redis is back.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.client import SyncClient
from tests.integration.own_redis import RedisServer
from tests.integration.stack import Stack

pytestmark = pytest.mark.services


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed; the services tests need it")
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        if server.process and server.process.poll() is None:
            server.kill()


def test_runs_survive_a_redis_outage_without_dead_lettering(own_redis: RedisServer) -> None:
    stack = Stack("redis-outage", redis_url=own_redis.url)
    stack.setup()
    try:
        stack.start_orchestrator()
        stack.start_worker(extra_env={"SAGA_DEMO_EFFECTS": "0"})  # the demo's ledger lives in that Redis too
        with SyncClient(stack.settings) as client:
            # Given runs in flight
            run_ids = [client.start("model-ingest", {"modelId": f"outage-{i}"}) for i in range(30)]
            # When Redis dies for three seconds and comes back with its state (AOF, fsync always)
            own_redis.kill()  # starts, tasks and results keep arriving at the shards meanwhile
            # a service can still start runs: the client knows the active version, the broker holds them
            run_ids += [client.start("model-ingest", {"modelId": f"during-{i}"}) for i in range(5)]
            time.sleep(3)
            own_redis.start()
            # Then every run completes and nothing was dead-lettered
            for run_id in run_ids:
                assert client.wait(run_id, timeout_s=90).state == "completed", run_id
        depths = stack.queue_depths()
        dead = {q: n for q, n in depths.items() if (q.endswith(".dlq") or q == "saga.rejected") and n}
        assert dead == {}, dead
        log = stack.log("orchestrator")
        assert "Redis unreachable; not consuming until it is back" in log  # it noticed, and it waited
    finally:
        stack.teardown()

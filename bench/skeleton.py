"""The protocol's skeleton: model-ingest's messages and commits with none of saga's own work.

What is left of a run when every check, decision and record but the commits themselves is taken away:
the same 11 hops on the critical path (the start, then a task and its result for cache-lookup, render,
the fork's two branches side by side, publish and the finaliser), each a persistent message published
with a confirm to a quorum queue, and one Redis commit for every message the orchestrator takes (an
EVAL writing the run's hash, a history entry and an outbox entry, as a transition does) before it
dispatches what follows: 6 on the critical path (the start and five results), the last of which ends
the run. An orchestrator process commits each message, then publishes what follows and acks; a worker
process publishes each task's result, then acks.
No envelope is signed or verified, no plan is read, no engine runs, nothing is validated.

It is the lower bound a Python implementation of this protocol reaches on this machine with these
clients (aiormq, redis-py with hiredis): the floor (hops x bare hop), plus the commits' round trips, plus
what waking two processes, an event loop and a client library up costs at every hop. ``bench/latency.py``
alternates its runs with saga's (``Driver``), between bare hops measured right before and after.

    python bench/skeleton.py orchestrator|worker AMQP_URL REDIS_URL PREFIX    (a role, until killed)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import aiormq
import redis.asyncio as aioredis
from aiormq.abc import DeliveredMessage
from pamqp import commands as spec

SHARD_QUEUE, TASK_QUEUE = "bench.skeleton.shard", "bench.skeleton.tasks"
QUORUM = {"x-queue-type": "quorum"}
PERSISTENT = spec.Basic.Properties(delivery_mode=2)
BRANCHES = frozenset({"semantic-analysis", "technical-metadata"})
# what each step dispatches next ("join": the fork's second branch has arrived)
NEXT = {
    "start": ["cache-lookup"],
    "cache-lookup": ["render-thumbnail"],
    "render-thumbnail": sorted(BRANCHES),
    "join": ["publish"],
    "publish": ["finaliser:0"],
    "finaliser:0": [],
}
# the run's hash and history entry; the outbox entry of what follows (one: the fork's first branch); the
# run's end, announced to the driver (in the commit itself, as a saga run's end is)
COMMIT = """
redis.call('HSET', KEYS[1], 'state', ARGV[1], 'rev', ARGV[2])
redis.call('XADD', KEYS[2], '*', 'kind', ARGV[3], 'rev', ARGV[2])
if ARGV[4] ~= '' then redis.call('HSET', KEYS[3], ARGV[5], ARGV[4]) end
if ARGV[6] == '1' then
  redis.call('HSET', KEYS[4], ARGV[5], 'completed')
  redis.call('PUBLISH', KEYS[4] .. ':' .. ARGV[5], 'completed')
end
return 1
"""
TASK_PADDING = "x" * 600  # about a model-ingest task's size


async def _channel(amqp_url: str) -> tuple[aiormq.abc.AbstractConnection, aiormq.abc.AbstractChannel]:
    connection = await aiormq.connect(amqp_url)
    channel = await connection.channel(publisher_confirms=True)
    await channel.basic_qos(prefetch_count=32)
    for queue in (SHARD_QUEUE, TASK_QUEUE):
        await channel.queue_declare(queue, durable=True, arguments=QUORUM)
    return connection, channel


async def orchestrator(amqp_url: str, redis_url: str, prefix: str) -> None:
    """Commit each result, then publish what follows it with a confirm, then ack."""
    _, channel = await _channel(amqp_url)
    redis = aioredis.Redis.from_url(redis_url, decode_responses=True)
    commit = redis.register_script(COMMIT)
    runs: dict[str, dict[str, Any]] = {}

    async def on_result(message: DeliveredMessage) -> None:
        body = json.loads(message.body)
        run, stage = body["run"], body["stage"]
        state = runs.setdefault(run, {"done": [], "rev": 0})
        state["done"].append(stage)
        state["rev"] += 1
        step: str | None = stage
        if stage in BRANCHES:
            step = "join" if set(state["done"]) >= BRANCHES else None
        tasks = [
            json.dumps({"run": run, "stage": s, "input": body.get("result"), "pad": TASK_PADDING})
            for s in (NEXT[step] if step else [])
        ]
        finished = step == "finaliser:0"
        record = json.dumps({"status": "completed" if finished else "running", "done": state["done"]})
        keys = [f"{prefix}:run:{run}", f"{prefix}:history:{run}", f"{prefix}:outbox", f"{prefix}:finished"]
        first = tasks[0] if tasks else ""
        await commit(keys=keys, args=[record, state["rev"], stage, first, run, "1" if finished else "0"])
        if finished:
            runs.pop(run)
        sends = [
            channel.basic_publish(t.encode(), routing_key=TASK_QUEUE, properties=PERSISTENT) for t in tasks
        ]
        await asyncio.gather(*sends)
        await channel.basic_ack(message.delivery_tag)

    await channel.basic_consume(SHARD_QUEUE, on_result)
    await asyncio.Future()


async def worker(amqp_url: str) -> None:
    """Publish each task's result with a confirm, then ack the task."""
    _, channel = await _channel(amqp_url)

    async def on_task(message: DeliveredMessage) -> None:
        body = json.loads(message.body)
        result = json.dumps({"run": body["run"], "stage": body["stage"], "result": {"ok": True}})
        await channel.basic_publish(result.encode(), routing_key=SHARD_QUEUE, properties=PERSISTENT)
        await channel.basic_ack(message.delivery_tag)

    await channel.basic_consume(TASK_QUEUE, on_task)
    await asyncio.Future()


@contextmanager
def roles(amqp_url: str, redis_url: str, prefix: str) -> Iterator[dict[str, int]]:
    """The orchestrator and the worker, each a process of its own, for the ``with`` body, which gets
    their process ids by role."""
    processes = {
        role: subprocess.Popen([sys.executable, __file__, role, amqp_url, redis_url, prefix])
        for role in ("orchestrator", "worker")
    }
    try:
        yield {role: process.pid for role, process in processes.items()}
    finally:
        for process in processes.values():
            process.kill()
            process.wait()


class Driver:
    """Starts skeleton runs and times them, as ``bench/run.py`` times saga's single runs: from the start's
    publish until the run's end is announced (subscribed before the start is sent)."""

    def __init__(self, amqp_url: str, redis_url: str, prefix: str, timeout_s: float = 30.0) -> None:
        self.amqp_url, self.prefix, self.timeout_s = amqp_url, prefix, timeout_s
        self.redis = aioredis.Redis.from_url(redis_url, decode_responses=True)
        self._ends = self.redis.pubsub(ignore_subscribe_messages=True)
        self._amqp: tuple[aiormq.abc.AbstractConnection, aiormq.abc.AbstractChannel] | None = None

    async def open(self) -> None:
        async with asyncio.timeout(self.timeout_s):
            self._amqp = await _channel(self.amqp_url)

    async def one(self) -> float:
        """One run's latency in ms; raises TimeoutError for a run not finished within the timeout."""
        assert self._amqp is not None, "open() first"
        channel = self._amqp[1]
        run = uuid.uuid4().hex
        ended = f"{self.prefix}:finished:{run}"
        await self._ends.subscribe(ended)
        try:
            async with asyncio.timeout(self.timeout_s):
                started = time.perf_counter()
                start = json.dumps({"run": run, "stage": "start", "context": {"modelId": run}})
                await channel.basic_publish(start.encode(), routing_key=SHARD_QUEUE, properties=PERSISTENT)
                while True:
                    message = await self._ends.get_message(ignore_subscribe_messages=True, timeout=None)
                    if message is not None and message["channel"] == ended:
                        return (time.perf_counter() - started) * 1000
        finally:
            await self._ends.unsubscribe(ended)

    async def close(self) -> None:
        """Delete the skeleton's queues and keys (what fails to be deleted goes with the vhost and the
        prefix when the stack is torn down)."""
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self.timeout_s):
                if self._amqp is not None:
                    for queue in (SHARD_QUEUE, TASK_QUEUE):
                        await self._amqp[1].queue_delete(queue)
                keys = [key async for key in self.redis.scan_iter(match=f"{self.prefix}:*", count=1000)]
                if keys:
                    await self.redis.delete(*keys)
        with contextlib.suppress(Exception):
            if self._amqp is not None:
                await self._amqp[0].close()
        with contextlib.suppress(Exception):
            await self._ends.aclose()
        await self.redis.aclose()


def main(argv: list[str]) -> None:
    role, amqp_url, redis_url, prefix = argv
    asyncio.run(orchestrator(amqp_url, redis_url, prefix) if role == "orchestrator" else worker(amqp_url))


if __name__ == "__main__":
    main(sys.argv[1:])

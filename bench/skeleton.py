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
runs it in the same sitting as saga's runs and the bare hop.

    python bench/skeleton.py orchestrator|worker AMQP_URL REDIS_URL PREFIX    (a role, until killed)
"""

from __future__ import annotations

import asyncio
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
COMMIT = """
redis.call('HSET', KEYS[1], 'state', ARGV[1], 'rev', ARGV[2])
redis.call('XADD', KEYS[2], '*', 'kind', ARGV[3], 'rev', ARGV[2])
if ARGV[4] ~= '' then redis.call('HSET', KEYS[3], ARGV[5], ARGV[4]) end
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
        keys = [f"{prefix}:run:{run}", f"{prefix}:history:{run}", f"{prefix}:outbox"]
        await commit(keys=keys, args=[record, state["rev"], stage, tasks[0] if tasks else "", run])
        if finished:
            runs.pop(run)
            await redis.hset(f"{prefix}:finished", run, "completed")
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
def roles(amqp_url: str, redis_url: str, prefix: str) -> Iterator[None]:
    """The orchestrator and the worker, each a process of its own, for the ``with`` body."""
    processes = [
        subprocess.Popen([sys.executable, __file__, role, amqp_url, redis_url, prefix])
        for role in ("orchestrator", "worker")
    ]
    try:
        yield
    finally:
        for process in processes:
            process.kill()
            process.wait()


async def latencies(
    amqp_url: str, redis_url: str, prefix: str, runs: int, timeout_s: float = 30.0
) -> list[float]:
    """``runs`` skeleton runs back to back (after five warm-up runs), each timed as ``bench/run.py`` times
    saga's: from the start's publish until a 1 ms poll sees the run finished. Deletes its queues and
    keys after."""
    connection, channel = await _channel(amqp_url)
    redis = aioredis.Redis.from_url(redis_url, decode_responses=True)
    try:
        times = []
        for i in range(runs + 5):
            run = uuid.uuid4().hex
            started = time.perf_counter()
            start = json.dumps({"run": run, "stage": "start", "context": {"modelId": f"s{i}"}})
            await channel.basic_publish(start.encode(), routing_key=SHARD_QUEUE, properties=PERSISTENT)
            deadline = time.monotonic() + timeout_s
            while await redis.hget(f"{prefix}:finished", run) is None:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"skeleton run {run} did not finish within {timeout_s:g} s")
                await asyncio.sleep(0.001)
            if i >= 5:
                times.append((time.perf_counter() - started) * 1000)
        return times
    finally:
        for queue in (SHARD_QUEUE, TASK_QUEUE):
            await channel.queue_delete(queue)
        keys = [key async for key in redis.scan_iter(match=f"{prefix}:*", count=1000)]
        if keys:
            await redis.delete(*keys)
        await redis.aclose()
        await connection.close()


def main(argv: list[str]) -> None:
    role, amqp_url, redis_url, prefix = argv
    asyncio.run(orchestrator(amqp_url, redis_url, prefix) if role == "orchestrator" else worker(amqp_url))


if __name__ == "__main__":
    main(sys.argv[1:])

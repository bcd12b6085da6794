"""The topology against the real RabbitMQ (127.0.0.1:5672, guest/guest), each test in a vhost of its own that
rabbitmqctl creates and deletes."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aio_pika
import pytest

from orchestrator.bus.names import Names
from orchestrator.bus.topology import Topology, apply_topology, build_topology, serving_queues, to_definitions
from orchestrator.contracts import Registry
from orchestrator.shardmap import ShardMap

pytestmark = [
    pytest.mark.services,
    pytest.mark.skipif(shutil.which("rabbitmqctl") is None, reason="rabbitmqctl is not installed"),
]

ROOT = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1:5672"
NAMES = Names()
RUNS_EXCHANGE, TASKS_EXCHANGE = NAMES.runs_exchange, NAMES.tasks_exchange
SHARD_QUEUES = [NAMES.shard_queue(f"{c}.{n}") for c in ("fast", "slow") for n in range(4)]
RENDER_PARALLEL = NAMES.task_queue("tasks.parallel", "thumbnail.render@3")


def rabbitmqctl(*args: str) -> str:
    result = subprocess.run(
        ["rabbitmqctl", "-q", *args], capture_output=True, text=True, timeout=30, check=False
    )
    assert result.returncode == 0, f"rabbitmqctl {' '.join(args)}: {result.stderr or result.stdout}"
    return result.stdout


def url(vhost: str, user: str = "guest", password: str = "guest") -> str:
    return f"amqp://{user}:{password}@{HOST}/{quote(vhost, safe='')}"


@pytest.fixture
def vhost() -> Iterator[str]:
    name = f"saga-test-{uuid.uuid4().hex[:10]}"
    rabbitmqctl("add_vhost", name)
    try:
        rabbitmqctl("set_permissions", "-p", name, "guest", ".*", ".*", ".*")
        yield name
    finally:
        rabbitmqctl("delete_vhost", name)


@pytest.fixture(scope="module")
def topo(registry: Registry) -> Topology:
    return build_topology(NAMES, ShardMap.seed(("fast", "slow"), 4), serving_queues(registry.contracts()), 20)


def broker_queues(vhost: str) -> dict[str, dict[str, Any]]:
    """name -> arguments, as the broker reports them."""
    rows = json.loads(rabbitmqctl("list_queues", "-p", vhost, "name", "arguments", "--formatter", "json"))
    return {row["name"]: {key: value for key, _type, value in row["arguments"]} for row in rows}


async def drain(channel: aio_pika.abc.AbstractChannel, name: str) -> list[bytes]:
    """Every message ready in queue ``name`` (consumed: basic.get is refused on quorum queues with single
    active consumer)."""
    queue = await channel.declare_queue(name, passive=True)
    count = queue.declaration_result.message_count or 0
    bodies: list[bytes] = []
    if count:
        async with queue.iterator(no_ack=True) as messages:
            while len(bodies) < count:
                bodies.append((await asyncio.wait_for(anext(messages), 5.0)).body)
    return bodies


async def _apply(vhost: str, topology: Topology, times: int = 1) -> None:
    connection = await aio_pika.connect(url(vhost))
    async with connection:
        channel = await connection.channel()
        for _ in range(times):
            await apply_topology(channel, topology)


# ---- declare -----------------------------------------------------------------------------------------------


def test_apply_twice_declares_everything_as_built(vhost: str, topo: Topology) -> None:
    asyncio.run(_apply(vhost, topo, times=2))  # idempotent: the second pass redeclares without error

    async def passive_checks() -> None:
        connection = await aio_pika.connect(url(vhost))
        async with connection:
            channel = await connection.channel()
            for exchange in topo.exchanges:
                await channel.get_exchange(exchange.name)  # passive: raises if missing
            for queue in topo.queues:
                declared = await channel.declare_queue(queue.name, passive=True)
                assert declared.declaration_result.message_count == 0

    asyncio.run(passive_checks())

    assert broker_queues(vhost) == {q.name: dict(q.arguments) for q in topo.queues}
    rows = rabbitmqctl("list_exchanges", "-p", vhost, "name", "type", "durable", "--formatter", "json")
    exchanges = {r["name"]: (r["type"], r["durable"]) for r in json.loads(rows)}
    for exchange in topo.exchanges:
        assert exchanges[exchange.name] == (exchange.type, True)
    rows = rabbitmqctl(
        "list_bindings", "-p", vhost, "source_name", "destination_name", "routing_key", "--formatter", "json"
    )
    bindings = {(r["source_name"], r["destination_name"], r["routing_key"]) for r in json.loads(rows)}
    assert {(b.source, b.destination, b.routing_key) for b in topo.bindings} <= bindings


def test_routing(vhost: str, topo: Topology) -> None:
    """Starts spread over the class's shards, one shard each; saga.runs routes by shard id; a rejected task
    is dead-lettered to its .dlq."""

    async def scenario() -> None:
        await _apply(vhost, topo)
        connection = await aio_pika.connect(url(vhost))
        async with connection:
            channel = await connection.channel()  # publisher confirms: publish returns once queued
            starts = await channel.get_exchange(NAMES.start_exchange("fast"))
            run_ids = [uuid.uuid4().hex for _ in range(16)]
            for run_id in run_ids:
                await starts.publish(aio_pika.Message(run_id.encode()), routing_key=run_id, mandatory=True)

            landed = {name: await drain(channel, name) for name in SHARD_QUEUES}
            everything = sorted(body.decode() for bodies in landed.values() for body in bodies)
            assert everything == sorted(run_ids)  # each start in exactly one shard queue
            used = {name for name, bodies in landed.items() if bodies}
            assert all(name.startswith("saga.shard.fast.") for name in used)
            assert len(used) >= 2  # consistent hashing spreads them (16 keys on one shard: p ~ 1e-9)

            runs = await channel.get_exchange(RUNS_EXCHANGE)
            await runs.publish(aio_pika.Message(b"for fast.2"), routing_key="fast.2", mandatory=True)
            landed = {name: await drain(channel, name) for name in SHARD_QUEUES}
            assert {name: bodies for name, bodies in landed.items() if bodies} == {
                "saga.shard.fast.2": [b"for fast.2"]
            }

            tasks = await channel.get_exchange(TASKS_EXCHANGE)
            await tasks.publish(aio_pika.Message(b"poison"), routing_key=RENDER_PARALLEL, mandatory=True)
            queue = await channel.get_queue(RENDER_PARALLEL)
            message = await queue.get(fail=False)
            assert message is not None
            await message.reject(requeue=False)
            dlq = await channel.get_queue(NAMES.task_dead_letters("tasks.parallel"))
            for _ in range(50):  # at-least-once dead-lettering is asynchronous
                dead = await dlq.get(no_ack=True, fail=False)
                if dead is not None:
                    break
                await asyncio.sleep(0.1)
            assert dead is not None and dead.body == b"poison"
            assert dead.headers["x-first-death-reason"] == "rejected"
            assert dead.headers["x-first-death-queue"] == RENDER_PARALLEL

    asyncio.run(scenario())


def test_delivery_limit_dead_letters_a_message_requeued_too_often(vhost: str) -> None:
    small = build_topology(NAMES, ShardMap.seed(("fast",), 1), [], 2)

    async def scenario() -> int:
        await _apply(vhost, small)
        connection = await aio_pika.connect(url(vhost))
        async with connection:
            channel = await connection.channel()
            runs = await channel.get_exchange(RUNS_EXCHANGE)
            await runs.publish(aio_pika.Message(b"m"), routing_key="fast.0", mandatory=True)
            queue = await channel.get_queue("saga.shard.fast.0")
            deliveries = 0
            async with queue.iterator() as messages:  # a consumer: SAC quorum queues refuse basic.get
                while deliveries < 10:
                    try:  # once dead-lettered, nothing comes back
                        message = await asyncio.wait_for(anext(messages), 1.0)
                    except TimeoutError:
                        break
                    deliveries += 1
                    await message.nack(requeue=True)
            dlq = await channel.get_queue("saga.shard.fast.0.dlq")
            for _ in range(50):
                dead = await dlq.get(no_ack=True, fail=False)
                if dead is not None:
                    assert dead.headers["x-first-death-reason"] == "delivery_limit"
                    return deliveries
                await asyncio.sleep(0.1)
            raise AssertionError("the message never reached saga.shard.fast.0.dlq")

    assert asyncio.run(scenario()) == 3  # the limit (2) counts returns: the third return dead-letters


def test_apply_refuses_changed_arguments(vhost: str) -> None:
    import aiormq

    asyncio.run(_apply(vhost, build_topology(NAMES, ShardMap.seed(("fast",), 1), [], 20)))
    with pytest.raises(aiormq.exceptions.ChannelPreconditionFailed, match="x-delivery-limit"):
        asyncio.run(_apply(vhost, build_topology(NAMES, ShardMap.seed(("fast",), 1), [], 30)))


# ---- the file and the command ------------------------------------------------------------------------------


def test_definitions_import_agrees_with_apply(vhost: str, topo: Topology) -> None:
    """The exported file is loadable by the broker (users included) and declares exactly what apply does:
    applying on top of it is a no-op, not a PRECONDITION_FAILED (JSON integers vs AMQP byte/short/long)."""
    user, password = f"{vhost}-user", uuid.uuid4().hex
    # rabbitmqctl runs as the rabbitmq user, who cannot read pytest's tmp_path (and 3.10 refuses "-" for
    # stdin): a world-readable file of our own in the system temporary directory
    fd, path = tempfile.mkstemp(prefix=f"{vhost}-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as file:
            json.dump(to_definitions(topo, vhost, [(user, password)]), file)
        os.chmod(path, 0o644)
        rabbitmqctl("import_definitions", path)
        assert broker_queues(vhost) == {q.name: dict(q.arguments) for q in topo.queues}

        async def as_imported_user() -> None:
            connection = await aio_pika.connect(url(vhost, user, password))
            async with connection:
                channel = await connection.channel()
                await channel.declare_queue("saga.shard.fast.0", passive=True)

        asyncio.run(as_imported_user())
        asyncio.run(_apply(vhost, topo))
    finally:
        os.unlink(path)
        subprocess.run(["rabbitmqctl", "-q", "delete_user", user], capture_output=True, check=False)


def test_topology_apply_command(vhost: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAGA_")}
    env["SAGA_AMQP_URL"] = url(vhost)
    command = [sys.executable, "-m", "orchestrator", "topology", "apply"]
    result = subprocess.run(
        command, check=False, env=env, cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("applied 6 exchanges, 59 queues, 66 bindings to amqp://guest:***@")
    assert len(broker_queues(vhost)) == 59
    again = subprocess.run(
        command, check=False, env=env, cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert again.returncode == 0, again.stderr

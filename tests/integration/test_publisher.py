"""The publisher on the real broker: confirms, mandatory returns, and coalesced writes that stay intact."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import aio_pika
import pytest

from orchestrator.bus import names
from orchestrator.bus.envelope import Signer, decode
from orchestrator.bus.publisher import Publisher
from orchestrator.engine.model import Outgoing
from tests.integration.stack import Stack

pytestmark = pytest.mark.services


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    s = Stack("publisher")
    s.setup()
    try:
        yield s
    finally:
        s.teardown()


def task(i: int, queue: str) -> Outgoing:
    body = {
        "run_id": f"r-{i}",
        "shard": "fast.0",
        "stage": "s",
        "attempt": 1,
        "fence": "1.1",
        "item": i,
        "contract": "thumbnail.render@3",
        "digest": "sha256:x",
        "input": {"modelId": f"m-{i}", "pad": "x" * i},
    }
    return Outgoing(f"task-{i}-{uuid.uuid4().hex[:6]}", "task", ("task", queue), body)


def test_concurrent_publishes_are_confirmed_and_arrive_intact_in_order(stack: Stack) -> None:
    signer = Signer.from_settings(stack.settings.signing_keys)
    messages = [task(i, names.PARALLEL_TASKS) for i in range(300)]

    async def go() -> list[bytes]:
        connection = await aio_pika.connect(stack.settings.amqp_url)
        try:
            channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
            confirmed = await Publisher(channel, signer).publish_all(messages, 1)
            assert confirmed == [m.message_id for m in messages]  # every one, in order
            queue = await channel.get_queue(names.PARALLEL_TASKS, ensure=False)
            bodies = []
            async with queue.iterator() as it:
                async for message in it:
                    bodies.append(message.body)
                    await message.ack()
                    if len(bodies) == len(messages):
                        break
            return bodies
        finally:
            await connection.close()

    bodies = asyncio.run(go())
    decoded = [decode(b, signer, 1_000_000) for b in bodies]  # every frame intact: signatures verify
    assert [e.message_id for e in decoded] == [m.message_id for m in messages]
    assert [e.body["input"]["pad"] for e in decoded] == ["x" * i for i in range(300)]


def test_an_unroutable_mandatory_message_is_not_confirmed(stack: Stack) -> None:
    signer = Signer.from_settings(stack.settings.signing_keys)

    async def go() -> list[str]:
        connection = await aio_pika.connect(stack.settings.amqp_url)
        try:
            channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
            publisher = Publisher(channel, signer)
            lost = task(1, "no-such-queue")
            fine = task(2, names.ACTION_TASKS)
            return await publisher.publish_all([lost, fine], 1)
        finally:
            await connection.close()

    confirmed = asyncio.run(go())
    assert len(confirmed) == 1 and confirmed[0].startswith("task-2-")  # the lost one stays in the outbox

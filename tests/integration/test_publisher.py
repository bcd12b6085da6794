"""The publisher on the real broker: confirms, mandatory returns, and coalesced writes that stay intact."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import aio_pika
import aio_pika.abc
import aiormq.exceptions
import pytest
from pamqp import commands as spec

from orchestrator.bus.envelope import Signer, decode
from orchestrator.bus.names import Names
from orchestrator.bus.publisher import PUBLISH_ATTEMPTS, Publisher, _close_for_retry, _transient
from orchestrator.wire.outgoing import Outgoing
from tests.integration.stack import Stack

pytestmark = pytest.mark.services
NAMES = Names()


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
    messages = [task(i, "tasks.parallel") for i in range(300)]

    async def go() -> list[bytes]:
        connection = await aio_pika.connect(stack.settings.amqp_url)
        try:
            channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
            confirmed = await Publisher(channel, signer, NAMES).publish_all(messages, 1)
            assert confirmed == [m.message_id for m in messages]  # every one, in order
            queue = await channel.get_queue(
                NAMES.task_queue("tasks.parallel", "thumbnail.render@3"), ensure=False
            )
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
            publisher = Publisher(channel, signer, NAMES)
            lost = Outgoing("result-1", "result", ("shard", "nowhere.9"), task(1, "x").body)
            fine = task(2, "tasks.actions")
            return await publisher.publish_all([lost, fine], 1)
        finally:
            await connection.close()

    confirmed = asyncio.run(go())
    assert len(confirmed) == 1 and confirmed[0].startswith("task-2-")  # the lost one stays in the outbox


def test_a_task_for_a_contract_no_worker_has_served_waits_in_its_own_queue(stack: Stack) -> None:
    """The publisher declares the queue of a task queue and contract version the first time it sends there,
    so the task is confirmed and waits for a worker of that version instead of coming back unroutable."""
    signer = Signer.from_settings(stack.settings.signing_keys)
    waiting = task(3, "gpu-pool")
    waiting.body["contract"] = "never.served@7"
    name = NAMES.task_queue("gpu-pool", "never.served@7")

    async def go() -> tuple[list[str], int, int]:
        connection = await aio_pika.connect(stack.settings.amqp_url)
        try:
            channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
            confirmed = await Publisher(channel, signer, NAMES).publish_all([waiting], 1)
            declared = await channel.declare_queue(name, passive=True)
            dlq = await channel.declare_queue(NAMES.task_dead_letters("gpu-pool"), passive=True)
            assert dlq.declaration_result.message_count == 0
            result = declared.declaration_result
            return confirmed, result.message_count or 0, result.consumer_count or 0
        finally:
            await connection.close()

    confirmed, messages, consumers = asyncio.run(go())
    assert confirmed == [waiting.message_id] and (messages, consumers) == (1, 0)


def test_a_queue_declared_with_other_arguments_still_gets_its_tasks_and_the_channel_stays_open(
    stack: Stack,
) -> None:
    """Another process declared the contract queue with another delivery limit: the broker refuses this
    publisher's declaration, on a channel of its own, and the task still goes to the queue that exists."""
    signer = Signer.from_settings(stack.settings.signing_keys)
    name = NAMES.task_queue("mismatch", "x.y@1")
    first, second = task(5, "mismatch"), task(6, "mismatch")
    first.body["contract"] = second.body["contract"] = "x.y@1"

    async def go() -> tuple[list[str], int, bool]:
        connection = await aio_pika.connect(stack.settings.amqp_url)
        try:
            other = await connection.channel()
            await other.declare_queue(
                name, durable=True, arguments={"x-queue-type": "quorum", "x-delivery-limit": 3}
            )
            channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
            publisher = Publisher(channel, signer, NAMES, 20, declare_on=connection.channel)
            confirmed = await publisher.publish_all([first], 1)
            confirmed += await publisher.publish_all([second], 1)
            declared = await channel.declare_queue(name, passive=True)
            return confirmed, declared.declaration_result.message_count or 0, channel.is_closed
        finally:
            await connection.close()

    confirmed, waiting, closed = asyncio.run(go())
    assert confirmed == [first.message_id, second.message_id] and waiting == 2 and not closed


def test_a_nacked_publish_moves_the_publisher_to_a_fresh_channel(stack: Stack) -> None:
    """RabbitMQ nacks a publish to a full queue that rejects on overflow. It also nacks (on 3.10) a
    channel's publish to a quorum queue electing a leader, and then every later one on that channel:
    every nacked publish must leave the publisher on another channel, and an unroutable one must not."""
    signer = Signer.from_settings(stack.settings.signing_keys)
    queue_name = f"saga.test.full.{uuid.uuid4().hex[:8]}"

    async def go() -> tuple[int, bool, bool]:
        connection = await aio_pika.connect(stack.settings.amqp_url)
        opened = 0

        async def fresh() -> aio_pika.abc.AbstractChannel:
            nonlocal opened
            opened += 1
            return await connection.channel(publisher_confirms=True, on_return_raises=True)

        try:
            channel = await fresh()
            arguments = {"x-max-length": 1, "x-overflow": "reject-publish"}
            await channel.declare_queue(queue_name, durable=True, arguments=arguments)
            publisher = Publisher(channel, signer, NAMES, renew_with=fresh)
            await publisher.publish_bytes(b"first", "m-1", "", queue_name)  # fills the queue
            assert publisher.channel is channel
            with pytest.raises(aiormq.exceptions.DeliveryError) as nacked:
                await publisher.publish_bytes(b"second", "m-2", "", queue_name)
            renewed = publisher.channel is not channel and not publisher.channel.is_closed
            before = publisher.channel
            with pytest.raises(aiormq.exceptions.PublishError):
                await publisher.publish_bytes(b"nowhere", "m-3", "", f"{queue_name}.missing")
            await before.queue_delete(queue_name)
            await publisher.close()
            assert isinstance(nacked.value.frame, spec.Basic.Nack)
            return opened, renewed, publisher.channel is before
        finally:
            await connection.close()

    opened, renewed, kept_for_unroutable = asyncio.run(go())
    # the first channel, then one per nacked try (the publish is tried PUBLISH_ATTEMPTS times)
    assert renewed and opened == 1 + PUBLISH_ATTEMPTS
    assert kept_for_unroutable


def test_a_renewed_channel_fails_its_unconfirmed_publishes_so_that_they_are_retried(stack: Stack) -> None:
    """Closing a renewed channel with publishes still unconfirmed must fail them with an error the
    publisher retries (on the fresh channel), never cancel them: a cancelled publish cancels its
    caller."""

    async def go() -> BaseException:
        connection = await aio_pika.connect(stack.settings.amqp_url)
        try:
            channel = await connection.channel(publisher_confirms=True)
            underlay = await channel.get_underlay_channel()
            # what aiormq makes for each publish and resolves with its confirm: one not back yet
            pending = underlay.create_future()
            await _close_for_retry(channel)
            assert channel.is_closed and pending.done()
            return pending.exception()  # type: ignore[return-value]  # raises if cancelled instead
        finally:
            await connection.close()

    failed = asyncio.run(go())
    assert _transient(failed), repr(failed)  # a channel closed or invalid: tried again

"""A worker's subscription (``orchestrator/bus/inbound.py``): deliveries straight from aiormq on a robust
channel, consumed again by itself after the broker drops the connection, and not again once cancelled.
Real RabbitMQ, on a vhost of its own."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from urllib.parse import quote

import aio_pika
import pytest

from orchestrator.bus.connect import connect_robust
from orchestrator.bus.inbound import Delivered, Subscription
from tests.integration.stack import rabbitmqctl

pytestmark = pytest.mark.services

QUEUE = "subscribed"
WAIT_S = 30.0  # a liveness bound far above a reconnect (the connection retries every second or so)


@asynccontextmanager
async def vhost() -> AsyncIterator[tuple[str, str]]:
    """A vhost of its own: its AMQP URL and its name."""
    name = f"saga-test-subscription-{uuid.uuid4().hex[:8]}"
    rabbitmqctl("add_vhost", name)
    rabbitmqctl("set_permissions", "-p", name, "guest", ".*", ".*", ".*")
    try:
        yield f"amqp://guest:guest@127.0.0.1:5672/{quote(name, safe='')}", name
    finally:
        rabbitmqctl("delete_vhost", name)


async def publish(url: str, body: bytes) -> None:
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        await channel.default_exchange.publish(aio_pika.Message(body, message_id=body.decode()), QUEUE)


async def next_of(inbox: asyncio.Queue[Delivered]) -> Delivered:
    return await asyncio.wait_for(inbox.get(), WAIT_S)


def consumers(name: str) -> int:
    for line in rabbitmqctl("list_queues", "-p", name, "name", "consumers").splitlines():
        queue, _, count = line.partition("\t")
        if queue == QUEUE:
            return int(count)
    raise AssertionError(f"no queue {QUEUE} on {name}")


async def until_consumed(name: str, want: int) -> None:
    for _ in range(int(WAIT_S / 0.1)):
        if consumers(name) == want:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{QUEUE} never had {want} consumer(s)")


async def reopened(channel: aio_pika.abc.AbstractChannel, before: object, poll_s: float = 0.1) -> object:
    """Wait until aio-pika has reopened ``channel`` on a new connection; its new aiormq channel."""
    for _ in range(int(WAIT_S / poll_s)):
        await asyncio.sleep(poll_s)
        try:
            now = await asyncio.wait_for(channel.get_underlay_channel(), 1.0)
        except Exception:  # closed, or still reconnecting
            continue
        if now is not before and not now.is_closed:
            return now
    raise AssertionError("the channel was never reopened")


def test_a_subscription_consumes_again_after_the_broker_drops_its_connection_and_not_once_cancelled() -> None:
    async def main() -> None:
        async with vhost() as (url, name):
            connection = await connect_robust(url)
            try:
                channel = await connection.channel()
                await channel.declare_queue(QUEUE, durable=True, arguments={"x-queue-type": "quorum"})
                inbox: asyncio.Queue[Delivered] = asyncio.Queue()
                subscription = Subscription(channel, QUEUE, inbox.put_nowait)
                await subscription.start()

                await publish(url, b"before")
                first = await next_of(inbox)
                assert (first.body, first.message_id, first.routing_key, first.redelivered) == (
                    b"before",
                    "before",
                    QUEUE,
                    False,
                )
                await first.ack()

                consumed_on = await channel.get_underlay_channel()
                rabbitmqctl("close_all_connections", "--vhost", name, "the test drops the connection")
                consumed_on = await reopened(channel, consumed_on)
                await until_consumed(name, 1)  # aio-pika reopened the channel; the subscription consumed
                await publish(url, b"after")
                second = await next_of(inbox)
                assert second.body == b"after" and second.channel is not first.channel
                await second.ack()

                # dropped again, and again as soon as aio-pika has reopened the channel (its restore and
                # the subscription's consume may still be on their way): one consumer in the end
                rabbitmqctl("close_all_connections", "--vhost", name, "the test drops the connection")
                consumed_on = await reopened(channel, consumed_on, poll_s=0.005)
                rabbitmqctl("close_all_connections", "--vhost", name, "the test drops it during the restore")
                await reopened(channel, consumed_on)
                await until_consumed(name, 1)
                await asyncio.sleep(1.0)
                assert consumers(name) == 1, "consumed twice, or not at all"
                await publish(url, b"again")
                third = await next_of(inbox)
                assert third.body == b"again" and inbox.empty()
                await third.ack()

                await subscription.cancel()
                await until_consumed(name, 0)
                cancelled_on = await channel.get_underlay_channel()
                rabbitmqctl("close_all_connections", "--vhost", name, "the test drops it again")
                await reopened(channel, cancelled_on)
                await publish(url, b"unwanted")
                await asyncio.sleep(1.0)
                assert inbox.empty() and consumers(name) == 0, "a cancelled subscription consumed again"
            finally:
                await connection.close()

    asyncio.run(main())

"""Deliveries taken straight from aiormq: the few things a shard or a worker reads of a message, and its
settling.

aio-pika wraps every delivery in an ``IncomingMessage`` (each AMQP property copied through a validating
``__setattr__``) and runs the consumer's callback as a task of its own, on top of the task aiormq already
runs per delivery; profiles of a busy orchestrator put that wrapping at several per cent of its time, and
a worker's traced deliveries took 0.12 ms from aiormq's read to its code (a shard's, 0.04). Both read the
body, the headers, the message id and what routed it, and settle by delivery tag.

A shard's channels are not robust (its loop opens a new channel and consumer after a reconnect):
:func:`consume` is all it needs. A worker's are: aio-pika reopens them after a reconnect, with the
consumers made through its own ``Queue`` objects only, so :class:`Subscription` consumes again itself
each time its channel is reopened.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiormq.abc
from aio_pika.abc import AbstractChannel
from aiormq.exceptions import ChannelInvalidStateError

from orchestrator.bus.cancellation import cancelled_from_outside

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Delivered:
    """One delivery: its body, headers and message id, and how to settle it on the channel it came on."""

    body: bytes
    headers: dict[str, Any] | None
    message_id: str | None
    delivery_tag: int | None
    channel: aiormq.abc.AbstractChannel
    redelivered: bool = False
    exchange: str = ""
    routing_key: str = ""

    @classmethod
    def of(cls, message: aiormq.abc.DeliveredMessage) -> Delivered:
        properties = message.header.properties
        return cls(
            message.body,
            properties.headers,
            properties.message_id,
            message.delivery_tag,
            message.channel,
            bool(message.redelivered),
            message.exchange or "",
            message.routing_key or "",
        )

    @property
    def settleable(self) -> bool:
        """Whether the channel it came on is still open: only there can it be settled. A delivery tag
        means something only on the channel it came on: once that closed, its number may already belong
        to a new channel, which must not get the ack, and a frame on a closed channel would close the
        whole connection."""
        return not self.channel.is_closed

    def open_channel(self) -> aiormq.abc.AbstractChannel:
        """The channel to settle this delivery on; raises once it closed (see :attr:`settleable`)."""
        if not self.settleable:
            raise ChannelInvalidStateError(f"delivery {self.message_id}: its channel closed")
        return self.channel

    async def ack(self) -> None:
        if self.delivery_tag is not None:
            await self.open_channel().basic_ack(self.delivery_tag)

    async def nack(self, requeue: bool = True) -> None:
        if self.delivery_tag is not None:
            await self.open_channel().basic_nack(self.delivery_tag, requeue=requeue)


@dataclass(frozen=True)
class Consumer:
    """A consumer on a queue, to cancel when the shard stops taking its deliveries."""

    channel: aiormq.abc.AbstractChannel
    tag: str

    async def cancel(self) -> None:
        await self.channel.basic_cancel(self.tag)


async def consume(channel: AbstractChannel, queue: str, put: Callable[[Delivered], None]) -> Consumer:
    """Consume ``queue`` on ``channel`` (acks required), handing each delivery to ``put`` in the order
    the broker sent them: aiormq runs one task per delivery, and ``put`` is called at its first step."""
    underlay = await channel.get_underlay_channel()

    async def deliver(message: aiormq.abc.DeliveredMessage) -> None:
        put(Delivered.of(message))

    consume_ok = await underlay.basic_consume(queue, deliver, no_ack=False)
    if consume_ok.consumer_tag is None:
        raise aiormq.exceptions.AMQPChannelError(f"the broker named no consumer for queue {queue}")
    return Consumer(underlay, consume_ok.consumer_tag)


class Subscription:
    """A consumer of ``queue`` on a (robust) aio-pika channel's aiormq channel, handing each delivery to
    ``put`` as :func:`consume` does, that consumes again whenever aio-pika reopens the channel after a
    reconnect (the old channel's unacked deliveries went back to the queue with it).

    aio-pika calls its reopen callbacks while it still holds the channel's restore lock, after marking
    the channel restored: a callback that waited for the broker there would let a drop in the meantime
    go unrestored for good. So the callback only makes sure one task is at work, and that task waits
    until the channel is ready, consumes on the channel as it is then, and tries again after a failure
    (the channel dropped again meanwhile) until it has a consumer or the subscription is cancelled."""

    RETRY_S = 0.5

    def __init__(self, channel: AbstractChannel, queue: str, put: Callable[[Delivered], None]) -> None:
        self.channel = channel
        self.queue = queue
        self.put = put
        self._consumer: Consumer | None = None
        self._cancelled = False
        self._resubscribing: asyncio.Task[None] | None = None
        self._consuming = False  # a basic_consume is on its way: not to be interrupted

    async def start(self) -> None:
        self._consumer = await consume(self.channel, self.queue, self.put)
        reopened = getattr(self.channel, "reopen_callbacks", None)  # a robust channel's
        if reopened is not None:
            reopened.add(self._reopened)

    def _reopened(self, _channel: object) -> None:
        if self._cancelled or (self._resubscribing is not None and not self._resubscribing.done()):
            return  # the task at work consumes on the channel as it is once ready
        self._resubscribing = asyncio.get_running_loop().create_task(self._resubscribe())

    async def _resubscribe(self) -> None:
        ready = getattr(self.channel, "ready", None)
        while not self._cancelled:
            try:
                if ready is not None:
                    await ready()
                underlay = await self.channel.get_underlay_channel()
                current = self._consumer
                if current is not None and current.channel is underlay and not underlay.is_closed:
                    return  # already consuming on this channel
                self._consuming = True
                try:
                    consumer = await consume(self.channel, self.queue, self.put)
                finally:
                    self._consuming = False
                if self._cancelled:  # cancelled while the consume was on its way: undo it
                    await consumer.cancel()
                    return
                self._consumer = consumer
                return
            except asyncio.CancelledError as exc:
                if cancelled_from_outside():
                    raise  # cancel() stopped it
                self._failed(exc)  # the channel dropped again
            except Exception as exc:
                self._failed(exc)
            await asyncio.sleep(self.RETRY_S)

    def _failed(self, exc: BaseException) -> None:
        log.warning("could not consume %s again after a reconnect (%r); trying again", self.queue, exc)

    async def cancel(self) -> None:
        """Stop taking deliveries (now and after any later reconnect)."""
        self._cancelled = True
        reopened = getattr(self.channel, "reopen_callbacks", None)
        if reopened is not None:
            reopened.discard(self._reopened)
        task = self._resubscribing
        if task is not None and not task.done():
            if self._consuming:  # it sees the flag once its consume is answered, and undoes it
                await asyncio.wait([task], timeout=self.RETRY_S * 10)
            else:
                task.cancel()
        consumer, self._consumer = self._consumer, None
        if consumer is not None and not consumer.channel.is_closed:
            await consumer.cancel()

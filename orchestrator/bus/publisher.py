"""Publishing with publisher confirms and ``mandatory``.

Confirms tell us the broker has taken responsibility for a message (for quorum queues: a majority wrote
it); ``mandatory`` makes an unroutable message come back as an error instead of vanishing. Only a
positively confirmed message is marked sent in the outbox; anything else stays there for the relay.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

import aio_pika
import aiormq
from aio_pika.abc import AbstractChannel
from pamqp import commands as spec
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, stop_after_delay, wait_exponential

from orchestrator import metrics
from orchestrator.bus import batch
from orchestrator.bus.cancellation import cancelled_from_outside
from orchestrator.bus.envelope import Envelope, Signer, encode, signed_message
from orchestrator.bus.names import SERIAL_TASKS, Names
from orchestrator.bus.topology import TaskQueueLayout, declare_task_queue
from orchestrator.trace import TRACE
from orchestrator.wire import bodies
from orchestrator.wire.outgoing import Outgoing

log = logging.getLogger(__name__)


def _fields(message: Outgoing, now_ms: int) -> dict[str, Any]:
    """An outbox entry's envelope fields: its identity comes from the body the engine wrote."""
    body = message.body
    return {
        "kind": message.kind,
        "message_id": message.message_id,
        "run_id": str(body.get("run_id", "")),
        "shard": str(body.get("shard", "")),
        "stage": body.get("stage"),
        "attempt": body.get("attempt"),
        "fence": body.get("fence"),
        "item": body.get("item"),
        "digest": str(body.get("digest", "")),
        "contract": body.get("contract"),
        "tenant": str(body.get("tenant", "default")),
        "issued_at_ms": now_ms,
        "deadline_ms": message.deadline_ms,
        "body": dict(body),
    }


def envelope_for(message: Outgoing, signer: Signer, now_ms: int) -> Envelope:
    return signer.sign(Envelope(**_fields(message, now_ms)))


def message_bytes(message: Outgoing, signer: Signer, now_ms: int) -> bytes:
    """The signed wire form of an outbox entry, without building a model (the hot path)."""
    return signed_message(signer, **_fields(message, now_ms))


def outgoing_from_payload(payload: Mapping[str, Any]) -> Outgoing:
    """Rebuild an outbox entry (as stored by the transition) for the relay."""
    route = payload["route"]
    return Outgoing(
        payload["id"], payload["kind"], (route[0], route[1]), payload["body"], payload.get("deadline_ms")
    )


class _Pack:
    """Tasks for one contract queue that travel in one message, each signed on its own."""

    def __init__(self, queue: str, contract: str) -> None:
        self.queue = queue
        self.contract = contract
        self.messages: list[Outgoing] = []
        self.payloads: list[bytes] = []
        self.size = 0

    def takes(self, payload: bytes, per_message: int, max_bytes: int) -> bool:
        return len(self.messages) < per_message and self.size + batch.framed_bytes(len(payload)) <= max_bytes

    def add(self, message: Outgoing, payload: bytes) -> None:
        self.messages.append(message)
        self.payloads.append(payload)
        self.size += batch.framed_bytes(len(payload))


PUBLISH_ATTEMPTS = 3


async def _close_for_retry(channel: AbstractChannel) -> None:
    """Close a channel published on before, failing its unconfirmed publishes with an error they are
    retried for (on the channel that replaced it). aio-pika's close leaves aiormq to cancel whatever is
    still pending when the broker's answer to the close does not settle it first, and a cancelled
    publish is not retried: its caller would be cancelled instead (a worker's task then held until its
    channel closes, neither acked nor given back)."""
    with contextlib.suppress(Exception):
        underlay = await channel.get_underlay_channel()
        await underlay.close(exc=aiormq.exceptions.ChannelInvalidStateError("renewed: publish again"))
    with contextlib.suppress(Exception):
        await channel.close()


def _transient(exc: BaseException) -> bool:
    """Broker trouble that a moment may cure: a channel or connection going away, a negative confirm.
    Not an unroutable message (a PublishError carrying the broker's Basic.Return): that will not pass."""
    if isinstance(exc, aiormq.exceptions.PublishError):
        return False
    return isinstance(
        exc,
        aiormq.exceptions.DeliveryError
        | aiormq.exceptions.ChannelInvalidStateError
        | aiormq.exceptions.ConnectionClosed
        | aiormq.exceptions.ChannelClosed
        | ConnectionError,
    )


def _properties(
    message_id: str, headers: Mapping[str, Any] | None = None, content_type: str = "application/json"
) -> spec.Basic.Properties:
    persistent = int(aio_pika.DeliveryMode.PERSISTENT)
    return spec.Basic.Properties(
        message_id=message_id,
        content_type=content_type,
        delivery_mode=persistent,
        headers=dict(headers) if headers else None,
    )


class Publisher:
    """Publishes envelopes on one confirm-mode channel; returns the ids the broker confirmed.

    A task goes to the queue of its task queue *and* contract version (``Names.task_queue``), which this
    publisher declares the first time it sends there: a task for a contract that no worker has served yet
    then waits for one instead of coming back unroutable."""

    def __init__(
        self,
        channel: AbstractChannel,
        signer: Signer,
        names: Names,
        delivery_limit: int = 20,
        declare_on: Callable[[], Awaitable[AbstractChannel]] | None = None,
        group_size: int | None = None,
        renew_with: Callable[[], Awaitable[AbstractChannel]] | None = None,
        patience_s: float = 0.0,
        max_message_bytes: int = 1_048_576,
        pack_tasks: int = 1,
    ) -> None:
        """``declare_on`` opens a channel for declaring contract queues: the broker closes a channel whose
        declaration it refuses, which must not be the one a shard consumes and publishes on.
        ``renew_with`` opens a confirm-mode channel to publish on after a negative confirm (see
        :meth:`_renew`), and again when that channel has closed; without it, publishing stays on
        ``channel``. ``patience_s``: how long :meth:`publish_bytes` keeps retrying transient trouble
        (0: a few quick tries), for a publisher with nothing better to do with a refused message, such as
        a worker's result: a quorum queue electing a new leader nacks for seconds.
        ``max_message_bytes``: the largest message its readers take (a pack of tasks stays within it).
        ``pack_tasks``: how many tasks for one contract queue, among those one call publishes, may travel
        in one message (1: each alone); a map's ``items_per_message`` raises it for the map's items."""
        if not 1 <= pack_tasks <= batch.MAX_PACKED_TASKS:
            raise ValueError(f"pack_tasks is {pack_tasks}: give 1 to {batch.MAX_PACKED_TASKS}")
        self.channel = channel
        self.pack_tasks = pack_tasks
        self.max_message_bytes = max_message_bytes
        self.patience_s = patience_s
        self.signer = signer
        self.names = names
        self.delivery_limit = delivery_limit
        self.group_size = group_size  # of the contract queues it declares (the topology's setting)
        self.declare_on = declare_on
        self.renew_with = renew_with
        self._owned: AbstractChannel | None = None  # a channel this publisher opened, and closes
        self._renewing = asyncio.Lock()
        self._declared: dict[str, asyncio.Future[None]] = {}

    async def publish_all(self, messages: Iterable[Outgoing], now_ms: int) -> list[str]:
        """Publish ``messages``; returns the ids the broker confirmed. Tasks for one contract queue go to
        it packed (``pack_tasks``, or a bag's ``bodies.per_message``), each still signed on its own."""
        alone, packs = self._packed(messages, now_ms)
        units: list[list[Outgoing]] = [[m] for m, _ in alone] + [p.messages for p in packs]
        sends = [self._publish(m, now_ms, payload) for m, payload in alone]
        sends += [self._publish_pack(p) for p in packs]
        if not sends:
            return []
        if len(sends) == 1:  # one message (a run on its own): awaited here, no task scheduled around it
            results: list[BaseException | None] = [await _failure_of(sends[0])]
        else:
            results = await asyncio.gather(*sends, return_exceptions=True)
        confirmed = []
        for unit, result in zip(units, results, strict=True):
            if isinstance(result, BaseException):
                log.warning(
                    "publish of %s (%s) not confirmed: %s; the relay will retry",
                    ", ".join(m.message_id for m in unit),
                    unit[0].route,
                    result,
                )
            else:
                confirmed += [m.message_id for m in unit]
        return confirmed

    def _packed(
        self, messages: Iterable[Outgoing], now_ms: int
    ) -> tuple[list[tuple[Outgoing, bytes | None]], list[_Pack]]:
        """``messages`` split into those sent alone (with their signed bytes, where packing them signed
        them already) and packs of two or more tasks, each pack for one contract queue, of at most
        ``pack_tasks`` (a bag's items: their ``per_message`` where larger) and at most
        ``max_message_bytes`` (what a worker reads). Tasks of different runs share a pack: each keeps its
        own envelope, and the worker settles the container once all have reported. Serial tasks always
        travel alone (their queue hands out one task at a time)."""
        alone: list[tuple[Outgoing, bytes | None]] = []
        packs: list[_Pack] = []
        filling: dict[tuple[str, str], _Pack] = {}
        for message in messages:
            kind, queue = message.route
            per_message = (
                max(self.pack_tasks, bodies.per_message(message.body))
                if kind == "task" and queue != SERIAL_TASKS
                else 1
            )
            if per_message == 1:
                alone.append((message, None))
                continue
            try:
                payload = message_bytes(message, self.signer, now_ms)
            except Exception:  # sent alone, it fails on its own (and is logged) instead of the whole call
                alone.append((message, None))
                continue
            key = (queue, str(message.body.get("contract", "")))
            pack = filling.get(key)
            if pack is None or not pack.takes(payload, per_message, self.max_message_bytes):
                pack = filling[key] = _Pack(*key)
                packs.append(pack)
            pack.add(message, payload)
        alone += [(p.messages[0], p.payloads[0]) for p in packs if len(p.messages) == 1]  # as unpacked
        return alone, [p for p in packs if len(p.messages) > 1]

    async def _publish_pack(self, pack: _Pack) -> None:
        """Publish a pack of tasks as one container."""
        container = batch.pack(pack.payloads, pack.messages[0].message_id)
        if TRACE.enabled:  # each task's own hop, as if it had travelled alone
            for message in pack.messages:
                TRACE.event("sent", message.message_id)
        await self._to_task_queue(
            pack.queue,
            pack.contract,
            container.body,
            container.message_id,
            headers=container.headers,
            content_type=batch.CONTENT_TYPE,
        )
        if TRACE.enabled:
            for message in pack.messages:
                TRACE.event("confirmed", message.message_id)

    async def _publish(self, message: Outgoing, now_ms: int, payload: bytes | None = None) -> None:
        """Publish one message on its own; ``payload``: its signed bytes, if already made."""
        kind, target = message.route
        body = payload if payload is not None else message_bytes(message, self.signer, now_ms)
        if kind == "task":
            contract = str(message.body.get("contract", ""))
            await self._to_task_queue(target, contract, body, message.message_id)
            return
        exchange, mandatory = {
            "shard": (self.names.runs_exchange, True),
            "events": (self.names.events_exchange, False),  # nobody listening is fine
        }[kind]
        await self.publish_bytes(body, message.message_id, exchange, target, mandatory=mandatory)

    async def _to_task_queue(
        self,
        queue: str,
        contract: str,
        body: bytes,
        message_id: str,
        *,
        headers: Mapping[str, Any] | None = None,
        content_type: str = "application/json",
    ) -> None:
        """Publish to the queue of ``queue`` and ``contract``, declared the first time."""
        name = self.names.task_queue(queue, contract)
        await self._declare_once(name, queue, contract)
        try:
            await self.publish_bytes(
                body, message_id, self.names.tasks_exchange, name, headers=headers, content_type=content_type
            )
        except aiormq.exceptions.PublishError:
            self._declared.pop(name, None)  # deleted behind our back: declare it again on the next try
            raise

    async def declarations_settled(self) -> None:
        """Wait until every task queue declaration in progress has finished (fault injection only)."""
        await asyncio.gather(*self._declared.values(), return_exceptions=True)

    async def _declare_once(self, name: str, queue: str, contract: str) -> None:
        """Declare a contract queue the first time this process sends to it; concurrent sends wait for the
        one declaration, and a failed one is tried again by the next send."""
        declared = self._declared.get(name)
        if declared is None:
            declared = asyncio.get_running_loop().create_future()
            self._declared[name] = declared
            layout = TaskQueueLayout.of(self.names, queue, contract, self.delivery_limit, self.group_size)
            try:
                await self._declare(layout)
            except BaseException as exc:
                self._declared.pop(name, None)
                declared.set_exception(exc)
                declared.exception()  # retrieved: the waiters, if any, re-raise it themselves
                raise
            declared.set_result(None)
            return
        await declared

    async def _declare(self, layout: TaskQueueLayout) -> None:
        try:
            await self._on_declare_channel(lambda channel: declare_task_queue(channel, layout))
        except aiormq.exceptions.ChannelPreconditionFailed as exc:
            # It exists with other arguments (another process's SAGA_DELIVERY_LIMIT, say): tasks may still
            # go to it, so bind it (a binding has no arguments to disagree on) and say so.
            log.error(
                "queue %s exists with other arguments than this process declares (%s): tasks still go "
                "to it; give every process the same SAGA_DELIVERY_LIMIT and SAGA_QUORUM_GROUP_SIZE, or "
                "delete the queue once empty",
                layout.queue.name,
                exc,
            )
            binding = layout.binding

            async def bind(channel: AbstractChannel) -> None:
                queue = await channel.get_queue(binding.destination, ensure=False)
                await queue.bind(binding.source, binding.routing_key)

            await self._on_declare_channel(bind)

    async def _on_declare_channel(self, declare: Callable[[AbstractChannel], Awaitable[None]]) -> None:
        channel = await self.declare_on() if self.declare_on is not None else self.channel
        try:
            await declare(channel)
        finally:
            if channel is not self.channel:
                with contextlib.suppress(Exception):
                    await channel.close()

    async def publish_envelope(
        self, envelope: Envelope, exchange: str, routing_key: str, *, mandatory: bool = True
    ) -> None:
        await self.publish_bytes(
            encode(envelope), envelope.message_id, exchange, routing_key, mandatory=mandatory
        )

    async def publish_bytes(
        self,
        body: bytes,
        message_id: str,
        exchange: str,
        routing_key: str,
        *,
        mandatory: bool = True,
        headers: Mapping[str, Any] | None = None,
        content_type: str = "application/json",
    ) -> None:
        """Publish and wait for the confirm, retrying transient broker trouble a few times (the same
        message, the same id: a retry is at worst a duplicate, never a new attempt). An unroutable
        message is not transient and raises at once. ``headers`` and ``content_type``: a container's
        (``bus/batch.py``); an envelope has none."""
        properties = _properties(message_id, headers, content_type)
        try:
            await self._publish_once(body, message_id, exchange, routing_key, mandatory, properties)
            return
        except Exception as exc:  # the common path pays nothing for the retry machinery
            if not _transient(exc):
                raise
        async for attempt in AsyncRetrying(
            retry=retry_if_exception(_transient),
            stop=stop_after_delay(self.patience_s)
            if self.patience_s
            else stop_after_attempt(PUBLISH_ATTEMPTS - 1),
            wait=wait_exponential(multiplier=0.05, max=2.0 if self.patience_s else 1.0),
            reraise=True,
        ):
            with attempt:
                await self._publish_once(body, message_id, exchange, routing_key, mandatory, properties)

    async def _publish_once(
        self,
        body: bytes,
        message_id: str,
        exchange: str,
        routing_key: str,
        mandatory: bool,
        properties: spec.Basic.Properties,
    ) -> None:
        # Straight to aiormq with wait=False: aio-pika's publish waits for each frame to be written
        # before the next publish on the channel may queue, so every message cost its own socket write.
        # Without the wait, messages queued in one loop turn leave in one write (bus/coalesce.py). The
        # publisher confirm is still awaited: a message counts as sent only when the broker confirms it
        # (and, with on_return_raises, an unroutable mandatory message raises).
        channel = self.channel
        if channel.is_closed:  # gone with its connection (a robust one comes back; ours do not)
            await self._renew(channel)
            channel = self.channel
        underlay = await channel.get_underlay_channel()
        started = time.perf_counter()
        TRACE.event("sent", message_id)
        try:
            confirmation = await underlay.basic_publish(
                body,
                exchange=exchange,
                routing_key=routing_key,
                properties=properties,
                mandatory=mandatory,
                wait=False,  # type: ignore[call-arg]  # the concrete aiormq channel takes it
            )
        except aiormq.exceptions.PublishError:
            raise  # returned unroutable: the channel is fine
        except aiormq.exceptions.DeliveryError:
            # aiormq raises a negative confirm (Basic.Nack) rather than returning it: the channel that
            # was nacked is not published on again (see _renew)
            await self._renew(channel)
            raise
        metrics.publish_confirmed(time.perf_counter() - started)
        TRACE.event("confirmed", message_id)
        if not isinstance(confirmation, spec.Basic.Ack):  # no confirm mode, or an aiormq that returns it
            await self._renew(channel)
            raise aiormq.exceptions.DeliveryError(None, confirmation)  # type: ignore[arg-type]

    async def _renew(self, stale_channel: AbstractChannel) -> None:
        """Publish on a fresh channel from now on. RabbitMQ (3.10) nacks a channel's first publish to a
        quorum queue whose leader is being elected (a node lost), and that channel then nacks every later
        publish to that queue for as long as it lives, while a fresh channel is accepted within a second
        or so. One renewal per channel, however many of its publishes were nacked at once."""
        if self.renew_with is None:
            return
        async with self._renewing:
            if self.channel is not stale_channel:
                return  # already renewed by a publish nacked alongside
            fresh = await self.renew_with()
            stale, self._owned = self._owned, fresh
            self.channel = fresh
        log.info("publishing on a fresh channel from now on (a publish was nacked, or the channel closed)")
        if stale is not None:
            await _close_for_retry(stale)

    async def close(self) -> None:
        """Close the channel this publisher opened for itself, if any (the one it was given is the
        caller's)."""
        owned, self._owned = self._owned, None
        if owned is not None:
            with contextlib.suppress(Exception):
                await owned.close()

    async def reject(
        self,
        raw: bytes,
        reason: str,
        detail: str,
        source: str,
        message_id: str | None = None,
        *,
        headers: Mapping[str, Any] | None = None,
    ) -> None:
        """Park a refused message on the namespace's rejected queue with its reason (the broker's own
        dead-lettering could only say 'rejected'), under its own AMQP message id so it can be found by it.
        ``headers``: the message's own that a replay needs (a container's framing)."""
        default = self.channel.default_exchange
        reasons = {"x-saga-reason": reason, "x-saga-detail": detail[:1000], "x-saga-source": source}
        await default.publish(
            aio_pika.Message(
                raw,
                message_id=message_id,
                headers={**(headers or {}), **reasons},
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            ),
            routing_key=self.names.rejected_queue,
            mandatory=True,
        )
        metrics.refused(reason)


async def _failure_of(sending: Awaitable[None]) -> BaseException | None:
    """What ``asyncio.gather(..., return_exceptions=True)`` gives for one awaitable: its exception, or
    None. A cancellation of the caller itself propagates; one from inside the send (aiormq cancels the
    confirms of a channel that closed) is the send's failure, as gather would report it."""
    try:
        await sending
    except asyncio.CancelledError as exc:
        if cancelled_from_outside():
            raise
        return exc
    except Exception as exc:
        return exc
    return None

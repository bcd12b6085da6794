"""The orchestrator process: consume shard queues in batches, apply transitions, publish, ack.

Per shard, one channel (acks with ``multiple=True`` are per channel) and one loop:

    take a batch of deliveries ▸ decode + verify ▸ per run, in order: engine ▸ Lua apply
    ▸ ack the batch (every transition committed, what it causes is in the outbox) ▸ publish what the
    transitions caused (confirms) ▸ mark confirmed entries sent

The ack leaves in the same socket write as the publishes. A batch that passes messages on or refuses
them (neither is in the outbox) is acked only once those are confirmed.

A delivery may be a container of several messages (a worker's reports of one loop turn,
``bus/batch.py``): it is opened into one delivery per message, each decoded, verified, applied, passed on
or refused on its own; the container is acked once every one of them is settled.

Runs in one batch are processed concurrently (their transitions commute); a run's own messages stay in
delivery order. Redis unreachable: the loop closes its channel (unacked deliveries go back to the queue,
no dead-lettering) and waits for Redis before consuming again. A relay re-publishes outbox entries that
were committed but never confirmed (a crash between commit and publish), at start-up and periodically.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

import aio_pika
import aiormq
from aio_pika.abc import AbstractChannel, AbstractRobustConnection
from aiormq.exceptions import ChannelInvalidStateError
from redis.exceptions import ClusterDownError, RedisClusterException, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from orchestrator import faults, health, logs, metrics
from orchestrator.bus import batch as containers
from orchestrator.bus import inbound
from orchestrator.bus.connect import untracked_channel
from orchestrator.bus.envelope import Envelope, EnvelopeRejected, Signer, decode
from orchestrator.bus.inbound import Delivered
from orchestrator.bus.names import Names
from orchestrator.bus.publisher import Publisher, envelope_for
from orchestrator.reconcile import Reconciler
from orchestrator.sealing import Sealer
from orchestrator.shard.admission import TenantAdmission, TenantLimit
from orchestrator.shard.processor import Outcome, Processor
from orchestrator.store.redis_store import RedisStore
from orchestrator.trace import TRACE
from orchestrator.wire.freshness import LIVENESS_KINDS, STALE, Freshness
from orchestrator.wire.kinds import Kind
from orchestrator.wire.outgoing import Outgoing
from orchestrator.wire.sizes import (
    DEFAULT_BAG_WINDOW,
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_MAX_TRANSITION_BYTES,
    Limits,
)

log = logging.getLogger(__name__)
# TimeoutError: a Redis step that outlived ShardOptions.redis_timeout_s.
# A Redis Cluster failing over or resharding says so with these: the shard pauses, as for Redis down.
REDIS_DOWN = (
    RedisConnectionError,
    RedisTimeoutError,
    ClusterDownError,
    TryAgainError,
    RedisClusterException,
    ConnectionRefusedError,
    OSError,
    TimeoutError,
)


# Continuations a shard sends itself (a barrier's release, a bag's refill): applied in-process.
_LOCAL_KINDS = frozenset({Kind.RELEASE.value, Kind.REFILL.value})


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass
class ShardOptions:
    names: Names = field(default_factory=Names)
    delivery_limit: int = 20  # of the task queues this process declares (the topology's setting)
    quorum_group_size: int | None = None  # likewise
    prefetch: int = 64
    batch_max: int = 64
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    pack_tasks: int = containers.DEFAULT_PACK_TASKS  # tasks for one contract queue in one message, at most
    max_transition_bytes: int = DEFAULT_MAX_TRANSITION_BYTES
    bag_window: int = DEFAULT_BAG_WINDOW
    relay_interval_s: float = 5.0
    relay_min_age_ms: int = 2_000  # younger entries are most likely being published right now
    redis_retry_s: float = 0.5
    # how often the process looks for due timers (retries, deadlines) of every shard it serves, in one
    # round trip for all of them; also how often an idle shard's loop checks that its channel is open
    timer_poll_s: float = 0.1
    # A Redis step (a batch's reads and transitions, a mark-sent, a timer pass) slower than this means
    # Redis is gone even if no socket said so (a peer that vanished without a reset, a hung server): the
    # shard returns its deliveries and waits. One deadline per step, not per reply: a per-read socket
    # timeout on the client measurably slowed every transition.
    redis_timeout_s: float = 5.0
    # A batch's publishes still unconfirmed after this long are left to the relay (their outbox entries
    # stay unmarked) and the shard goes on: a confirm the broker never sends (a channel lost while the
    # connection came back) must not hold the shard's loop, which is also what notices a closed channel.
    publish_timeout_s: float = 15.0
    # A message whose transition failed on this many earlier deliveries is poison: its run is marked
    # failed and the message dead-lettered now (one below the queue's x-delivery-limit, so we decide,
    # with the reason, before the broker drops it into the dead-letter queue on its own).
    poison_after: int = 19
    reconcile_interval_s: float = 60.0  # look for stranded runs of the served shards this often
    # how often a process that follows the shard map reads it (and renews its membership) again
    map_poll_s: float = 2.0
    stranded_after_ms: int = 600_000  # a running run quiet this long, with nothing on its way, is stranded
    crash_points: frozenset[str] = frozenset()  # tests only: see crash()
    freshness: Freshness = field(default_factory=Freshness)  # how old a message taken may be, by kind
    tenant_limits: Mapping[str, TenantLimit] = field(default_factory=dict)  # SAGA_TENANT_LIMITS
    encrypt_sensitive: bool = False  # SAGA_ENCRYPT_SENSITIVE: sensitive values sealed in Redis
    # how often to read each shard's outbox depth and due timers into the metrics (None: never)
    metrics_interval_s: float | None = None


def _redeliveries(message: Delivered) -> int:
    """How often the broker delivered this message before (quorum queues count it in a header)."""
    count = (message.headers or {}).get("x-delivery-count", 0)
    return int(count) if isinstance(count, int | str) and str(count).isdigit() else 0


@dataclass
class _Delivery:
    """One message to handle: a delivery of its own, or one message of a container (``position`` set),
    several of which then share their AMQP ``message``."""

    message: Delivered
    body: bytes  # what it came as: the message's body, or its payload in the container
    position: int | None = None  # its place in its container
    envelope: Envelope | None = None
    outcome: Outcome | None = None
    error: BaseException | None = None

    @property
    def message_id(self) -> str | None:
        """Its id for logs, traces and the rejected queue: the AMQP message's; for one of a container
        the envelope's, or until it is decoded the container's and its position."""
        if self.position is None:
            return self.message.message_id
        if self.envelope is not None:
            return self.envelope.message_id
        return f"{self.message.message_id or '?'}/{self.position}"


def _opened(message: Delivered, max_bytes: int) -> list[_Delivery]:
    """The deliveries a message holds: itself, or each message of a container; a malformed container is
    one delivery, refused with the reason."""
    if not containers.is_container(message.headers):
        return [_Delivery(message, message.body)]
    try:
        payloads = containers.unpack(message.body, message.headers or {}, max_bytes)
    except EnvelopeRejected as exc:
        return [_Delivery(message, message.body, outcome=Outcome(rejected=(exc.reason, exc.detail)))]
    metrics.container(len(payloads))
    return [_Delivery(message, payload, position) for position, payload in enumerate(payloads)]


@dataclass(frozen=True)
class _TimersDue:
    """Put in a shard's inbox by the process's timer poll: the shard's timers that were due then. Firing
    them in the shard's own loop keeps them in order with its deliveries and its publisher."""

    members: list[str]


_Inbox = asyncio.Queue[Delivered | _TimersDue]


@dataclass
class ShardService:
    connection: AbstractRobustConnection
    store: RedisStore
    signer: Signer
    shards: list[str]
    options: ShardOptions = field(default_factory=ShardOptions)
    clock_ms: Callable[[], int] = now_ms
    # The shards to serve now, read again every ``map_poll_s`` (None: serve ``shards``, a static pin): a
    # shard added to the map is served, a retired one left.
    follow: Callable[[], Awaitable[list[str]]] | None = None
    _stopping: asyncio.Event = field(default_factory=asyncio.Event)
    _leaving: set[str] = field(default_factory=set)
    _sampled: dict[str, float] = field(default_factory=dict)  # shard -> when its depths were last read
    # for /readyz: the shards to serve (None: a follower's share not read yet), and those consumed now
    _share: set[str] | None = None
    _subscribed: set[str] = field(default_factory=set)
    _inboxes: dict[str, _Inbox] = field(default_factory=dict)  # of the shards consumed now
    _timers_queued: set[str] = field(default_factory=set)  # shards whose inbox holds due timers

    def __post_init__(self) -> None:
        limits = Limits(
            self.options.max_message_bytes, self.options.max_transition_bytes, self.options.bag_window
        )
        admission = None
        if self.options.tenant_limits:
            admission = TenantAdmission(self.options.tenant_limits, time.monotonic)
        # values sealed at rest are opened whoever sealed them (a fleet part way through turning the setting
        # on or off); this process seals what it writes only with the setting
        sealer = Sealer(lambda: self.signer.ring)
        self.processor = Processor(
            self.store, self.clock_ms, limits, admission, sealer, seal_writes=self.options.encrypt_sensitive
        )

    def stop(self) -> None:
        """Finish the batch in hand, stop consuming, close: SIGTERM drains."""
        self._stopping.set()

    def consuming(self) -> str | None:
        """None when the process consumes every shard queue it is to serve (as active or standby
        consumer); else what it does not (``/readyz``, ``orchestrator/health.py``). Draining after
        SIGTERM, it is not ready, whatever it still consumes."""
        if self._stopping.is_set():
            return "stopping"
        return health.shard_consumption(self._share, self._subscribed)

    async def run(self) -> None:
        if self.follow is None:
            self._share = set(self.shards)
        await self._wait_for_redis()
        await self.store.load_library()
        serving = {shard: asyncio.create_task(self._serve(shard)) for shard in self.shards}
        timers = asyncio.create_task(self._poll_timers())
        follow = self.follow
        while follow is not None and not self._stopping.is_set():
            await self._follow(serving, follow)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self.options.map_poll_s)
        await asyncio.gather(*serving.values(), return_exceptions=True)
        timers.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await timers

    async def _follow(
        self, serving: dict[str, asyncio.Task[None]], follow: Callable[[], Awaitable[list[str]]]
    ) -> None:
        """Serve what the shard map says now: start on added shards, leave retired ones."""
        try:
            wanted = set(await follow())
        except Exception as exc:  # Redis trouble: keep serving what we serve; the next read may do
            log.warning("could not read the shard map (%s); serving %d shard(s) as before", exc, len(serving))
            return
        self._share = wanted
        for shard, task in list(serving.items()):
            if task.done():
                del serving[shard]
                self._leaving.discard(shard)
        self._leaving -= wanted  # wanted again before it was left: it stays
        for shard in sorted(wanted - serving.keys()):
            with logs.log_context(shard=shard):
                log.info("shard %s: added to the map, or this process's share now; serving it", shard)
            serving[shard] = asyncio.create_task(self._serve(shard))
        for shard in sorted(serving.keys() - wanted - self._leaving):
            with logs.log_context(shard=shard):
                log.info("shard %s: retired, or another member's share now; leaving it", shard)
            self._leaving.add(shard)

    def _left(self, shard: str) -> bool:
        return self._stopping.is_set() or shard in self._leaving

    async def _wait_for_redis(self, shard: str | None = None) -> None:
        while not self._stopping.is_set():
            try:
                async with asyncio.timeout(self.options.redis_timeout_s):
                    await self.store.client.ping()  # type: ignore[misc]
                    if shard is not None:
                        # On a Redis Cluster a PING reaches any node, and answers while the shard's own
                        # slot has no primary (a primary lost, its replica not promoted yet): a read of
                        # that slot does not. Without it the shard took its deliveries and gave them back
                        # many times a second, and every return counts against the queue's delivery
                        # limit (20): a failover of a few seconds dead-lettered messages.
                        await self.store.client.exists(self.store.keys(shard).outbox())
                return
            except REDIS_DOWN:
                log.warning("Redis unreachable; not consuming until it is back")
                await asyncio.sleep(self.options.redis_retry_s)

    async def _serve(self, shard: str) -> None:
        logs.bind(shard=shard)  # a task of its own: everything it logs is about this shard
        while not self._left(shard):
            channel: AbstractChannel | None = None
            try:
                await self._wait_for_redis(shard)
                channel = await untracked_channel(self.connection)
                await channel.set_qos(prefetch_count=self.options.prefetch)
                await self._consume(shard, channel)
            except (aio_pika.exceptions.AMQPError, ChannelInvalidStateError) as exc:
                # before REDIS_DOWN: aiormq's connection errors are OSErrors too
                log.warning("shard %s: broker connection trouble (%s); reconnecting", shard, exc)
                await asyncio.sleep(1.0)
            except REDIS_DOWN as exc:
                log.warning(
                    "shard %s: Redis failed (%s); returning deliveries to the queue and waiting", shard, exc
                )
            except Exception:
                # Anything else is a bug or a surprise from a dependency (a Lua error, say). One shard must
                # not take the others down: its deliveries go back to the queue (the delivery limit bounds
                # a message that fails every time) and the shard starts again after a pause.
                log.exception("shard %s: unexpected failure; restarting this shard's consumer", shard)
                await asyncio.sleep(1.0)
            finally:
                # The channel is not tracked by the robust connection (connect.untracked_channel): after
                # a reconnect this loop opens a new one, and nothing reopens the old one beside it.
                if channel is not None:
                    with contextlib.suppress(Exception):
                        await channel.close()  # unacked deliveries return to the queue

    async def _consume(self, shard: str, channel: AbstractChannel) -> None:
        publisher = Publisher(
            channel,
            self.signer,
            self.options.names,
            self.options.delivery_limit,
            declare_on=self._untracked_channel,
            group_size=self.options.quorum_group_size,
            renew_with=self._untracked_channel,
            max_message_bytes=self.options.max_message_bytes,
            pack_tasks=self.options.pack_tasks,
        )
        # Passive: a shard queue that is not there (retired, or no topology applied) is an error here.
        queue = await channel.declare_queue(self.options.names.shard_queue(shard), passive=True)
        inbox: _Inbox = asyncio.Queue()
        put = _traced(inbox.put_nowait) if TRACE.enabled else inbox.put_nowait
        consumer = await inbound.consume(channel, queue.name, put)
        metrics.shard_state(shard, active=False)  # until a delivery says this is the active consumer
        self._subscribed.add(shard)
        try:
            await self._relay(shard, publisher)
            self._inboxes[shard] = inbox  # its timers are looked for from now on
            next_relay = time.monotonic() + self.options.relay_interval_s
            next_reconcile = time.monotonic() + self.options.reconcile_interval_s
            while not self._left(shard):
                if channel.is_closed:  # the connection dropped: nothing more will arrive on it
                    raise ChannelInvalidStateError(f"shard {shard}: its channel closed")
                await self._sample(shard)
                if time.monotonic() >= next_reconcile:
                    await self._reconcile(shard, publisher)
                    next_reconcile = time.monotonic() + self.options.reconcile_interval_s
                if time.monotonic() >= next_relay:
                    await self._relay(shard, publisher)
                    next_relay = time.monotonic() + self.options.relay_interval_s
                timeout = min(self.options.timer_poll_s, max(0.0, next_relay - time.monotonic()))
                batch, due = await self._next(inbox, timeout)
                if batch:
                    await self._process(shard, batch, publisher)
                if due is not None:
                    try:
                        await self._fire_timers(shard, publisher, due.members)
                    finally:  # looked for again only once these are fired: else found twice
                        self._timers_queued.discard(shard)
        finally:
            self._inboxes.pop(shard, None)
            self._timers_queued.discard(shard)
            self._subscribed.discard(shard)
            self.processor.records.forget_shard(shard)  # served again later, it reads afresh
            metrics.shard_left(shard)
            with contextlib.suppress(Exception):
                await consumer.cancel()
            await publisher.close()

    async def _next(self, inbox: _Inbox, timeout: float) -> tuple[list[Delivered], _TimersDue | None]:
        """The next batch of deliveries, and due timers if the poll found some; nothing after
        ``timeout`` seconds without either. A busy shard takes its batch without a timed wait."""
        if not inbox.empty():
            first = inbox.get_nowait()
        else:
            try:
                # a timer on this task, not the task of its own that wait_for makes: a quiet shard's every
                # delivery went through one more task and one more loop turn before its batch began
                async with asyncio.timeout(timeout):
                    first = await inbox.get()
            except TimeoutError:
                return [], None
        batch: list[Delivered] = []
        due: _TimersDue | None = None
        item: Delivered | _TimersDue | None = first
        while item is not None:
            if isinstance(item, _TimersDue):
                due = item
            else:
                batch.append(item)
            more = len(batch) < self.options.batch_max and not inbox.empty()
            item = inbox.get_nowait() if more else None
        return batch, due

    async def _untracked_channel(self) -> AbstractChannel:
        return await untracked_channel(self.connection)

    async def _process(self, shard: str, batch: list[Delivered], publisher: Publisher) -> None:
        metrics.batch(shard, len(batch))
        faults.crash(self.options.crash_points, "after-consume")
        deliveries = self._decoded(batch)
        valid = [d for d in deliveries if d.envelope is not None]
        if TRACE.enabled:
            for delivery in valid:
                TRACE.decoded(delivery.envelope)
        try:
            async with asyncio.timeout(self.options.redis_timeout_s):
                outcomes = await self.processor.handle_batch(shard, [d.envelope for d in valid if d.envelope])
            for delivery, outcome in zip(valid, outcomes, strict=True):
                delivery.outcome = outcome
        except REDIS_DOWN:
            raise  # the whole batch goes back to the queue
        except Exception:  # isolate the failing message: one at a time, so only it is requeued
            log.exception("shard %s: batch failed; handling its messages one by one", shard)
            groups: dict[str, list[_Delivery]] = {}
            for delivery in valid:
                groups.setdefault(delivery.envelope.run_id if delivery.envelope else "", []).append(delivery)
            async with asyncio.timeout(self.options.redis_timeout_s):
                await asyncio.gather(*(self._run_group(shard, group) for group in groups.values()))
        await self._settle(shard, deliveries, publisher)

    def _decoded(self, batch: list[Delivered]) -> list[_Delivery]:
        """The batch's deliveries (a container's messages each one of its own), each with its verified
        envelope or the reason it is refused."""
        deliveries: list[_Delivery] = []
        # the ids are read when the span ends: a container's messages are known by theirs once decoded
        now_ms = self.clock_ms()
        with TRACE.span("decode", (d.message_id or "" for d in deliveries)):
            for message in batch:
                deliveries.extend(_opened(message, self.options.max_message_bytes))
            for delivery in deliveries:
                if delivery.outcome is not None:  # a malformed container: refused whole
                    continue
                try:
                    envelope = decode(delivery.body, self.signer, self.options.max_message_bytes)
                except EnvelopeRejected as exc:
                    delivery.outcome = Outcome(rejected=(exc.reason, exc.detail))
                    continue
                stale = self.options.freshness.refusal(
                    envelope.kind, envelope.message_id, envelope.issued_at_ms, now_ms
                )
                if stale is None:
                    delivery.envelope = envelope
                elif envelope.kind in LIVENESS_KINDS and stale[0] == STALE:  # old news of an attempt: dropped
                    log.info("shard: %s %s dropped: %s", envelope.kind.value, envelope.message_id, stale[1])
                    delivery.outcome = Outcome()
                else:
                    delivery.outcome = Outcome(rejected=stale)
        return deliveries

    async def _continue_locally(
        self, shard: str, outgoing: list[Outgoing]
    ) -> tuple[list[Outgoing], list[str]]:
        """Apply continuations addressed to this very shard (barrier releases, bag refills) here and now,
        not after a round trip through the broker. They stay in the outbox until applied, so a crash in
        between leaves them for the relay, and the id makes a re-published one a recognised duplicate."""
        done: list[str] = []
        for _ in range(
            8
        ):  # a release can cause another (nested joins); bounded, the rest goes via the broker
            here = ("shard", shard)
            local = [m for m in outgoing if m.route == here and m.kind in _LOCAL_KINDS]
            if not local:
                break
            # told apart by identity: comparing the entries by value compared their bodies, for each pair
            taken = {id(m) for m in local}
            outgoing = [m for m in outgoing if id(m) not in taken]
            envelopes = [envelope_for(m, self.signer, self.clock_ms()) for m in local]
            async with asyncio.timeout(self.options.redis_timeout_s):
                outcomes = await self.processor.handle_batch(shard, envelopes)
            done += [m.message_id for m in local]
            outgoing += [m for o in outcomes for m in o.publish]
        return outgoing, done

    async def _run_group(self, shard: str, group: list[_Delivery]) -> None:
        for delivery in group:
            assert delivery.envelope is not None
            with logs.log_context(**logs.envelope_ids(delivery.envelope)):
                try:
                    delivery.outcome = await self.processor.handle(shard, delivery.envelope)
                except REDIS_DOWN:
                    raise  # the whole batch goes back to the queue
                except Exception as exc:  # a bug, not bad input: requeue; the delivery limit bounds retries
                    log.exception("shard %s: transition for run %s failed", shard, delivery.envelope.run_id)
                    delivery.error = exc

    async def _settle(self, shard: str, deliveries: list[_Delivery], publisher: Publisher) -> None:
        outgoing: list[Outgoing] = [m for d in deliveries if d.outcome for m in d.outcome.publish]
        if outgoing:
            faults.crash(self.options.crash_points, "after-commit")
        with TRACE.span("local", _ids(deliveries)):
            outgoing, done_locally = await self._continue_locally(shard, outgoing)
        # Every transition of the batch has committed, and what it causes sits in the outbox: the
        # deliveries may be acked now (invariant 4), in the same socket write as the publishes below.
        # Forwards and refusals are not in the outbox, so those batches ack after they are confirmed.
        passing_on = any(d.outcome and (d.outcome.forward_to or d.outcome.rejected) for d in deliveries)
        if not passing_on:
            with TRACE.span("ack", _ids(deliveries)):
                await self._ack(shard, deliveries)
        await self._publish_and_mark(shard, publisher, outgoing, done_locally)
        if passing_on:
            await self._pass_on(shard, deliveries, publisher)
            await self._ack(shard, deliveries)

    async def _publish_and_mark(
        self, shard: str, publisher: Publisher, outgoing: list[Outgoing], done_locally: list[str]
    ) -> None:
        """Publish what committed transitions caused, then mark the confirmed (and the locally applied)
        entries sent; what is not confirmed stays in the outbox for the relay."""
        with TRACE.span("publish", [m.message_id for m in outgoing]):
            try:
                async with asyncio.timeout(self.options.publish_timeout_s):
                    confirmed = await self._publish(publisher, outgoing)
            except TimeoutError:
                log.warning(
                    "shard %s: %d publishes not confirmed within %.0f s; the relay sends them again",
                    shard,
                    len(outgoing),
                    self.options.publish_timeout_s,
                )
                confirmed = []
        if confirmed:
            faults.crash(self.options.crash_points, "after-confirm")
        with TRACE.span("mark_sent", confirmed):
            async with asyncio.timeout(self.options.redis_timeout_s):
                await self.store.mark_sent(shard, confirmed + done_locally)

    async def _publish(self, publisher: Publisher, outgoing: list[Outgoing]) -> list[str]:
        if outgoing and "before-confirm" in self.options.crash_points:
            publishing = asyncio.ensure_future(publisher.publish_all(outgoing, self.clock_ms()))
            await asyncio.sleep(0.01)
            # a task queue this process sends to for the first time is declared before its publish
            await publisher.declarations_settled()
            await asyncio.sleep(0.01)  # the frames are on their way; their confirms are not processed
            faults.crash(self.options.crash_points, "before-confirm")
            return await publishing
        return await publisher.publish_all(outgoing, self.clock_ms())

    async def _pass_on(self, shard: str, deliveries: list[_Delivery], publisher: Publisher) -> None:
        for delivery in deliveries:
            outcome = delivery.outcome
            if outcome is not None and outcome.forward_to and delivery.envelope is not None:
                try:
                    # the bytes as they came, not re-encoded: their signature covers exactly these
                    await publisher.publish_bytes(
                        delivery.body,
                        delivery.envelope.message_id,
                        self.options.names.runs_exchange,
                        outcome.forward_to,
                    )
                    continue
                except aiormq.exceptions.PublishError:
                    # no queue for that shard: returning the delivery would only bring it back (and
                    # every healthy message of its batch with it), so it is refused with the reason
                    why = f"it is for shard {outcome.forward_to}, which has no queue"
                    outcome = Outcome(rejected=("unroutable", why))
            if outcome is not None and outcome.rejected:
                reason, detail = outcome.rejected
                await publisher.reject(
                    delivery.body,  # one message of a container is parked alone: the others go on
                    reason,
                    detail,
                    self.options.names.shard_queue(shard),
                    delivery.message_id,
                )

    async def _ack(self, shard: str, deliveries: list[_Delivery]) -> None:
        if all(d.error is None for d in deliveries):
            last = deliveries[-1].message
            if last.delivery_tag is not None:
                # queued, not waited for: it leaves in the same socket write as the publishes that follow
                # (aio-pika's ack waits for its own write and drain first)
                await last.open_channel().basic_ack(delivery_tag=last.delivery_tag, multiple=True, wait=False)
            return
        # Settled once per AMQP message (twice would be a channel error): a container goes back whole if
        # any of its messages failed; those that committed come back as recognised duplicates.
        for message, group in _by_message(deliveries):
            failed = [d for d in group if d.error is not None]
            if not failed:
                await message.ack()
            elif _redeliveries(message) >= self.options.poison_after:
                await self._poisoned(shard, message, failed)
            else:
                await message.nack(requeue=True)

    async def _poisoned(self, shard: str, message: Delivered, failed: list[_Delivery]) -> None:
        """The transitions of ``failed`` (the messages ``message`` carries that failed) failed on every
        delivery: a bug or corrupt state, not bad input. Mark each one's run failed with the reason (it
        would wait forever otherwise) and dead-letter the message once, for a human; other runs of the
        shard go on."""
        for delivery in failed:
            envelope = delivery.envelope
            with logs.log_context(**logs.envelope_ids(envelope)):
                if envelope is not None:
                    error = f"{type(delivery.error).__name__}: {delivery.error}"[:500]
                    try:
                        # the shard being served: a start message names no shard of its own
                        await self.store.poison(
                            shard, envelope.run_id, envelope.message_id, error, self.clock_ms()
                        )
                    except Exception:
                        log.exception(
                            "could not mark run %s failed for poison message %s",
                            envelope.run_id,
                            envelope.message_id,
                        )
                log.error(
                    "message %s (run %s) failed on %d deliveries: dead-lettered",
                    delivery.message_id,
                    envelope.run_id if envelope else "?",
                    _redeliveries(message) + 1,
                )
        await message.nack(requeue=False)

    async def _poll_timers(self) -> None:
        """Look for the due timers of every shard this process consumes, in one round trip for all of
        them, every ``timer_poll_s``, and hand each shard's to its loop. A shard whose last ones it has
        not fired yet is skipped: it would only find them again."""
        while not self._stopping.is_set():
            await asyncio.sleep(self.options.timer_poll_s)
            shards = [shard for shard in self._inboxes if shard not in self._timers_queued]
            try:
                async with asyncio.timeout(self.options.redis_timeout_s):
                    found = await self.store.due_timers(shards, self.clock_ms())
            except REDIS_DOWN:
                continue  # each shard's loop notices Redis gone on its own, and waits for it
            except Exception:
                log.exception("looking for due timers failed; trying again in %ss", self.options.timer_poll_s)
                continue
            for shard, members in zip(shards, found, strict=True):
                inbox = self._inboxes.get(shard)
                if members and inbox is not None:
                    self._timers_queued.add(shard)
                    inbox.put_nowait(_TimersDue(members))

    async def _fire_timers(self, shard: str, publisher: Publisher, members: list[str]) -> None:
        """Fire the shard's due timers. Every process serving the shard does this (a standby too): each
        firing is a transition that claims its timer, so a timer acts once whoever fires it (one found
        due a moment ago and fired since by another process is a recognised duplicate)."""
        outgoing: list[Outgoing] = []
        async with asyncio.timeout(self.options.redis_timeout_s):
            try:
                outcomes = await self.processor.fire_timers(shard, members)
                outgoing += [m for outcome in outcomes for m in outcome.publish]
            except REDIS_DOWN:
                raise
            except Exception:  # isolate the failing timer: one at a time, so only it stays due
                log.exception(
                    "shard %s: firing %d timers failed; firing them one by one", shard, len(members)
                )
                outgoing += await self._fire_one_by_one(shard, members)
        if not outgoing:
            return
        faults.crash(self.options.crash_points, "after-commit", faults.TIMER_BATCH)
        outgoing, done_locally = await self._continue_locally(shard, outgoing)
        await self._publish_and_mark(shard, publisher, outgoing, done_locally)

    async def _fire_one_by_one(self, shard: str, members: list[str]) -> list[Outgoing]:
        outgoing: list[Outgoing] = []
        for member in members:
            try:
                outgoing += (await self.processor.fire_timer(shard, member)).publish
            except REDIS_DOWN:
                raise
            except Exception:  # a bug: keep the shard going; the timer stays and is tried again
                log.exception("shard %s: firing timer %s failed", shard, member)
        return outgoing

    async def _sample(self, shard: str) -> None:
        """Read the shard's outbox depth and due timers into the metrics, at most every
        ``metrics_interval_s``."""
        every, now = self.options.metrics_interval_s, time.monotonic()
        if every is None or now < self._sampled.get(shard, 0.0) + every:
            return
        self._sampled[shard] = now
        async with asyncio.timeout(self.options.redis_timeout_s):
            outbox, due = await self.store.depths(shard, self.clock_ms())
        metrics.shard_depths(shard, outbox, due)

    def _reconciler(self, publisher: Publisher) -> Reconciler:
        return Reconciler(
            self.store,
            self.processor,
            publisher,
            min_age_ms=self.options.relay_min_age_ms,
            stranded_after_ms=self.options.stranded_after_ms,
            redis_timeout_s=self.options.redis_timeout_s,
        )

    async def _reconcile(self, shard: str, publisher: Publisher) -> None:
        """Nudge the shard's stranded runs (the relay takes care of its unsent outbox entries)."""
        report = await self._reconciler(publisher).stranded(shard, self.clock_ms(), dry_run=False)
        if report.stranded:
            log.warning("shard %s: stranded runs %s; nudged %s", shard, report.stranded, report.nudged)

    async def _relay(self, shard: str, publisher: Publisher) -> None:
        """Re-publish outbox entries committed but never confirmed (a crash between commit and publish)."""
        report = await self._reconciler(publisher).outbox(shard, self.clock_ms(), dry_run=False)
        if report.undeliverable:
            log.error(
                "shard %s: outbox entries %s are over SAGA_MAX_MESSAGE_BYTES and were not sent; their runs "
                "were nudged to fail the steps that needed them",
                shard,
                report.undeliverable,
            )
        if report.unsent:
            log.info(
                "shard %s: relay re-published %d of %d unsent outbox entries",
                shard,
                len(report.republished),
                len(report.unsent),
            )


def _ids(deliveries: list[_Delivery]) -> list[str]:
    return [d.message_id or "" for d in deliveries]


def _by_message(deliveries: list[_Delivery]) -> list[tuple[Delivered, list[_Delivery]]]:
    """The deliveries grouped by the AMQP message they came in, in delivery order."""
    groups: dict[int, tuple[Delivered, list[_Delivery]]] = {}
    for delivery in deliveries:
        groups.setdefault(id(delivery.message), (delivery.message, []))[1].append(delivery)
    return list(groups.values())


def _traced(put: Callable[[Delivered], None]) -> Callable[[Delivered], None]:
    """``put``, first recording when each delivery arrived (tracing on), and each message of a
    container, so every message's hop is measured as if it had travelled alone."""

    def received(message: Delivered) -> None:
        TRACE.event("received", message.message_id or "")
        for message_id in _contained_ids(message):
            TRACE.event("received", message_id)
        put(message)

    return received


def _contained_ids(message: Delivered) -> list[str]:
    """The message ids inside a container, as well as can be read (tracing only: nothing is verified)."""
    if not containers.is_container(message.headers):
        return []
    found = []
    with contextlib.suppress(EnvelopeRejected):
        for payload in containers.unpack(message.body, message.headers or {}, len(message.body)):
            with contextlib.suppress(ValueError, AttributeError):
                found.append(str(json.loads(payload).get("message_id", "")))
    return found

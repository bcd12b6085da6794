"""The worker runtime: consume task queues, run handlers, report results to the run's shard.

For each task: verify the envelope, validate the input against the handler's contract, call the handler
(async handlers on the loop, plain ones in a thread pool) with the task's idempotency key, validate the
output, publish a signed result (confirmed, mandatory) to the run's shard, then ack. The results (and
acceptances and heartbeats) finished in one event-loop turn for one shard travel in one message, each
with its own bytes and id (``workers/results.py``; ``SAGA_BATCH_RESULTS=false`` sends each alone), and
each task is acked once the message carrying its result is confirmed. A handler exception
is a reported failure, never a requeue loop: retryable unless it is a ``PermanentFailure`` (or the input
or output does not fit the contract); the orchestrator alone decides whether another attempt runs. The
result's message id is derived from the task's, so a redelivered task that runs again reports under the
same id and the orchestrator sees a duplicate.

Stages with deadlines ask for more (``report`` in the task): an acceptance when the handler starts (where
no queue clock runs, once it has run the task's ``accept_after_ms``: one that returns sooner lets its
result stand for it) and, with a heartbeat timeout, a heartbeat every third of it from then on while the
handler runs. Cancellation requests
arrive on ``saga.events`` (``cancel.<run>``, a private queue per worker process): the handler's asyncio
task is cancelled (an async handler sees ``CancelledError`` at its next await; a thread-pool handler
should poll ``context.cancelled``) and the result says it was cancelled.

Where tasks come from: one queue per task queue and contract version (``orchestrator/bus/names.py``), so
this process consumes only the contracts it has handlers for, and a task never lands on a worker that
cannot run it. At most ``concurrency`` handlers run at once, counted until a handler has really returned
(a cancelled thread-pool handler still holds its thread). Tasks of ``tasks.serial`` come on a channel of
their own, one at a time per contract queue, and each waits for the serial lane (``serial_lane.py``)
before its handler starts.

Rolling upgrades: every version a handler serves (``also_serves``, or an adapter bridging an older
version to it, ``workers/sdk.py``) is an entry of ``handlers`` of its own, so the process consumes the
contract queue of each. Once it consumes them, it registers in the live worker registry
(``orchestrator/store/worker_registry.py``) and renews its lease until it stops; it leaves the registry
before it drains, and a Redis outage only delays its registration.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import aiormq
import orjson
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage, AbstractRobustConnection
from pydantic import BaseModel, ValidationError

from orchestrator import faults, logs, metrics
from orchestrator.bus import batch
from orchestrator.bus.connect import untracked_channel
from orchestrator.bus.envelope import Envelope, EnvelopeRejected, Signer, decode, signed_message
from orchestrator.bus.inbound import Delivered, Subscription
from orchestrator.bus.names import SERIAL_TASKS, Names
from orchestrator.bus.publisher import Publisher
from orchestrator.bus.topology import TaskQueueLayout, declare_task_queue
from orchestrator.redaction import Redactor, marks_any, sensitive_values
from orchestrator.store.worker_registry import Presence, WorkerInfo
from orchestrator.trace import TRACE
from orchestrator.wire import bodies, ids, sizes
from orchestrator.wire.bodies import TaskBody
from orchestrator.wire.kinds import Kind
from workers.acks import AckCoalescer
from workers.results import Outbound, ResultBatcher
from workers.sdk import Handler, PermanentFailure
from workers.serial_lane import Lease, SerialLane

log = logging.getLogger(__name__)


def worker_info(
    handlers: dict[str, Handler], serving: list[tuple[str, str]], apps: tuple[str, ...] = ()
) -> WorkerInfo:
    """This process's entry in the live worker registry: what it serves, and through which adapters."""
    adapters = {ref: h.adapts_to for ref, h in handlers.items() if h.adapts_to is not None}
    return WorkerInfo.of_this_process(serving, adapters, apps)


@dataclass(frozen=True)
class TaskContext:
    """What a handler may want besides its input: who is asking, and the key that makes it idempotent."""

    run_id: str
    stage: str
    attempt: int
    item: int | None
    fence: str
    contract: str
    idempotency_key: str
    cancelled: threading.Event = field(default_factory=threading.Event)  # set when asked to stop


class TaskFailed(PermanentFailure):
    """Raised inside the runtime for a task that cannot run (no handler, bad input); reported as a
    failure that no retry can fix."""


AttemptKey = tuple[str, str, str]  # (run id, stage, fence): one attempt, as a cancellation names it
# One running handler: its task, and the context it was given. An attempt of a map stage has one per item
# this process is running, all under the map's one fence.
Running = tuple["asyncio.Future[Any]", TaskContext]


class MissingTopology(Exception):
    """The broker lacks what ``saga topology apply`` creates (the namespace's exchanges)."""


@dataclass
class WorkerRuntime:
    connection: AbstractRobustConnection
    handlers: dict[str, Handler]
    serving: list[tuple[str, str]]  # (task queue, contract ref) pairs: see topology.serving_queues
    signer: Signer
    names: Names = field(default_factory=Names)
    lane: SerialLane | None = None  # needed when serving tasks.serial
    concurrency: int = 8
    delivery_limit: int = 20
    quorum_group_size: int | None = None
    max_message_bytes: int = 1_048_576
    batch_results: bool = True  # one turn's reports for a shard in one message (workers/results.py)
    crash_points: frozenset[str] = frozenset()  # tests only: orchestrator/faults.py
    # a packed task that finds no free slot within this long goes back to its queue alone (_spill)
    spill_after_s: float = 1.0
    presence: Presence | None = None  # the live worker registry entry, kept while consuming
    clock_ms: Callable[[], int] = field(default=lambda: int(time.time() * 1000))
    _stopping: asyncio.Event = field(default_factory=asyncio.Event)
    _inflight: set[asyncio.Task[None]] = field(default_factory=set)
    _releasing: set[asyncio.Task[None]] = field(default_factory=set)
    _running: dict[AttemptKey, dict[str, Running]] = field(default_factory=dict)
    # deliveries not started yet, by attempt and delivery (a map's items share an attempt; a redelivery
    # after a reconnect is another delivery of the same task): set to stop waiting
    _waiting: dict[AttemptKey, dict[int, asyncio.Event]] = field(default_factory=dict)
    # attempts a cancellation named, newest last: checked again right before a handler starts, so a
    # cancellation that arrives between a task's turn and its start is not lost
    _cancelled: dict[AttemptKey, None] = field(default_factory=dict)
    _giving_up: bool = False  # consumers cancelled on the way out: waiting deliveries go back
    _slots: asyncio.Semaphore = field(init=False)
    _coalescers: dict[int, AckCoalescer] = field(default_factory=dict)  # per channel: tags count per channel
    _batcher: ResultBatcher | None = None  # the reports of this run's publisher (set by run())
    # the channels of the task queues' consumers, once every one is subscribed (for /readyz)
    _consuming_on: tuple[AbstractChannel, ...] = ()

    def __post_init__(self) -> None:
        self._slots = asyncio.Semaphore(self.concurrency)

    def stop(self) -> None:
        self._stopping.set()

    def consuming(self) -> str | None:
        """None while the worker consumes every task queue it serves; else why not (``/readyz``,
        ``orchestrator/health.py``). The channels are robust: after a reconnect aio-pika reopens them and
        the subscriptions consume again, and until then they are closed."""
        if self._stopping.is_set():
            return "stopping"
        if not self._consuming_on:
            return "not consuming yet: the task queues are not subscribed"
        if any(channel.is_closed for channel in self._consuming_on):
            return "not consuming: the task queues' channel is closed (reconnecting)"
        return None

    async def run(self) -> None:
        if any(queue == SERIAL_TASKS for queue, _ in self.serving) and self.lane is None:
            raise ValueError("a worker serving tasks.serial needs the serial lane (Redis)")
        # one thread more than the slots: a serial handler holds the lane, not a slot
        pool = ThreadPoolExecutor(max_workers=self.concurrency + 1, thread_name_prefix="saga-handler")
        channel = await self.connection.channel(publisher_confirms=True, on_return_raises=True)
        # prefetch is per consumer: the slots bound what runs at once across every queue
        await channel.set_qos(prefetch_count=self.concurrency)
        serial_channel = await self.connection.channel()
        await serial_channel.set_qos(prefetch_count=1)  # a waiting serial task is one nobody else can take
        publisher = Publisher(
            channel,
            self.signer,
            self.names,
            self.delivery_limit,
            group_size=self.quorum_group_size,
            renew_with=lambda: untracked_channel(self.connection),
            # a result the broker refuses for a while (a quorum queue electing a new leader nacks) is
            # tried again for seconds: giving the task back at once would run its handler again and use
            # up the queue's delivery limit within a second or two, dead-lettering it
            patience_s=REPORT_PATIENCE_S,
        )
        self._batcher = self._batched(publisher)
        consumers = await self._subscribe(channel, serial_channel, publisher, pool)
        self._consuming_on = (channel, serial_channel)
        log.info(
            "worker consuming %d contract queue(s) with concurrency %d", len(self.serving), self.concurrency
        )
        if self.presence is not None:
            self.presence.start()  # only now: a registered worker consumes every queue it lists
        try:
            await self._stopping.wait()
        finally:
            if self.presence is not None:
                await self.presence.stop()  # a draining worker takes no new task: it serves nothing now
            await self._drain(consumers, pool)
            await self._close(serial_channel)
            await self._close(channel)
            await publisher.close()

    async def _subscribe(
        self,
        channel: AbstractChannel,
        serial_channel: AbstractChannel,
        publisher: Publisher,
        pool: ThreadPoolExecutor,
    ) -> list[Callable[[], Awaitable[None]]]:
        consumers: list[Callable[[], Awaitable[None]]] = []
        try:
            # listening before the first task comes: a cancellation sent while the task queues are still
            # being declared (a second or more on a new vhost) would otherwise reach no one
            listening = await self._listen_for_cancellations(channel)
            for queue_name, contract in self.serving:
                serial = queue_name == SERIAL_TASKS
                on = serial_channel if serial else channel
                consumers.append(await self._consume(on, queue_name, contract, publisher, pool, serial))
            consumers.append(listening)  # stopped last: the tasks still running hear cancellations
        except aiormq.exceptions.ChannelNotFoundEntity as exc:
            raise MissingTopology(
                f"the broker has no {self.names.tasks_exchange} / {self.names.dead_letter_exchange} / "
                f"{self.names.events_exchange} exchanges for namespace {self.names.namespace!r} "
                f"({exc.args[0] if exc.args else exc}): "
                "run 'saga topology apply' with the same SAGA_AMQP_URL and SAGA_NAMESPACE first"
            ) from exc
        except aiormq.exceptions.ChannelPreconditionFailed as exc:
            raise MissingTopology(
                f"a queue this worker serves exists with other arguments "
                f"({exc.args[0] if exc.args else exc}): give every process the same SAGA_DELIVERY_LIMIT "
                "and SAGA_QUORUM_GROUP_SIZE, or delete the queue once it is empty"
            ) from exc
        return consumers

    async def _drain(self, consumers: list[Callable[[], Awaitable[None]]], pool: ThreadPoolExecutor) -> None:
        """Stop taking deliveries, give back the ones still waiting, finish the ones running."""
        for cancel in consumers:
            with contextlib.suppress(Exception):
                await cancel()
        # only now: a delivery given back while its consumer still ran would come straight back
        self._giving_up = True
        for waiting in self._waiting.values():
            for give_up in waiting.values():
                give_up.set()
        if self._inflight:
            await asyncio.gather(*self._inflight, return_exceptions=True)
        for acks in self._coalescers.values():
            await acks.flush()
        await asyncio.get_running_loop().run_in_executor(None, pool.shutdown)  # every thread returned
        if self._releasing:
            await asyncio.gather(*self._releasing, return_exceptions=True)

    async def _consume(
        self,
        channel: AbstractChannel,
        queue_name: str,
        contract: str,
        publisher: Publisher,
        pool: ThreadPoolExecutor,
        serial: bool,
    ) -> Callable[[], Awaitable[None]]:
        """Consume a contract queue; returns how to stop. Deliveries come straight from aiormq
        (``orchestrator/bus/inbound.py``), consumed again after each reconnect."""
        layout = TaskQueueLayout.of(
            self.names, queue_name, contract, self.delivery_limit, self.quorum_group_size
        )
        await declare_task_queue(channel, layout)
        # declared through the robust channel, which declares it again (passively) after a reconnect,
        # before the subscription consumes it again
        await channel.declare_queue(layout.queue.name, passive=True)
        # acked at once when a quarter of the prefetch waits for it (a busy worker), else a moment later
        prompt_at = max(1, self.concurrency // 4)
        # serial deliveries are acked one by one: a task waiting for the lane must not hold back the ack
        # of one that finished (a coalescer acks only the longest settled run of delivery tags)
        acks = None if serial else self._coalescers.setdefault(id(channel), AckCoalescer(prompt_at))
        subscription = Subscription(
            channel, layout.queue.name, lambda m: self._spawn(m, publisher, pool, acks, serial=serial)
        )
        await subscription.start()
        return subscription.cancel

    async def _listen_for_cancellations(self, channel: AbstractChannel) -> Callable[[], Awaitable[None]]:
        """A private queue (gone with this process) bound to every cancellation request; returns how to
        stop listening."""
        queue = await channel.declare_queue("", exclusive=True, auto_delete=True)
        await queue.bind(self.names.events_exchange, routing_key="cancel.#")
        tag = await queue.consume(self._on_cancel, no_ack=True)

        async def stop() -> None:
            await queue.cancel(tag)

        return stop

    async def _on_cancel(self, message: AbstractIncomingMessage) -> None:
        try:
            envelope = decode(message.body, self.signer, self.max_message_bytes)
        except EnvelopeRejected as exc:
            log.warning("ignored a cancellation request that failed verification: %s", exc)
            return
        key = (envelope.run_id, envelope.stage or "", envelope.fence or "")
        running = list(self._running.get(key, {}).values())  # every item of a map, not one of them
        if running:
            with logs.log_context(run_id=envelope.run_id, stage=envelope.stage, shard=envelope.shard):
                log.info(
                    "cancelling %s of run %s (fence %s, %d task(s)) as requested",
                    key[1],
                    key[0],
                    key[2],
                    len(running),
                )
        for future, context in running:
            if context.cancelled.is_set():
                continue  # asked before (a request delivered again): one cancellation is taken back
            context.cancelled.set()
            future.cancel()
        for give_up in self._waiting.get(key, {}).values():  # not started yet: they never will
            give_up.set()
        self._cancelled[key] = None
        while len(self._cancelled) > 10_000:
            del self._cancelled[next(iter(self._cancelled))]

    async def _close(self, channel: AbstractChannel) -> None:
        with contextlib.suppress(Exception):
            await channel.close()

    def _spawn(
        self,
        message: Delivered,
        publisher: Publisher,
        pool: ThreadPoolExecutor,
        acks: AckCoalescer | None,
        *,
        serial: bool,
    ) -> None:
        TRACE.event("received", message.message_id or "")
        if acks is not None:
            acks.delivered(message)
        settle = _Settle(message, acks)
        if batch.is_container(message.headers):
            handling = self._open(message, publisher, pool, settle, serial)
        else:
            handling = self._handle(_Delivered(message, message.body), publisher, pool, settle, serial)
        task = asyncio.create_task(handling)
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)

    async def _open(
        self,
        message: Delivered,
        publisher: Publisher,
        pool: ThreadPoolExecutor,
        settle: _Settle,
        serial: bool,
    ) -> None:
        """Handle a container of tasks (a bag's items packed by the orchestrator, ``bus/batch.py``): each
        task on its own, the delivery settled once every one of them is. One delivered again is sent
        back to its queue a task per message instead: a task that fails every delivery (it kills its
        worker, say) then reaches the queue's delivery limit alone, not with the tasks beside it."""
        try:
            payloads = batch.unpack(message.body, message.headers or {}, self.max_message_bytes)
        except EnvelopeRejected as exc:
            await self._refuse(publisher, _Delivered(message, message.body), exc, settle)
            return
        metrics.tasks_packed(len(payloads))
        if message.redelivered:
            await self._split(publisher, message, payloads, settle)
            return
        container = _ContainerSettle(settle, len(payloads))
        await asyncio.gather(
            *(
                self._handle_packed(_Delivered(message, p), publisher, pool, container, serial)
                for p in payloads
            )
        )

    async def _handle_packed(
        self,
        delivered: _Delivered,
        publisher: Publisher,
        pool: ThreadPoolExecutor,
        container: _ContainerSettle,
        serial: bool,
    ) -> None:
        """One task of a container, settled exactly once whatever happens: a task that raised instead of
        reporting makes the container go back rather than leave it unsettled, holding back every later
        ack on its channel."""
        part = container.part()
        try:
            await self._handle(delivered, publisher, pool, part, serial)
        except Exception:
            log.exception(
                "a packed task of container %s failed to run; the container goes back",
                delivered.message.message_id,
            )
            await part.requeue()

    async def _split(
        self,
        publisher: Publisher,
        message: Delivered,
        payloads: list[bytes],
        settle: _Settle,
    ) -> None:
        """Re-send a container's tasks one per message (confirmed) to the queue it came from, then settle
        it; any that could not be sent make the whole container go back (those sent are duplicates,
        recognised by their ids). Nothing is re-sent once its channel closed: the broker has taken the
        container back for another consumer, which splits it itself."""
        if not message.settleable:
            return
        sent = await asyncio.gather(
            *(_send_alone(publisher, message, p, _task_id(p)) for p in payloads),
            return_exceptions=True,
        )
        failed = [r for r in sent if isinstance(r, BaseException)]
        if failed:
            log.warning(
                "could not split container %s (%d of %d tasks not re-sent: %s); it goes back to the queue",
                message.message_id,
                len(failed),
                len(payloads),
                failed[0],
            )
            await settle.requeue()
            return
        log.info(
            "container %s came back: its %d tasks were re-sent one per message",
            message.message_id,
            len(payloads),
        )
        await settle.ack()

    async def _refuse(
        self, publisher: Publisher, task: _Delivered, exc: EnvelopeRejected, settle: _Settles
    ) -> None:
        """Park a task (or a container, with the headers that make it one, so that a replay sends it as
        it came) that failed verification on the rejected queue, then settle it."""
        message_id = task.message_id or _task_id(task.body) or None
        source = task.message.routing_key  # task queues are bound under their own names
        headers = task.message.headers or {}
        whole = task.body is task.message.body and batch.is_container(headers)
        framing = {k: headers[k] for k in batch.HEADERS if k in headers} if whole else None
        try:
            await publisher.reject(task.body, exc.reason, exc.detail, source, message_id, headers=framing)
        except Exception as trouble:  # not parked: it goes back, to be refused again
            log.warning("could not park refused task %s: %s", message_id, trouble)
            await settle.requeue()
            return
        await settle.ack()

    async def _handle(
        self,
        delivered: _Delivered,
        publisher: Publisher,
        pool: ThreadPoolExecutor,
        settle: _Settles,
        serial: bool,
    ) -> None:
        message = delivered.message
        try:
            with TRACE.span("decode", [delivered.message_id]):
                envelope = decode(delivered.body, self.signer, self.max_message_bytes)
            TRACE.decoded(envelope)
            if envelope.contract not in self.handlers:
                # only a copy put on the wrong contract queue by hand can get here (routing is by contract)
                raise EnvelopeRejected(
                    "misrouted",
                    f"a task for {envelope.contract!r} on {message.routing_key}, whose worker has no handler "
                    "for it: tasks reach only the queue of their own contract version",
                )
        except EnvelopeRejected as exc:
            await self._refuse(publisher, delivered, exc, settle)
            return
        logs.bind(**logs.envelope_ids(envelope))  # a task of its own: everything it logs is about this task
        turn = await self._wait_turn(envelope, serial, delivered)
        if isinstance(turn, _Spill):
            if await self._spill(publisher, delivered, envelope, settle):
                return
            turn = await self._wait_turn(envelope, serial, delivered, patient=True)
        if turn is None or isinstance(turn, _Spill):  # the worker is stopping: the task goes back
            await self._give_back(publisher, delivered, envelope, settle)
            return
        try:
            if not message.settleable:
                return  # its channel closed while it waited: the broker gave it to another consumer
            if self._expired(envelope, message):
                await settle.ack()  # the queue clock times the attempt out: no report, no work
                return
            if turn.cancelled:
                outcome = Outcome(
                    False, "cancelled before it started: the orchestrator asked", cancelled=True
                )
                metrics.task_done(envelope.contract or "", ok=False, cancelled=True, seconds=None)
            else:
                outcome = await self._run(publisher, envelope, pool, turn)
        finally:
            if not turn.handed_over:  # no handler runs on it: give it back now
                turn.finished()
        await self._report_result(publisher, delivered, envelope, outcome, settle)

    def _expired(self, envelope: Envelope, message: Delivered) -> bool:
        """Whether a task is not to start: its queue deadline passed before it got a turn. Its attempt has
        a queue clock (that is what gives a task a deadline), which times it out, or has; so the task is
        settled without a report, whose id a live attempt's result would need. Only a first delivery: a
        redelivered one may be an attempt a worker that then crashed had already accepted, which only a
        worker running it can finish."""
        if envelope.deadline_ms is None or message.redelivered or self.clock_ms() <= envelope.deadline_ms:
            return False
        log.info(
            "task %s of run %s not started: its queue deadline (%d) passed before it got a turn",
            envelope.message_id,
            envelope.run_id,
            envelope.deadline_ms,
        )
        metrics.task_done(envelope.contract or "", ok=False, cancelled=True, seconds=None)
        return True

    async def _report_result(
        self,
        publisher: Publisher,
        delivered: _Delivered,
        envelope: Envelope,
        outcome: Outcome,
        settle: _Settles,
    ) -> None:
        """Send the attempt's result to its run's shard; settle the task once the result is safe."""
        result = self._result(envelope, outcome)
        faults.crash(self.crash_points, "worker-after-effect")
        result_id = ids.result_id(envelope.message_id)
        try:
            await self._reports().send(result, result_id, envelope.shard)
        except aiormq.exceptions.PublishError:
            # The run's shard has no queue (retired, so the run has ended): no retry can deliver it, and
            # requeueing the task would only run it again. The result is parked with the reason.
            why = f"the result is for shard {envelope.shard}, which has no queue (retired?)"
            log.warning("result of %s of run %s: %s; parked", envelope.stage, envelope.run_id, why)
            try:
                await publisher.reject(result, "unroutable", why, self.names.runs_exchange, result_id)
            except Exception:
                await settle.requeue()
                return
            await settle.ack()
            return
        except Exception:
            log.exception(
                "could not report %s of run %s; the task goes back to the queue",
                envelope.stage,
                envelope.run_id,
            )
            await self._give_back(publisher, delivered, envelope, settle)
            return
        with TRACE.span("ack", [envelope.message_id]):
            await settle.ack()  # the result is confirmed: the task may be acked

    async def _wait_turn(
        self, envelope: Envelope, serial: bool, delivered: _Delivered, *, patient: bool = False
    ) -> Turn | _Spill | None:
        """Wait until this task may start: a free slot, and for a serial task the serial lane too. None
        when the worker gives its deliveries back first; a turn marked ``cancelled`` when the attempt was
        cancelled first; ``_Spill`` for a packed task (unless ``patient``) that found no free slot within
        ``spill_after_s``."""
        if self._giving_up:
            return None
        key = (envelope.run_id, envelope.stage or "", envelope.fence or "")
        give_up = asyncio.Event()
        waiting = self._waiting.setdefault(key, {})
        waiting[id(delivered)] = give_up
        try:
            if serial:
                return await self._wait_for_lane(envelope, give_up)
            if delivered.packed and not patient and self._slots.locked():
                try:  # a timer on this task, not a task of its own as wait_for makes: many tasks wait here
                    async with asyncio.timeout(self.spill_after_s):
                        await self._slots.acquire()
                except TimeoutError:
                    if self._giving_up:
                        return None
                    if key in self._cancelled:  # asked while it waited: reported so, not sent on
                        return Turn(self, None, False, cancelled=True)
                    return _Spill()
            else:
                await self._slots.acquire()
            if self._giving_up:
                self._slots.release()
                return None
            return Turn(self, None, True, cancelled=key in self._cancelled)
        finally:
            waiting.pop(id(delivered), None)
            if not waiting:
                self._waiting.pop(key, None)

    async def _spill(
        self, publisher: Publisher, delivered: _Delivered, envelope: Envelope, settle: _Settles
    ) -> bool:
        """Send a packed task that found no free slot in time back to its queue alone (confirmed), where
        any worker may take it, and count it settled in its container. A busy worker then neither holds
        the task while others idle nor holds back its container's ack (a container is acked once every
        task in it is settled: held long enough, the broker would take it back). True too when its
        channel closed (the broker took the container back: nothing is left to settle); False when it
        could not be sent: the caller waits for a slot after all."""
        message = delivered.message
        if not message.settleable:
            return True
        try:
            await _send_alone(publisher, message, delivered.body, envelope.message_id)
        except Exception as exc:
            log.warning("could not send packed task %s back to its queue: %s", envelope.message_id, exc)
            return False
        metrics.task_spilled(envelope.contract or "")
        await settle.ack()
        return True

    async def _give_back(
        self, publisher: Publisher, delivered: _Delivered, envelope: Envelope, settle: _Settles
    ) -> None:
        """Give a task back for another worker: a packed one alone to its queue, so that its container is
        acked once its other tasks have reported (given back whole, it would make them run again, tasks
        of other runs among them); else, or if that cannot be sent, its delivery back to the queue."""
        if delivered.packed and await self._spill(publisher, delivered, envelope, settle):
            return
        await settle.requeue()

    async def _wait_for_lane(self, envelope: Envelope, give_up: asyncio.Event) -> Turn | None:
        if self.lane is None:
            raise RuntimeError("a serial task reached a worker without the serial lane")  # run() refuses this
        task = {"run_id": envelope.run_id, "stage": envelope.stage, "contract": envelope.contract}
        lease = await self.lane.take({**task, "fence": envelope.fence}, give_up)
        if lease is None:
            return None if self._giving_up else Turn(self, None, False, cancelled=True)
        key = (envelope.run_id, envelope.stage or "", envelope.fence or "")
        return Turn(self, lease, False, cancelled=key in self._cancelled)

    async def _run(
        self, publisher: Publisher, envelope: Envelope, pool: ThreadPoolExecutor, turn: Turn
    ) -> Outcome:
        task = TaskBody.of(envelope.body, envelope.message_id)
        reporting = self._liveness(publisher, envelope, task) if task.accept else None
        started = time.perf_counter()
        try:
            with TRACE.span("handler", [envelope.message_id]):
                outcome = await self._execute(envelope, task, pool, turn)
        finally:
            if reporting is not None:
                reporting.cancel()  # a result in time says the attempt started: no acceptance needed
        ran_s = time.perf_counter() - started
        metrics.task_done(envelope.contract or "", ok=outcome.ok, cancelled=outcome.cancelled, seconds=ran_s)
        return outcome

    def _liveness(self, publisher: Publisher, envelope: Envelope, task: TaskBody) -> asyncio.Task[None]:
        """The attempt's acceptance, sent once its handler has run the task's ``accept_after_ms`` (the
        orchestrator asks for a wait only where no queue clock runs), then its heartbeats (a third of
        the timeout apart), until the caller cancels it as the handler returns. A handler that returns
        sooner sends no acceptance: its result stands for it, one message and one transition fewer."""

        async def report() -> None:
            if task.accept_after_ms:
                await asyncio.sleep(task.accept_after_ms / 1000)
            accepted = ids.acceptance_id(envelope.run_id, envelope.stage or "", envelope.fence or "")
            await self._report(publisher, envelope, Kind.ACCEPTED, accepted)
            if task.heartbeat_ms is None:
                return
            for n in itertools.count(1):
                await asyncio.sleep(task.heartbeat_ms / 3000)
                beat = ids.heartbeat_id(envelope.run_id, envelope.stage or "", envelope.fence or "", n)
                await self._report(publisher, envelope, Kind.HEARTBEAT, beat)

        return asyncio.create_task(report())

    async def _report(self, publisher: Publisher, task: Envelope, kind: Kind, message_id: str) -> None:
        """Tell the run's shard about the attempt (acceptance, heartbeat). Best effort: a lost report
        can only make a clock expire, which fences the attempt; it never corrupts the run."""
        what = kind.value
        body = self._reply(task, kind, message_id, {})
        try:
            await self._reports().send(body, message_id, task.shard)
        except Exception as exc:
            log.warning("could not report %s of %s (run %s): %s", what, task.stage, task.run_id, exc)

    def _batched(self, publisher: Publisher) -> ResultBatcher:
        """The batcher of ``publisher``'s reports (results, acceptances, heartbeats) to run shards."""

        async def publish(message: Outbound) -> None:
            await self._publish_report(publisher, message)

        return ResultBatcher(publish, self.max_message_bytes, enabled=self.batch_results)

    def _reports(self) -> ResultBatcher:
        if self._batcher is None:
            raise RuntimeError("a report before the worker runs: run() makes its publisher")
        return self._batcher

    async def _publish_report(self, publisher: Publisher, message: Outbound) -> None:
        """Publish a report, or a container of several, with the publisher's confirm and retries."""
        container = message.headers is not None
        if container and TRACE.enabled:  # each report's own hop, as if it had travelled alone
            for report in message.ids:
                TRACE.event("sent", report)
        await publisher.publish_bytes(
            message.body,
            message.message_id,
            self.names.runs_exchange,
            message.shard,
            headers=message.headers,
            content_type=batch.CONTENT_TYPE if container else "application/json",
        )
        if container:
            metrics.reports_batched(len(message.ids))
            if TRACE.enabled:
                for report in message.ids:
                    TRACE.event("confirmed", report)

    async def _execute(
        self, envelope: Envelope, task: TaskBody, pool: ThreadPoolExecutor, turn: Turn
    ) -> Outcome:
        """Run the task's handler; ``turn`` is given back once the handler has returned, which for a
        cancelled thread-pool handler may be after this returns the cancelled outcome."""
        handler = self.handlers[envelope.contract or ""]  # _handle refused any other contract
        output: Any = None
        try:
            try:
                payload = handler.input_model.model_validate(task.input)
            except ValidationError as exc:
                raise TaskFailed(
                    f"input does not fit {envelope.contract}: {exc.errors(include_url=False)}"
                ) from exc
            context = TaskContext(
                envelope.run_id,
                envelope.stage or "",
                envelope.attempt or 1,
                envelope.item,
                envelope.fence or "",
                envelope.contract or "",
                task.idempotency_key,
            )
            output = await self._run_cancellable(envelope, handler, payload, context, pool, turn)
            try:
                return Outcome(True, _validated_output(handler, output))
            except ValidationError as exc:  # the handler broke its contract: no retry will mend it
                raise TaskFailed(f"output does not fit {envelope.contract}: {exc}") from exc
        except _Cancelled:
            return Outcome(False, "cancelled: the orchestrator asked this attempt to stop", cancelled=True)
        except Exception as exc:  # the handler's failure is the stage's failure, reported, not requeued
            # its text may quote the task's sensitive values (an error message, a validation error): it goes
            # to the run's history and this log with them marked
            error = self._redactor(handler, task.input, output).scrub(f"{type(exc).__name__}: {exc}")
            log.info("task %s of run %s failed: %s", envelope.stage, envelope.run_id, error)
            retryable = not isinstance(exc, PermanentFailure)
            return Outcome(False, error, retryable=retryable)

    def _redactor(self, handler: Handler, task_input: Any, output: Any) -> Redactor:
        """What marks the task's sensitive values (its input's, its output's) in what it reports."""
        contract = handler.contract
        found = (
            sensitive_values(task_input, contract.input_schema) if marks_any(contract.input_schema) else []
        )
        if output is not None and marks_any(contract.output_schema):
            shown = output.model_dump(mode="json") if isinstance(output, BaseModel) else output
            found += sensitive_values(shown, contract.output_schema)
        return Redactor.of(found, self.signer.ring.data_secret())

    async def _run_cancellable(
        self,
        envelope: Envelope,
        handler: Handler,
        payload: BaseModel,
        context: TaskContext,
        pool: ThreadPoolExecutor,
        turn: Turn,
    ) -> Any:
        """Run the handler so that a cancellation request can stop it (and only it): an async handler in
        this delivery's own task (a task of its own cost a task and a loop turn on every task's path), a
        sync one in the thread pool. The request cancels what ``_running`` holds for the attempt; a
        cancellation that the request made is taken back here and becomes the cancelled outcome."""
        key = (envelope.run_id, context.stage, context.fence)
        if key in self._cancelled:  # asked while the task waited for its turn
            raise _Cancelled
        args = (payload, context) if handler.wants_context else (payload,)
        this = asyncio.current_task()
        if handler.is_async:
            if this is None:
                raise RuntimeError("a task's handler runs in the task of its delivery")
            future: asyncio.Future[Any] = this
            work: Awaitable[Any] = handler.function(*args)
        else:
            future = work = _in_thread(handler, args, pool, turn.finished)
            turn.handed_over = True  # the thread gives the turn back when it is done
        running = self._running.setdefault(key, {})
        running[envelope.message_id] = (future, context)  # a task's id tells a map's items apart
        try:
            output = await work
        except asyncio.CancelledError:
            # taken back only if the request was this cancellation's only source: one from outside (the
            # worker stopping) stays pending and goes on up
            if context.cancelled.is_set() and (future is not this or this.uncancel() == 0):
                raise _Cancelled from None
            raise
        except BaseException:
            _take_back(future, context)  # a handler that swallowed the request, then failed
            raise
        else:
            _take_back(future, context)  # a handler that swallowed the request: its result stands
        finally:
            running.pop(envelope.message_id, None)
            if not running:
                self._running.pop(key, None)
        return output

    def _result(self, task: Envelope, outcome: Outcome) -> bytes:
        body = bodies.result(
            outcome.ok,
            outcome.value,
            sizes.Limits(self.max_message_bytes),
            retryable=outcome.retryable,
            cancelled=outcome.cancelled,
        )
        return self._reply(task, Kind.RESULT, ids.result_id(task.message_id), body)

    def _reply(self, task: Envelope, kind: Kind, message_id: str, body: dict[str, Any]) -> bytes:
        """A signed message about ``task`` for its run's shard, carrying the task's identity."""
        return signed_message(
            self.signer,
            kind=kind.value,
            message_id=message_id,
            run_id=task.run_id,
            shard=task.shard,
            stage=task.stage,
            attempt=task.attempt,
            fence=task.fence,
            item=task.item,
            digest=task.digest,
            contract=task.contract,
            tenant=task.tenant,
            issued_at_ms=self.clock_ms(),
            body=body,
        )


@dataclass(frozen=True)
class _Settle:
    """How a delivery is settled: through its channel's ack coalescer, or one by one (``acks`` None)."""

    message: Delivered
    acks: AckCoalescer | None

    async def ack(self) -> None:
        if self.acks is not None:
            self.acks.settled(self.message)
            return
        try:
            await self.message.ack()
        except Exception:  # the channel is gone: the broker redelivers it
            log.warning("could not ack delivery %s; the broker will redeliver", self.message.delivery_tag)

    async def requeue(self) -> None:
        with contextlib.suppress(Exception):  # a closed channel has requeued it already
            await self.message.nack(requeue=True)
        if self.acks is not None:
            self.acks.settled(self.message, already_settled=True)


@dataclass
class _ContainerSettle:
    """The settling of a container's tasks: its delivery is acked once every task is settled, or given
    back if any of them had to be (the others then run again, and report as duplicates)."""

    settle: _Settle
    left: int
    again: bool = False

    def part(self) -> _PartSettle:
        """How one of its tasks is settled (once: a second settling of the same task is ignored)."""
        return _PartSettle(self)

    async def one_settled(self, *, requeue: bool) -> None:
        self.again = self.again or requeue
        self.left -= 1
        if self.left == 0:
            await (self.settle.requeue() if self.again else self.settle.ack())


@dataclass
class _PartSettle:
    """One task of a container: it counts towards its container's settling once."""

    container: _ContainerSettle
    done: bool = False

    async def ack(self) -> None:
        await self._settled(requeue=False)

    async def requeue(self) -> None:
        await self._settled(requeue=True)

    async def _settled(self, *, requeue: bool) -> None:
        if not self.done:
            self.done = True
            await self.container.one_settled(requeue=requeue)


_Settles = _Settle | _PartSettle  # how a task is settled: its own delivery, or its share of a container


@dataclass(frozen=True, eq=False)
class _Delivered:
    """One task as it came: a delivery of its own, or one of a container's (which share the delivery)."""

    message: Delivered
    body: bytes

    @property
    def packed(self) -> bool:
        """Whether it came in a container beside other tasks."""
        return self.body is not self.message.body

    @property
    def message_id(self) -> str:
        """Its AMQP message id; a packed task's is in its envelope (read only when tracing)."""
        if not self.packed:
            return self.message.message_id or ""
        return _task_id(self.body) if TRACE.enabled else ""


async def _send_alone(publisher: Publisher, container: Delivered, payload: bytes, message_id: str) -> None:
    """Send one task of ``container`` back to the queue the container came from, as a message of its own
    (confirmed): a redelivered container's split, and a packed task spilled or given back."""
    await publisher.publish_bytes(payload, message_id, container.exchange, container.routing_key)


def _task_id(payload: bytes) -> str:
    """A packed task's message id, read from its envelope (verified later, when it is decoded)."""
    with contextlib.suppress(Exception):
        value = orjson.loads(payload).get("message_id")
        if isinstance(value, str):
            return value
    return ""


#: How long a worker keeps trying a report the broker refuses or does not confirm before the task goes back.
REPORT_PATIENCE_S = 8.0


@dataclass(frozen=True)
class Outcome:
    """What a task came to: a result, or an error with whether another attempt may succeed."""

    ok: bool
    value: Any
    retryable: bool = True
    cancelled: bool = False


class _Spill:
    """A packed task's answer from its wait for a turn: no slot came free in time; send it back alone."""


class _Cancelled(Exception):
    """The handler was stopped because the orchestrator asked (not because the worker is stopping)."""


def _take_back(future: asyncio.Future[Any], context: TaskContext) -> None:
    """Take back the cancellation a request made of the delivery's own task (``future``) when its handler
    swallowed it: what runs after in the task (reporting, settling) must not meet it."""
    if future is asyncio.current_task() and context.cancelled.is_set() and future.cancelling():
        future.uncancel()


def _in_thread(
    handler: Handler, args: tuple[Any, ...], pool: ThreadPoolExecutor, returned: Callable[[], None]
) -> asyncio.Future[Any]:
    """Start a sync handler in the pool; its result comes in the future returned. ``returned`` is called
    once the thread is done with it, however long after a cancellation of the future that is (a thread
    cannot be stopped, only asked to)."""
    loop = asyncio.get_running_loop()
    # in the task's context, as an async handler is: what the handler logs carries the task's ids
    work = pool.submit(contextvars.copy_context().run, handler.function, *args)
    work.add_done_callback(lambda _: loop.call_soon_threadsafe(returned))
    return asyncio.wrap_future(work, loop=loop)


@dataclass
class Turn:
    """A task's permission to run: a concurrency slot, or the serial lane. Given back exactly once."""

    runtime: WorkerRuntime
    lease: Lease | None
    slot: bool
    cancelled: bool = False
    handed_over: bool = False  # a handler runs on it and gives it back when it returns
    _done: bool = False

    def finished(self) -> None:
        if self._done:
            return
        self._done = True
        if self.slot:
            self.runtime._slots.release()
        if self.lease is not None:
            releasing = asyncio.ensure_future(self.lease.release())
            self.runtime._releasing.add(releasing)
            releasing.add_done_callback(self.runtime._releasing.discard)


def _validated_output(handler: Handler, output: Any) -> Any:
    model = handler.output_model
    checked = output if isinstance(output, model) else model.model_validate(output)
    return checked.model_dump(mode="json")

"""The worker runtime: consume task queues, run handlers, report results to the run's shard.

For each task: verify the envelope, validate the input against the handler's contract, call the handler
(async handlers on the loop, plain ones in a thread pool) with the task's idempotency key, validate the
output, publish a signed result (confirmed, mandatory) to the run's shard, then ack. A handler exception
is a reported failure, never a requeue loop: retryable unless it is a ``PermanentFailure`` (or the input
or output does not fit the contract); the orchestrator alone decides whether another attempt runs. The
result's message id is derived from the task's, so a redelivered task that runs again reports under the
same id and the orchestrator sees a duplicate.

Stages with deadlines ask for more (``report`` in the task): an acceptance when the handler starts and,
with a heartbeat timeout, a heartbeat every third of it while the handler runs. Cancellation requests
arrive on ``saga.events`` (``cancel.<run>``, a private queue per worker process): the handler's asyncio
task is cancelled (an async handler sees ``CancelledError`` at its next await; a thread-pool handler
should poll ``context.cancelled``) and the result says it was cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from aio_pika.abc import AbstractChannel, AbstractIncomingMessage, AbstractRobustConnection
from pydantic import BaseModel, ValidationError

from orchestrator import faults
from orchestrator.bus import names
from orchestrator.bus.envelope import Envelope, EnvelopeRejected, Kind, Signer, decode, signed_message
from orchestrator.bus.publisher import Publisher
from orchestrator.engine import ids, sizes
from workers.acks import AckCoalescer
from workers.sdk import Handler, PermanentFailure

log = logging.getLogger(__name__)


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


@dataclass
class WorkerRuntime:
    connection: AbstractRobustConnection
    handlers: dict[str, Handler]
    queues: list[str]
    signer: Signer
    concurrency: int = 8
    max_message_bytes: int = 1_048_576
    crash_points: frozenset[str] = frozenset()  # tests only: orchestrator/faults.py
    clock_ms: Callable[[], int] = field(default=lambda: int(time.time() * 1000))
    _stopping: asyncio.Event = field(default_factory=asyncio.Event)
    _inflight: set[asyncio.Task[None]] = field(default_factory=set)
    _acks: AckCoalescer = field(default_factory=AckCoalescer)
    _running: dict[AttemptKey, dict[str, Running]] = field(default_factory=dict)

    def stop(self) -> None:
        self._stopping.set()

    async def run(self) -> None:
        pool = ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="saga-handler")
        channel = await self.connection.channel(publisher_confirms=True, on_return_raises=True)
        await channel.set_qos(prefetch_count=self.concurrency)
        publisher = Publisher(channel, self.signer)
        consumers = []
        for name in self.queues:
            # Declared (passively), so that the robust channel re-subscribes it after a reconnect
            queue = await channel.declare_queue(name, passive=True)
            tag = await queue.consume(lambda m: self._spawn(m, publisher, pool), no_ack=False)
            consumers.append((queue, tag))
        consumers.append(await self._listen_for_cancellations(channel))
        log.info("worker consuming %s with concurrency %d", ", ".join(self.queues), self.concurrency)
        try:
            await self._stopping.wait()
        finally:
            for queue, tag in consumers:
                with contextlib.suppress(Exception):
                    await queue.cancel(tag)
            if self._inflight:
                await asyncio.gather(*self._inflight, return_exceptions=True)  # drain: finish what we hold
            await self._acks.flush()
            await self._close(channel)
            pool.shutdown(wait=True)

    async def _listen_for_cancellations(self, channel: AbstractChannel) -> tuple[Any, str]:
        """A private queue (gone with this process) bound to every cancellation request."""
        queue = await channel.declare_queue("", exclusive=True, auto_delete=True)
        await queue.bind(names.EVENTS_EXCHANGE, routing_key="cancel.#")
        tag = await queue.consume(self._on_cancel, no_ack=True)
        return queue, tag

    async def _on_cancel(self, message: AbstractIncomingMessage) -> None:
        try:
            envelope = decode(message.body, self.signer, self.max_message_bytes)
        except EnvelopeRejected as exc:
            log.warning("ignored a cancellation request that failed verification: %s", exc)
            return
        key = (envelope.run_id, envelope.stage or "", envelope.fence or "")
        running = list(self._running.get(key, {}).values())  # every item of a map, not one of them
        if running:
            log.info(
                "cancelling %s of run %s (fence %s, %d task(s)) as requested",
                key[1],
                key[0],
                key[2],
                len(running),
            )
        for future, context in running:
            context.cancelled.set()
            future.cancel()

    async def _close(self, channel: AbstractChannel) -> None:
        with contextlib.suppress(Exception):
            await channel.close()

    async def _spawn(
        self, message: AbstractIncomingMessage, publisher: Publisher, pool: ThreadPoolExecutor
    ) -> None:
        self._acks.delivered(message)
        task = asyncio.create_task(self._handle(message, publisher, pool))
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)

    async def _handle(
        self, message: AbstractIncomingMessage, publisher: Publisher, pool: ThreadPoolExecutor
    ) -> None:
        try:
            envelope = decode(message.body, self.signer, self.max_message_bytes)
        except EnvelopeRejected as exc:
            source = message.routing_key or ""  # task queues are bound under their own names
            await publisher.reject(message.body, exc.reason, exc.detail, source, message.message_id)
            self._acks.settled(message)
            return
        report = envelope.body.get("report") or {}
        if report.get("accept"):
            accepted = ids.acceptance_id(envelope.run_id, envelope.stage or "", envelope.fence or "")
            await self._report(publisher, envelope, Kind.ACCEPTED, accepted)
        beating = self._heartbeats(publisher, envelope, report.get("heartbeat_ms"))
        try:
            outcome = await self._execute(envelope, pool)
        finally:
            if beating is not None:
                beating.cancel()
        result = self._result(envelope, outcome)
        faults.crash(self.crash_points, "worker-after-effect")
        try:
            await publisher.publish_bytes(
                result, ids.result_id(envelope.message_id), names.RUNS_EXCHANGE, envelope.shard
            )
        except Exception:
            log.exception(
                "could not report %s of run %s; the task goes back to the queue",
                envelope.stage,
                envelope.run_id,
            )
            await message.nack(requeue=True)
            self._acks.settled(message, already_settled=True)
            return
        self._acks.settled(message)  # the result is confirmed: the task may be acked

    def _heartbeats(
        self, publisher: Publisher, envelope: Envelope, every_ms: Any
    ) -> asyncio.Task[None] | None:
        if not isinstance(every_ms, int) or every_ms <= 0:
            return None

        async def beat() -> None:
            for n in itertools.count(1):
                await asyncio.sleep(every_ms / 3000)
                beat = ids.heartbeat_id(envelope.run_id, envelope.stage or "", envelope.fence or "", n)
                await self._report(publisher, envelope, Kind.HEARTBEAT, beat)

        return asyncio.create_task(beat())

    async def _report(self, publisher: Publisher, task: Envelope, kind: Kind, message_id: str) -> None:
        """Tell the run's shard about the attempt (acceptance, heartbeat). Best effort: a lost report
        can only make a clock expire, which fences the attempt; it never corrupts the run."""
        what = kind.value
        body = self._reply(task, kind, message_id, {})
        try:
            await publisher.publish_bytes(body, message_id, names.RUNS_EXCHANGE, task.shard)
        except Exception as exc:
            log.warning("could not report %s of %s (run %s): %s", what, task.stage, task.run_id, exc)

    async def _execute(self, envelope: Envelope, pool: ThreadPoolExecutor) -> Outcome:
        try:
            handler = self.handlers.get(envelope.contract or "")
            if handler is None:
                raise TaskFailed(f"this worker has no handler for {envelope.contract!r}")
            try:
                payload = handler.input_model.model_validate(envelope.body.get("input"))
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
                str(envelope.body.get("idempotency_key", envelope.message_id)),
            )
            output = await self._run_cancellable(envelope, handler, payload, context, pool)
            try:
                return Outcome(True, _validated_output(handler, output))
            except ValidationError as exc:  # the handler broke its contract: no retry will mend it
                raise TaskFailed(f"output does not fit {envelope.contract}: {exc}") from exc
        except _Cancelled:
            return Outcome(False, "cancelled: the orchestrator asked this attempt to stop", cancelled=True)
        except Exception as exc:  # the handler's failure is the stage's failure, reported, not requeued
            log.info("task %s of run %s failed: %s", envelope.stage, envelope.run_id, exc)
            retryable = not isinstance(exc, PermanentFailure)
            return Outcome(False, f"{type(exc).__name__}: {exc}", retryable=retryable)

    async def _run_cancellable(
        self,
        envelope: Envelope,
        handler: Handler,
        payload: BaseModel,
        context: TaskContext,
        pool: ThreadPoolExecutor,
    ) -> Any:
        """Run the handler as its own task, so a cancellation request can stop it (and only it)."""
        key = (envelope.run_id, context.stage, context.fence)
        future = asyncio.ensure_future(_call(handler, payload, context, pool))
        running = self._running.setdefault(key, {})
        running[envelope.message_id] = (future, context)  # a task's id tells a map's items apart
        try:
            return await future
        except asyncio.CancelledError:
            if context.cancelled.is_set():
                raise _Cancelled from None
            raise  # the worker itself is being cancelled
        finally:
            running.pop(envelope.message_id, None)
            if not running:
                self._running.pop(key, None)

    def _result(self, task: Envelope, outcome: Outcome) -> bytes:
        body = report_body(outcome, sizes.Limits(self.max_message_bytes))
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
class Outcome:
    """What a task came to: a result, or an error with whether another attempt may succeed."""

    ok: bool
    value: Any
    retryable: bool = True
    cancelled: bool = False


def report_body(outcome: Outcome, limits: sizes.Limits) -> dict[str, Any]:
    """The body of the report of ``outcome``. A result too large for a message, or not valid JSON (NaN),
    is reported as a failure that says so (sent as it is, the shard would refuse it unread and the
    attempt would wait for its deadline, or for ever); an error text is cut to a bounded length."""
    if outcome.ok:
        body = {"ok": True, "result": outcome.value}
        problem = sizes.too_big(body, limits)
        if problem is None:
            return body
        return {"ok": False, "error": f"the result cannot be sent: {problem}", "retryable": False}
    failure = {"ok": False, "error": sizes.bounded(str(outcome.value)), "retryable": outcome.retryable}
    if outcome.cancelled:
        failure["cancelled"] = True
    return failure


class _Cancelled(Exception):
    """The handler was stopped because the orchestrator asked (not because the worker is stopping)."""


async def _call(handler: Handler, payload: BaseModel, context: TaskContext, pool: ThreadPoolExecutor) -> Any:
    wants_context = len(inspect.signature(handler.function).parameters) >= 2
    args = (payload, context) if wants_context else (payload,)
    if handler.is_async:
        return await handler.function(*args)
    return await asyncio.get_running_loop().run_in_executor(pool, lambda: handler.function(*args))


def _validated_output(handler: Handler, output: Any) -> Any:
    model = handler.output_model
    checked = output if isinstance(output, model) else model.model_validate(output)
    return checked.model_dump(mode="json")

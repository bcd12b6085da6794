"""The worker runtime: consume task queues, run handlers, report results to the run's shard.

For each task: verify the envelope, validate the input against the handler's contract, call the handler
(async handlers on the loop, plain ones in a thread pool) with the task's idempotency key, validate the
output, publish a signed result (confirmed, mandatory) to the run's shard, then ack. A handler exception
is a reported failure, never a requeue loop. The result's message id is derived from the task's, so a
redelivered task that runs again reports under the same id and the orchestrator sees a duplicate.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from aio_pika.abc import AbstractChannel, AbstractIncomingMessage, AbstractRobustConnection
from pydantic import BaseModel, ValidationError

from orchestrator.bus import names
from orchestrator.bus.envelope import Envelope, EnvelopeRejected, Kind, Signer, decode, signed_message
from orchestrator.bus.publisher import Publisher
from orchestrator.engine import ids
from workers.acks import AckCoalescer
from workers.sdk import Handler

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


class TaskFailed(Exception):
    """Raised inside the runtime for a task that cannot run (no handler, bad input); reported as a failure."""


@dataclass
class WorkerRuntime:
    connection: AbstractRobustConnection
    handlers: dict[str, Handler]
    queues: list[str]
    signer: Signer
    concurrency: int = 8
    max_message_bytes: int = 1_048_576
    clock_ms: Callable[[], int] = field(default=lambda: int(time.time() * 1000))
    _stopping: asyncio.Event = field(default_factory=asyncio.Event)
    _inflight: set[asyncio.Task[None]] = field(default_factory=set)
    _acks: AckCoalescer = field(default_factory=AckCoalescer)

    def stop(self) -> None:
        self._stopping.set()

    async def run(self) -> None:
        pool = ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="saga-handler")
        channel = await self.connection.channel(publisher_confirms=True, on_return_raises=True)
        await channel.set_qos(prefetch_count=self.concurrency)
        publisher = Publisher(channel, self.signer)
        consumers = []
        for name in self.queues:
            queue = await channel.get_queue(name, ensure=False)
            tag = await queue.consume(lambda m: self._spawn(m, publisher, pool), no_ack=False)
            consumers.append((queue, tag))
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
            await publisher.reject(message.body, exc.reason, exc.detail, message.routing_key or "")
            self._acks.settled(message)
            return
        ok, value = await self._execute(envelope, pool)
        result = self._result(envelope, ok, value)
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

    async def _execute(self, envelope: Envelope, pool: ThreadPoolExecutor) -> tuple[bool, Any]:
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
            output = await _call(handler, payload, context, pool)
            return True, _validated_output(handler, output)
        except Exception as exc:  # the handler's failure is the stage's failure, reported, not requeued
            log.info("task %s of run %s failed: %s", envelope.stage, envelope.run_id, exc)
            return False, f"{type(exc).__name__}: {exc}"

    def _result(self, task: Envelope, ok: bool, value: Any) -> bytes:
        body = {"ok": True, "result": value} if ok else {"ok": False, "error": value}
        return signed_message(
            self.signer,
            kind=Kind.RESULT.value,
            message_id=ids.result_id(task.message_id),
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

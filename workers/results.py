"""A worker's reports to the run shards, batched: what a worker finished in one event-loop turn for one
shard travels in one message (a container, ``orchestrator/bus/batch.py``).

A broker message costs the broker a confirm, a write to its log and a delivery, and the worker and the
orchestrator a socket write or two each, however small the message: many concurrent tasks finishing
together answer in one. Each report keeps its own bytes (its id, fence and signature) inside the
container, and its sender hears back only once the container is confirmed (or gets the error), so a task
is still acked only once its result is safe.

``send`` adds a report to its shard's pending list and schedules one flush for the end of the turn
(``loop.call_soon``); a report that would make the container larger than the message limit flushes the
list first. A list of one goes as the plain message it would be without batching, byte for byte. Pure
logic around an injected ``publish`` (the worker's confirmed, retrying publisher).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from orchestrator.bus import batch


@dataclass(frozen=True)
class Outbound:
    """One message to publish to ``shard``: a plain report, or a container of ``ids`` (``headers`` set)."""

    body: bytes
    message_id: str
    shard: str
    ids: tuple[str, ...]  # the reports it carries
    headers: Mapping[str, Any] | None = None


Publish = Callable[[Outbound], Awaitable[None]]


@dataclass
class _Pending:
    bodies: list[bytes] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)
    senders: list[asyncio.Future[None]] = field(default_factory=list)
    size: int = 0  # the container's body, were it sent now


class ResultBatcher:
    """Batches the reports of one publisher (see the module docstring)."""

    def __init__(self, publish: Publish, max_bytes: int, *, enabled: bool = True) -> None:
        self._publish = publish
        self.max_bytes = max_bytes
        self.enabled = enabled
        self._pending: dict[str, _Pending] = {}
        self._scheduled = False
        self._publishing: set[asyncio.Task[None]] = set()

    async def send(self, body: bytes, message_id: str, shard: str) -> None:
        """Publish ``body`` (one signed report) to ``shard`` and return once the broker confirmed the
        message that carries it; raise what publishing it raised."""
        if not self.enabled:
            await self._publish(Outbound(body, message_id, shard, (message_id,)))
            return
        pending = self._pending.get(shard)
        if pending is not None and pending.size + batch.framed_bytes(len(body)) > self.max_bytes:
            self._flush(shard)  # full: this report starts the next one
        pending = self._pending.setdefault(shard, _Pending())
        sender: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        pending.bodies.append(body)
        pending.ids.append(message_id)
        pending.senders.append(sender)
        pending.size += batch.framed_bytes(len(body))
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._flush_all)
        await sender

    def _flush_all(self) -> None:
        self._scheduled = False
        for shard in list(self._pending):
            self._flush(shard)

    def _flush(self, shard: str) -> None:
        pending = self._pending.pop(shard)
        # a sender cancelled meanwhile (its worker stopping) waits for nothing: its report stays unsent
        # and its task unacked, so the broker delivers the task again
        live = [i for i, sender in enumerate(pending.senders) if not sender.done()]
        if not live:
            return
        bodies = [pending.bodies[i] for i in live]
        ids = tuple(pending.ids[i] for i in live)
        senders = [pending.senders[i] for i in live]
        if len(bodies) == 1:
            outbound = Outbound(bodies[0], ids[0], shard, ids)
        else:
            container = batch.pack(bodies, ids[0])
            outbound = Outbound(container.body, container.message_id, shard, ids, container.headers)
        task = asyncio.ensure_future(self._deliver(outbound, senders))
        self._publishing.add(task)
        task.add_done_callback(self._publishing.discard)

    async def _deliver(self, outbound: Outbound, senders: list[asyncio.Future[None]]) -> None:
        try:
            await self._publish(outbound)
        except BaseException as exc:  # every report in it shares the message's fate
            for sender in senders:
                if sender.done():
                    continue
                if isinstance(exc, Exception):
                    sender.set_exception(exc)
                else:  # cancelled (the loop is closing): so are they
                    sender.cancel()
            if not isinstance(exc, Exception):
                raise
            return
        for sender in senders:
            if not sender.done():
                sender.set_result(None)

"""Coalesced acknowledgements for a worker channel.

Tasks finish out of order, but acking each one is a socket write, and writes dominate a worker's CPU.
Delivery tags are per channel and increase, so once every delivery up to tag N is settled, one
``ack(multiple=True)`` on N settles them all. This tracks settled tags and acks the longest settled
prefix: in the same event-loop turn once ``prompt_at`` deliveries wait for their ack (a busy worker,
whose acks free its prefetch slots; the runtime makes it a quarter of the prefetch, so a worker with a
concurrency below 8 acks every turn), else ``linger_s`` later. A run's result reaches its shard as its
confirm reaches the worker, so an ack sent at once has the broker settle the task (a write to the quorum
queue's log) and wake again while the shard handles that result and dispatches what follows; a few
milliseconds later, it is off that path (``bench/ab_latency.py``, both orders: 0.1-0.5 ms a model-ingest
run, bench/README.md). A task is marked settled only after its result was confirmed, so the guarantee is
unchanged: nothing is acked before its result is safe. (An ack needs no confirm: were its write lost with
the connection, the broker would redeliver the task, and its result, already confirmed, would come back
to the shard as a recognised duplicate.)
"""

from __future__ import annotations

import asyncio
import heapq
import logging

from orchestrator.bus.inbound import Delivered

log = logging.getLogger(__name__)


LINGER_S = 0.005


class AckCoalescer:
    def __init__(self, prompt_at: int = 1, linger_s: float = LINGER_S) -> None:
        self.prompt_at = prompt_at
        self.linger_s = linger_s
        self._pending: list[int] = []  # delivered, not yet settled (heap of tags)
        self._settled: set[int] = set()
        self._ack_ready: dict[int, Delivered] = {}
        self._scheduled = False
        self._lingering: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Future[None]] = set()
        self._channel: object = None  # tags count per channel: a reopened channel starts again at 1

    def delivered(self, message: Delivered) -> None:
        channel = message.channel
        if channel is not self._channel:
            # The broker connection was re-established: deliveries of the old channel were requeued by
            # the broker and can no longer be acked; forget them, or their tags would block every ack.
            self._pending, self._settled, self._ack_ready = [], set(), {}
            self._channel = channel
        heapq.heappush(self._pending, message.delivery_tag or 0)

    def settled(self, message: Delivered, *, already_settled: bool = False) -> None:
        """The task's outcome is safe (result confirmed) or the message was nacked individually."""
        if message.channel is not self._channel or not message.settleable:
            return  # delivered on a channel that is gone: the broker redelivers it
        tag = message.delivery_tag or 0
        self._settled.add(tag)
        if not already_settled:
            self._ack_ready[tag] = message
        if self._scheduled:
            return
        loop = asyncio.get_running_loop()
        if len(self._ack_ready) >= self.prompt_at:
            self._scheduled = True
            if self._lingering is not None:
                self._lingering.cancel()
                self._lingering = None
            loop.call_soon(self._flush_soon)
        elif self._lingering is None:
            self._lingering = loop.call_later(self.linger_s, self._flush_soon)

    def _flush_soon(self) -> None:
        self._scheduled = False
        self._lingering = None
        task = asyncio.ensure_future(self.flush())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def flush(self) -> None:
        """Ack the longest settled prefix now (also called when the worker drains)."""
        if self._lingering is not None:
            self._lingering.cancel()
            self._lingering = None
        last: Delivered | None = None
        while self._pending and self._pending[0] in self._settled:
            tag = heapq.heappop(self._pending)
            self._settled.discard(tag)
            last = self._ack_ready.pop(tag, None) or last
        if last is not None and last.delivery_tag is not None:
            try:
                # queued, not waited for: aio-pika's ack waits for its own socket write and drain, so the
                # ack would leave alone; unwaited, it joins the turn's publishes in one write
                # on the channel it came on, if still open: a frame for a closed channel number would close
                # the connection, or settle the deliveries of a new channel given the same number
                channel = last.open_channel()
                await channel.basic_ack(delivery_tag=last.delivery_tag, multiple=True, wait=False)
            except Exception:  # the channel is gone: the broker requeues every unacked delivery
                log.warning("could not ack up to delivery %s; the broker will redeliver", last.delivery_tag)

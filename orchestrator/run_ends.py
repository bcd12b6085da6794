"""Waiting for runs to end without polling for it: a run's final transition announces its status on a
pub/sub channel (``store/keys.py``, ``finished_channel``; ``lua/helpers.lua``, ``announce``), and a
waiting client subscribes to it before it first reads the run.

A client keeps one subscription connection for all of its waits, and one task that reads it. The
announcement carries what a wait returns (the final state, output and reason), so the waiter need not
read the run again. It still reads the run now and then, for what an announcement cannot promise (a
subscription that was being restored while Redis restarted; a Redis Cluster, whose asyncio client has no
pub/sub, where nothing is announced and waits poll as before).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.client import PubSub

from orchestrator.store.connect import REDIS_ERRORS, is_cluster
from orchestrator.store.keys import finished_channel

log = logging.getLogger(__name__)

# A subscription's connection trouble: redis-py's errors, and uvloop's RuntimeError for a write on a
# transport the peer reset (asyncio's loop raises ConnectionResetError, which redis-py makes its own)
LOST: tuple[type[Exception], ...] = (*REDIS_ERRORS, OSError, RuntimeError)
READ_TIMEOUT_S = 1.0  # the reader's longest block: it notices being closed at least this often
RETRY_S = 0.5  # after the subscription's connection failed, before reading again


@dataclass(frozen=True)
class Ending:
    """A run's end as it was announced."""

    state: str
    output: Any = None
    reason: str | None = None


def parse_ending(data: object) -> Ending | None:
    """The ending an announcement carries; None for one that does not parse (then the waiter reads the
    run itself)."""
    try:
        fields = json.loads(data if isinstance(data, str | bytes) else "")
        output = fields.get("output")
        return Ending(str(fields["state"]), json.loads(output) if output else None, fields.get("reason"))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


@dataclass
class Watch:
    """One wait's view of its run's announcements: ``ended`` is set when one came (``ending`` holds it,
    if it parsed)."""

    ended: asyncio.Event = field(default_factory=asyncio.Event)
    ending: Ending | None = None


class RunEnds:
    def __init__(self, redis: aioredis.Redis, prefix: str) -> None:
        self._redis = redis
        self._prefix = prefix
        self.announced = not is_cluster(redis)
        self._pubsub: PubSub | None = None
        self._reader: asyncio.Task[None] | None = None
        self._waiting: dict[str, list[Watch]] = {}

    @contextlib.asynccontextmanager
    async def watching(self, run_id: str) -> AsyncIterator[Watch]:
        """What run ``run_id``'s end announces, once it does (never where nothing is announced). Enter it
        before reading the run: an end announced between the read and the wait is not lost."""
        watch = Watch()
        channel = finished_channel(self._prefix, run_id)
        if not self.announced:
            yield watch
            return
        waiters = self._waiting.setdefault(channel, [])
        waiters.append(watch)
        try:
            if len(waiters) == 1:
                await self._subscribe(channel)
            yield watch
        finally:
            waiters.remove(watch)
            if not waiters:
                del self._waiting[channel]
                if self._pubsub is not None:
                    with contextlib.suppress(*LOST):
                        await self._pubsub.unsubscribe(channel)

    async def _subscribe(self, channel: str) -> None:
        if self._pubsub is None:
            self._pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
        try:
            await self._pubsub.subscribe(channel)
        except LOST as exc:  # the waiter's own reads still see the end
            log.warning("could not subscribe to %s (%s); waiting by reading the run", channel, exc)
            return
        if self._reader is None:  # started once the subscription has its connection
            self._reader = asyncio.create_task(self._read(self._pubsub))

    async def _read(self, pubsub: PubSub) -> None:
        while True:
            try:
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=READ_TIMEOUT_S)
            except LOST as exc:  # redis-py subscribes again once it has reconnected
                log.debug("run-end subscription interrupted (%s); reading again", exc)
                await asyncio.sleep(RETRY_S)
                continue
            if message is not None and message.get("type") == "message":
                ending = parse_ending(message.get("data"))
                for watch in self._waiting.get(str(message["channel"]), ()):
                    watch.ending = ending
                    watch.ended.set()

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, *LOST):
                await self._reader
        if self._pubsub is not None:
            with contextlib.suppress(*LOST):
                await self._pubsub.aclose()  # type: ignore[no-untyped-call]

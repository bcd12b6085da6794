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
from redis.exceptions import ResponseError

from orchestrator.engine.model import TERMINAL_RUN_STATUSES
from orchestrator.store.connect import CLOSED_TRANSPORT, REDIS_ERRORS, announces_run_ends
from orchestrator.store.keys import REFUSED, finished_channel

log = logging.getLogger(__name__)

# A subscription's connection trouble: redis-py's errors, and uvloop's for a write on a reset transport
LOST: tuple[type[Exception], ...] = (*REDIS_ERRORS, OSError, CLOSED_TRANSPORT)
READ_TIMEOUT_S = 1.0  # the reader's longest block: it notices being closed at least this often
RETRY_S = 0.5  # after the subscription's connection failed, before reading again
READ_LOST: tuple[type[Exception], ...] = (*REDIS_ERRORS, OSError)  # a read on a lost connection
CONFIRM_TIMEOUT_S = 2.0  # a wait goes on by reading its run when its subscription is not confirmed by then
FINAL_STATES = frozenset({*(status.value for status in TERMINAL_RUN_STATUSES), REFUSED})


@dataclass(frozen=True)
class Ending:
    """A run's end as it was announced."""

    state: str
    output: Any = None
    reason: str | None = None


def parse_ending(data: object) -> Ending | None:
    """The ending an announcement carries; None for one that does not parse, names no final state or
    leaves a large output out (then the waiter reads the run itself)."""
    try:
        fields = json.loads(data if isinstance(data, str | bytes) else "")
        if fields.get("output_omitted") or fields["state"] not in FINAL_STATES:
            return None
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


@dataclass
class _Channel:
    """A run's channel while anyone waits on it: its watches, and whether Redis has confirmed the
    subscription (cleared when the connection is made again: redis-py subscribes anew)."""

    watches: list[Watch] = field(default_factory=list)
    confirmed: asyncio.Event = field(default_factory=asyncio.Event)


class RunEnds:
    def __init__(self, redis: aioredis.Redis, prefix: str) -> None:
        self._redis = redis
        self._prefix = prefix
        self.announced = announces_run_ends(redis)
        self._pubsub: PubSub | None = None
        self._reader: asyncio.Task[None] | None = None
        self._channels: dict[str, _Channel] = {}
        # one subscribe or unsubscribe at a time: redis-py's PubSub connects on its first command, and two
        # first commands at once would each take a connection of their own
        self._lock = asyncio.Lock()
        self._watching_connects = False

    @contextlib.asynccontextmanager
    async def watching(self, run_id: str) -> AsyncIterator[Watch]:
        """What run ``run_id``'s end announces, once it does (never where nothing is announced). Returns
        once Redis has confirmed the subscription (or after ``CONFIRM_TIMEOUT_S``, or at once if it
        cannot subscribe): a read of the run made after it sees an end that was not announced to it."""
        watch = Watch()
        name = finished_channel(self._prefix, run_id)
        if not self.announced:
            yield watch
            return
        channel = self._channels.setdefault(name, _Channel())
        channel.watches.append(watch)
        try:
            if not channel.confirmed.is_set():
                # every waiter of a channel not confirmed subscribes (Redis takes a repeated SUBSCRIBE
                # as one): a first waiter that gave up must not leave the others unsubscribed
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(CONFIRM_TIMEOUT_S):
                        if await self._subscribe(name):
                            await channel.confirmed.wait()
            yield watch
        finally:
            channel.watches.remove(watch)
            if not channel.watches:
                del self._channels[name]
                await self._unsubscribe(name)

    async def _subscribe(self, name: str) -> bool:
        """Send the subscription; False when it could not be sent (the waiter reads its run)."""
        async with self._lock:
            if self._pubsub is None:
                self._pubsub = self._redis.pubsub()
            try:
                await self._pubsub.subscribe(name)
            except LOST as exc:
                log.warning("could not subscribe to %s (%s); waiting by reading the run", name, exc)
                return False
            connection = self._pubsub.connection
            if connection is not None and not self._watching_connects:
                # redis-py subscribes again on every new connection (its own callback, registered first):
                # the subscriptions are to be confirmed anew
                connection.register_connect_callback(self._reconnected)
                self._watching_connects = True
            if self._reader is None:  # started once the subscription has its connection
                self._reader = asyncio.create_task(self._read(self._pubsub))
                self._reader.add_done_callback(self._reader_ended)
            return True

    async def _unsubscribe(self, name: str) -> None:
        async with self._lock:
            if name in self._channels:
                return  # a new waiter came meanwhile: its subscription stands
            pubsub = self._pubsub
            connection = pubsub.connection if pubsub is not None else None
            if pubsub is None or connection is None or not connection.is_connected:
                return  # nothing to leave (Redis gone: a new connection subscribes only what it still has)
            with contextlib.suppress(*LOST):
                await pubsub.unsubscribe(name)

    def _reconnected(self, connection: object) -> None:
        for channel in self._channels.values():
            channel.confirmed.clear()

    async def _read(self, pubsub: PubSub) -> None:
        while True:
            try:
                message = await pubsub.get_message(timeout=READ_TIMEOUT_S)
            except ResponseError as exc:  # a subscription refused (a user without channel rights)
                self._refused(exc)
                return
            except READ_LOST as exc:  # redis-py subscribes again once it has reconnected
                log.debug("run-end subscription interrupted (%s); reading again", exc)
                await asyncio.sleep(RETRY_S)
                continue
            if message is not None:
                await self._take(message)

    async def _take(self, message: dict[str, Any]) -> None:
        kind, name = message.get("type"), str(message.get("channel"))
        channel = self._channels.get(name)
        if channel is None:
            if kind in ("subscribe", "message"):  # subscribed again after a reconnect, its waiters gone
                await self._unsubscribe(name)
            return
        if kind == "subscribe":
            channel.confirmed.set()
        elif kind == "message":
            ending = parse_ending(message.get("data"))
            for watch in channel.watches:
                watch.ending = ending
                watch.ended.set()

    def _refused(self, exc: Exception) -> None:
        """Redis refused a subscription: from now on this client's waits read their runs, as where
        nothing is announced; those waiting go on at once."""
        log.warning("Redis refused the run-end subscription (%s); waits read their runs", exc)
        self.announced = False
        for channel in self._channels.values():
            channel.confirmed.set()

    def _reader_ended(self, reader: asyncio.Task[None]) -> None:
        """A reader that died of a surprise is logged, and the next subscription starts another."""
        self._reader = None
        if not reader.cancelled() and reader.exception() is not None:
            log.error("the run-end reader stopped; waits read their runs", exc_info=reader.exception())

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, *LOST):
                await self._reader
        if self._pubsub is not None:
            with contextlib.suppress(*LOST):
                await self._pubsub.aclose()  # type: ignore[no-untyped-call]

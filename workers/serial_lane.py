"""The serial lane: one task of ``tasks.serial`` runs at a time, across every run, contract and worker.

Serial tasks wait in one queue per contract version like every other task (so they reach only workers
that serve them), and workers of different contracts consume those queues side by side. What keeps them
one at a time is a lease in Redis, taken before a serial handler starts and given back only when the
handler has *returned*: a thread-pool handler still running after its attempt was cancelled or timed out
keeps the lane until its thread ends, so the next serial task never overlaps it.

The lease is a key set with ``SET NX PX`` to a token naming the holder, renewed every third of its
lifetime while the handler runs and deleted only by the token that holds it. A worker that dies holding
it gives it back when the lease expires (``SAGA_SERIAL_LEASE_MS``); until then serial tasks wait. The one
way two serial handlers can overlap is a holder that cannot renew (cut off from Redis) for longer than the
lease while its handler keeps running: that is logged as an error on the holder.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisClusterException, RedisError

from orchestrator.store.connect import async_client

log = logging.getLogger(__name__)

# Taking it again with our own token succeeds: a retry after a lost reply must not wait out our own lease
_ACQUIRE = (
    "if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end "
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return 1 end return 0"
)
_RENEW = (
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end "
    "return 0"
)
_RELEASE = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
# RedisClusterException: a cluster client that cannot map a slot to a node (mid-failover) is not a RedisError
REDIS_TROUBLE = (RedisError, RedisClusterException, OSError, TimeoutError)


def lane_key(prefix: str) -> str:
    """One key per namespace (its own hash tag: a single key needs no slot company)."""
    return f"{prefix}:{{serial}}:lane"


def holder_of(token: str | None) -> dict[str, Any] | None:
    """Who holds the lane, as its token says (``None``: nobody, or not a token this code wrote)."""
    if not token:
        return None
    try:
        holder = json.loads(token)
    except ValueError:
        return None
    return holder if isinstance(holder, dict) else None


@dataclass
class Lease:
    """The lane, held. Renewed in the background until :meth:`release`."""

    lane: SerialLane
    token: str
    renewing: asyncio.Task[None] | None = None

    async def release(self) -> None:
        if self.renewing is not None:
            self.renewing.cancel()
        # Not released, the lane stays taken until the lease expires: keep trying until then, so the next
        # serial task need not wait that long (and a stopping worker is not held up for longer)
        deadline = time.monotonic() + self.lane.lease_ms / 1000
        while True:
            try:
                await self.lane.redis.eval(_RELEASE, 1, self.lane.key, self.token)  # type: ignore[misc]
                return
            except REDIS_TROUBLE as exc:
                if time.monotonic() >= deadline:
                    log.warning("could not give the serial lane back (%s); its lease expires instead", exc)
                    return
                await asyncio.sleep(self.lane.retry_s)


@dataclass
class SerialLane:
    redis: aioredis.Redis
    key: str
    lease_ms: int = 15_000
    poll_s: float = 0.02
    retry_s: float = 0.5
    worker: str = field(default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}")
    clock_ms: Callable[[], int] = field(default=lambda: int(time.time() * 1000))

    async def take(self, task: dict[str, Any], give_up: asyncio.Event) -> Lease | None:
        """Wait for the lane and hold it for ``task`` (run, stage, contract...: shown to whoever asks who
        holds it). Returns None without the lane once ``give_up`` is set (the attempt was cancelled, or the
        worker is stopping). Redis trouble means waiting, never running without the lane."""
        token = json.dumps(
            {"worker": self.worker, "token": uuid.uuid4().hex, "since_ms": self.clock_ms(), **task},
            sort_keys=True,
        )
        while not give_up.is_set():
            try:
                taken = await self.redis.eval(_ACQUIRE, 1, self.key, token, self.lease_ms)  # type: ignore[misc]
            except REDIS_TROUBLE as exc:
                log.warning("serial lane: Redis trouble (%s); the serial task waits", exc)
                taken, pause = 0, self.retry_s
            else:
                pause = self.poll_s
            if taken:
                lease = Lease(self, token)
                lease.renewing = asyncio.create_task(self._renew(token))
                return lease
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(give_up.wait(), pause)
        return None

    async def holder(self) -> dict[str, Any] | None:
        return holder_of(await self.redis.get(self.key))

    async def _renew(self, token: str) -> None:
        """Every third of the lease; after a failure, again every ``retry_s`` until the lease would have
        expired (a Redis client timeout well under a third of the lease keeps one slow reply from eating
        the margin: see ``lane_client``)."""
        kept_until = time.monotonic() + self.lease_ms / 1000
        pause = self.lease_ms / 3000
        while True:
            await asyncio.sleep(pause)
            try:
                kept = await self.redis.eval(_RENEW, 1, self.key, token, self.lease_ms)  # type: ignore[misc]
            except REDIS_TROUBLE as exc:
                if time.monotonic() < kept_until:
                    log.warning("serial lane: could not renew the lease (%s); retrying", exc)
                    pause = self.retry_s
                    continue
                kept = 0
            if not kept:
                log.error(
                    "serial lane: the lease expired while its handler still runs (Redis out of reach, or "
                    "the event loop blocked, for longer than SAGA_SERIAL_LEASE_MS=%d); another serial task "
                    "may overlap this one",
                    self.lease_ms,
                )
                return
            kept_until = time.monotonic() + self.lease_ms / 1000
            pause = self.lease_ms / 3000


def lane_client(redis_url: str, lease_ms: int, timeout_s: float) -> aioredis.Redis:
    """A Redis client for the lane whose replies time out well within a renewal period, so that a renewal
    stuck on a dead connection leaves time for retries before the lease expires."""
    timeout = min(timeout_s, lease_ms / 6000)
    return async_client(
        redis_url,
        decode_responses=True,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        socket_keepalive=True,
    )

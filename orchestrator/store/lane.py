"""Round trips on connections the store holds, for a shard's hot path against one Redis server.

A redis-py pipeline takes a connection from the pool, checks it (a non-blocking read), records pool
metrics, wraps the call in its retry policy and gives the connection back, every time: about 50 µs of
CPU before a command is sent, measured at twice a bare send-and-read of the same command. A shard makes
a few round trips per batch (its transitions, the runs it reads, the outbox entries it marks sent), and
with one message per batch (a quiet system) that overhead sits on every transition's path.

The lane takes connections from the client's pool once and keeps them: the pool still counts them, and
closing the client closes them. Each concurrent caller has one of its own (no await between taking and
giving back). A connection that fails (on either event loop, ``orchestrator/loops.py``) is dropped; the
whole round trip is then sent once more on a new one, as redis-py's retry does: what the store sends
this way is safe to send twice (a transition applied before its reply was lost is refused the second
time, reads and marks change nothing again). A Redis Cluster has no lane (its client routes each command
to its slot's node): there the store pipelines.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from orchestrator.store.connect import CLOSED_TRANSPORT

Command = tuple[Any, ...]


class Lane:
    def __init__(self, client: aioredis.Redis) -> None:
        self._pool = client.connection_pool
        self._callbacks = client.response_callbacks
        self._free: list[AbstractConnection] = []

    async def execute(self, commands: Sequence[Command]) -> list[Any]:
        """Every command's reply, in order, each as redis-py's client parses it; a command Redis refused
        gives its ``ResponseError`` as its reply (a pipeline's ``raise_on_error=False``)."""
        try:
            return await self._once(commands)
        except (RedisConnectionError, RedisTimeoutError):
            return await self._once(commands)  # the connection was dropped: a new one, once

    async def _once(self, commands: Sequence[Command]) -> list[Any]:
        connection = self._free.pop() if self._free else await self._pool.get_connection()  # type: ignore[no-untyped-call]
        try:
            await self._send(connection, commands)
            replies = [await self._reply(connection, command) for command in commands]
        except BaseException:
            # a reply may still be on its way: the connection's stream is in no known state
            await connection.disconnect(nowait=True)
            self._free.append(connection)  # it reconnects on its next send
            raise
        self._free.append(connection)
        return replies

    @staticmethod
    async def _send(connection: AbstractConnection, commands: Sequence[Command]) -> None:
        try:
            await connection.send_packed_command(connection.pack_commands(commands), check_health=False)
        except CLOSED_TRANSPORT as exc:  # uvloop's word for a reset connection: replaced the same way
            raise RedisConnectionError(f"Redis connection lost: {exc}") from exc

    async def _reply(self, connection: AbstractConnection, command: Command) -> Any:
        try:
            reply = await connection.read_response()
        except ResponseError as refused:  # the stream is intact: the next reply follows
            return refused
        parse = self._callbacks.get(str(command[0]).upper())
        return parse(reply) if parse is not None else reply

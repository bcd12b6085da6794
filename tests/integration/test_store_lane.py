"""The store's lane (``orchestrator/store/lane.py``) against the real Redis: its replies are a pipeline's,
a connection Redis dropped or a reset cut is replaced within the call (on either event loop), a call
cancelled mid-reply leaves no reply behind for the next one, and closing the client closes the lane's
connections.

Every test works under a key prefix of its own and deletes its keys afterwards.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from urllib.parse import urlsplit

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from orchestrator import loops
from orchestrator.loops import EventLoopChoice
from orchestrator.store.lane import Lane
from orchestrator.store.redis_store import RedisStore
from tests.faults.proxy import FaultProxy

pytestmark = pytest.mark.services

REDIS_URL = os.environ.get("SAGA_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def with_client(test: Callable[[aioredis.Redis, str], Awaitable[None]]) -> None:
    async def main() -> None:
        client = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
        prefix = f"tlane{uuid.uuid4().hex}"
        try:
            await test(client, prefix)
        finally:
            async for key in _keys(client, prefix):
                await client.delete(key)
            await client.aclose()

    asyncio.run(main())


async def _keys(client: aioredis.Redis, prefix: str) -> AsyncIterator[str]:
    async for key in client.scan_iter(match=f"{prefix}:*"):
        yield key


def test_replies_are_what_a_pipeline_gives_refusals_included() -> None:
    async def test(client: aioredis.Redis, prefix: str) -> None:
        await client.hset(f"{prefix}:h", mapping={"a": "1", "b": "2"})
        commands = [
            ("HGETALL", f"{prefix}:h"),
            ("HGETALL", f"{prefix}:missing"),
            ("SET", f"{prefix}:s", "x", "NX"),
            ("SET", f"{prefix}:s", "y", "NX"),
            ("INCR", f"{prefix}:h"),  # WRONGTYPE: refused, the replies after it still come
            ("HDEL", f"{prefix}:h", "a", "zz"),
            ("FCALL", "no_such_function_here", 0),
        ]
        lane = await Lane(client).execute(commands)
        async with client.pipeline(transaction=False) as pipe:
            for command in commands:
                pipe.execute_command(*command)
            await client.hset(f"{prefix}:h", "a", "1")  # undo the lane's HDEL
            await client.delete(f"{prefix}:s")
            piped = await pipe.execute(raise_on_error=False)
        assert lane[:2] == piped[:2] == [{"a": "1", "b": "2"}, {}]
        assert lane[2:4] == piped[2:4] == [True, None]
        assert isinstance(lane[4], ResponseError) and "WRONGTYPE" in str(lane[4])
        assert lane[5] == piped[5] == 1
        assert isinstance(lane[6], ResponseError) and "function not found" in str(lane[6]).lower()

    with_client(test)


def test_a_connection_redis_dropped_is_replaced_within_the_call() -> None:
    async def test(client: aioredis.Redis, prefix: str) -> None:
        lane = Lane(client)
        await client.set(f"{prefix}:k", "v")
        ((mine,),) = [await lane.execute([("CLIENT", "ID")])]
        assert await client.client_kill_filter(_id=mine) == 1
        assert await lane.execute([("GET", f"{prefix}:k")]) == ["v"]
        ((again,),) = [await lane.execute([("CLIENT", "ID")])]
        assert again != mine  # a new connection took the dropped one's place

    with_client(test)


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_connection_reset_under_it_is_replaced_within_the_call(loop: EventLoopChoice) -> None:
    """A reset (RST, as a failing proxy or host gives it, not Redis's own close) makes uvloop refuse the
    next write with a RuntimeError: it must count as a lost connection, not as a failure of the call."""
    upstream = urlsplit(REDIS_URL)

    async def main(proxy: FaultProxy) -> None:
        client = aioredis.Redis.from_url(proxy.redis_url(), decode_responses=True)
        lane = Lane(client)
        try:
            ((mine,),) = [await lane.execute([("CLIENT", "ID")])]
            proxy.reset()  # every connection through the proxy gets an RST
            proxy.set_pass()
            await asyncio.sleep(0.1)  # the RST has arrived: the lane's connection is closed now
            ((again,),) = [await lane.execute([("CLIENT", "ID")])]
            assert again != mine
        finally:
            await client.aclose()

    with FaultProxy(upstream.hostname or "127.0.0.1", upstream.port or 6379) as proxy:
        loops.run(main(proxy), loops.loop_factory(loop))


def test_a_call_cancelled_mid_reply_leaves_nothing_for_the_next_one() -> None:
    async def test(client: aioredis.Redis, prefix: str) -> None:
        lane = Lane(client)
        await client.set(f"{prefix}:k", "v")
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.1):  # as a shard bounds each Redis step
                await lane.execute([("BLPOP", f"{prefix}:empty", "0.5")])
        # the BLPOP's reply (nil, half a second later) must not be taken for the GET's
        assert await lane.execute([("GET", f"{prefix}:k")]) == ["v"]
        await asyncio.sleep(0.6)
        assert await lane.execute([("GET", f"{prefix}:k"), ("GET", f"{prefix}:nope")]) == ["v", None]

    with_client(test)


def test_concurrent_callers_each_get_their_own_replies() -> None:
    async def test(client: aioredis.Redis, prefix: str) -> None:
        lane = Lane(client)
        await client.mset({f"{prefix}:{i}": str(i) for i in range(50)})

        async def read(i: int) -> list[str]:
            replies = await lane.execute([("GET", f"{prefix}:{i}"), ("GET", f"{prefix}:{(i + 1) % 50}")])
            return [str(r) for r in replies]

        got = await asyncio.gather(*(read(i % 50) for i in range(400)))
        assert got == [[str(i % 50), str((i + 1) % 50)] for i in range(400)]

    with_client(test)


def test_closing_the_client_closes_the_lanes_connections() -> None:
    async def main() -> None:
        client = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
        watcher = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
        try:
            store = RedisStore(client, prefix=f"tlane{uuid.uuid4().hex}", direct=True)
            assert store.direct
            ((mine,),) = [await Lane(client).execute([("CLIENT", "ID")])]
            ids = {int(c["id"]) for c in await watcher.client_list()}
            assert mine in ids
            await client.aclose()
            await asyncio.sleep(0.05)
            assert mine not in {int(c["id"]) for c in await watcher.client_list()}
        finally:
            await watcher.aclose()

    asyncio.run(main())

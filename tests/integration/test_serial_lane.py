"""The serial lane on the real Redis: one holder at a time, given back only by its holder, renewed while
held, and freed by expiry when a holder dies without giving it back."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable

import pytest
import redis.asyncio as aioredis

from workers.serial_lane import SerialLane, lane_key

pytestmark = pytest.mark.services


def on_a_lane(scenario: Callable[[SerialLane], Awaitable[None]]) -> None:
    """Run ``scenario`` on a lane of its own (a 1 s lease) on the machine's Redis; delete it after."""

    async def go() -> None:
        client = aioredis.Redis.from_url("redis://127.0.0.1:6379/0", decode_responses=True)
        key = lane_key(f"sagatest{uuid.uuid4().hex[:8]}")
        try:
            await scenario(SerialLane(client, key, lease_ms=1_000, poll_s=0.01))
        finally:
            await client.delete(key)
            await client.aclose()

    asyncio.run(go())


def other(lane: SerialLane) -> SerialLane:
    """Another worker process's view of the same lane."""
    return SerialLane(lane.redis, lane.key, lane.lease_ms, lane.poll_s, worker="other:2")


def test_one_holder_at_a_time_and_the_next_waits_for_the_release() -> None:
    async def scenario(lane: SerialLane) -> None:
        first = await lane.take({"run_id": "r1", "stage": "s"}, asyncio.Event())
        assert first is not None
        holder = await lane.holder()
        assert holder is not None and (holder["run_id"], holder["worker"]) == ("r1", lane.worker)

        waiting = asyncio.create_task(other(lane).take({"run_id": "r2"}, asyncio.Event()))
        await asyncio.sleep(0.2)
        assert not waiting.done()  # held: the second waits

        await first.release()
        second = await asyncio.wait_for(waiting, 2)
        assert second is not None and (await lane.holder() or {}).get("run_id") == "r2"
        await second.release()
        assert await lane.holder() is None

    on_a_lane(scenario)


def test_a_lease_is_renewed_while_held() -> None:
    async def scenario(lane: SerialLane) -> None:
        held = await lane.take({"run_id": "r1"}, asyncio.Event())
        assert held is not None
        await asyncio.sleep(2.5)  # two and a half lease lifetimes
        assert (await lane.holder() or {}).get("run_id") == "r1"
        await held.release()

    on_a_lane(scenario)


def test_a_holder_that_dies_frees_the_lane_when_its_lease_expires() -> None:
    async def scenario(lane: SerialLane) -> None:
        dead = await lane.take({"run_id": "r1"}, asyncio.Event())
        assert dead is not None and dead.renewing is not None
        dead.renewing.cancel()  # the process is gone: nobody renews, nobody releases
        began = time.monotonic()
        taken = await asyncio.wait_for(other(lane).take({"run_id": "r2"}, asyncio.Event()), 5)
        assert taken is not None and 0.5 < time.monotonic() - began < 3
        await dead.release()  # a late release by the dead holder's token leaves the new holder alone
        assert (await lane.holder() or {}).get("run_id") == "r2"
        await taken.release()

    on_a_lane(scenario)


def test_giving_up_returns_without_the_lane() -> None:
    async def scenario(lane: SerialLane) -> None:
        held = await lane.take({"run_id": "r1"}, asyncio.Event())
        assert held is not None
        give_up = asyncio.Event()
        waiting = asyncio.create_task(other(lane).take({"run_id": "r2"}, give_up))
        await asyncio.sleep(0.1)
        give_up.set()  # the attempt was cancelled while it waited
        assert await asyncio.wait_for(waiting, 2) is None
        assert (await lane.holder() or {}).get("run_id") == "r1"
        await held.release()

    on_a_lane(scenario)

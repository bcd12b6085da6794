"""A shard's wait for its next delivery (``ShardService._next``) loses nothing and takes nothing twice, even
when a delivery lands in the very loop turn its wait times out, and a shard stopped while it waits leaves
the deliveries that come after in the inbox (unacked, they go back to the queue with the channel).

Its wait is a timer on the shard's own task (``asyncio.timeout``): a timeout that fires after the inbox
woke the waiting ``get`` cancels that ``get``, which must leave the item for the next call. Stand-in
deliveries: ``_next`` only moves them from the inbox into a batch."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from orchestrator.bus.envelope import Signer
from orchestrator.settings import DEVELOPMENT_SIGNING_KEY
from orchestrator.shard.service import ShardOptions, ShardService

SIGNER = Signer.from_settings((DEVELOPMENT_SIGNING_KEY,))
TIMEOUT_S = 0.001
# when each delivery is put, against the wait's timeout: before it, in the same turn, just after it
OFFSETS_S = (0.0, TIMEOUT_S * 0.9, TIMEOUT_S, TIMEOUT_S * 1.1, TIMEOUT_S * 2)


def service(batch_max: int = 64) -> ShardService:
    store = SimpleNamespace(client=None, prefix="t")  # kept by the processor; nothing here reaches Redis
    return ShardService(None, store, SIGNER, ["fast.0"], ShardOptions(batch_max=batch_max))  # type: ignore[arg-type]


async def take_all(shard: ShardService, deliveries: int) -> tuple[list[Any], list[Any], int]:
    """Put ``deliveries`` items, each at an offset around a wait's timeout, waiting for each with
    ``_next``; then drain what is left. Returns the order they were delivered in, the order they were
    taken in, and how many waits timed out."""
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue[Any] = asyncio.Queue()
    delivered: list[Any] = []
    taken: list[Any] = []
    timeouts = 0

    def deliver(n: int) -> None:
        delivered.append(n)
        inbox.put_nowait(n)

    for n in range(deliveries):
        loop.call_later(OFFSETS_S[n % len(OFFSETS_S)], deliver, n)
        batch, due = await shard._next(inbox, TIMEOUT_S)
        assert due is None
        taken += batch
        timeouts += not batch
    await asyncio.sleep(TIMEOUT_S * 3)  # the last puts land
    while not inbox.empty():
        batch, _ = await shard._next(inbox, TIMEOUT_S)
        taken += batch
    return delivered, taken, timeouts


def test_a_delivery_landing_as_the_wait_times_out_is_taken_once_in_delivery_order() -> None:
    delivered, taken, timeouts = asyncio.run(take_all(service(), 500))
    assert sorted(delivered) == list(range(500))
    assert taken == delivered  # each once, in the order delivered
    assert timeouts > 0  # the race was there to lose: some waits did time out with a delivery on its way


def test_a_batch_stops_at_batch_max_and_the_rest_waits_for_the_next() -> None:
    async def scenario() -> tuple[list[Any], list[Any]]:
        inbox: asyncio.Queue[Any] = asyncio.Queue()
        for n in range(5):
            inbox.put_nowait(n)
        shard = service(batch_max=3)
        (first, _), (second, _) = await shard._next(inbox, TIMEOUT_S), await shard._next(inbox, TIMEOUT_S)
        return first, second

    assert asyncio.run(scenario()) == ([0, 1, 2], [3, 4])


def test_a_shard_stopped_while_it_waits_is_cancelled_and_leaves_later_deliveries_in_the_inbox() -> None:
    async def scenario() -> list[Any]:
        inbox: asyncio.Queue[Any] = asyncio.Queue()
        waiting = asyncio.create_task(service()._next(inbox, 60.0))
        await asyncio.sleep(0)
        waiting.cancel()
        inbox.put_nowait("after")  # the same turn as the cancel
        with pytest.raises(asyncio.CancelledError):
            await waiting  # a stop, not a timeout: the shard's loop ends
        return [inbox.get_nowait() for _ in range(inbox.qsize())]

    assert asyncio.run(scenario()) == ["after"]

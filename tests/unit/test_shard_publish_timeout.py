"""A batch's publishes that the broker never confirms do not hold the shard's loop
(orchestrator/shard/service.py, ``ShardOptions.publish_timeout_s``): after the bound, the shard marks
sent only what it applied itself and goes on; the unconfirmed entries stay in the outbox for the relay.
Stand-in store and publisher: what is tested is the service's own bookkeeping."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from orchestrator.bus.envelope import Signer
from orchestrator.settings import DEVELOPMENT_SIGNING_KEY
from orchestrator.shard.service import ShardOptions, ShardService
from orchestrator.wire.outgoing import Outgoing

SIGNER = Signer.from_settings((DEVELOPMENT_SIGNING_KEY,))


@dataclass
class MarkingStore:
    marked: list[list[str]] = field(default_factory=list)
    client: Any = None  # the processor keeps it; nothing here reaches Redis
    prefix: str = "t"

    async def mark_sent(self, shard: str, message_ids: list[str]) -> None:
        self.marked.append(list(message_ids))


class SilentBroker:
    """A publisher whose confirms never come (a channel lost while the connection came back)."""

    async def publish_all(self, outgoing: list[Outgoing], now_ms: int) -> list[str]:
        await asyncio.Event().wait()
        return [m.message_id for m in outgoing]


class ConfirmingBroker:
    async def publish_all(self, outgoing: list[Outgoing], now_ms: int) -> list[str]:
        return [m.message_id for m in outgoing]


def task(n: int) -> Outgoing:
    return Outgoing(f"task-{n}", "task", ("task", "tasks.parallel"), {"contract": "cache.lookup@1"})


def settle(publisher: object, timeout_s: float) -> list[list[str]]:
    store = MarkingStore()
    options = ShardOptions(publish_timeout_s=timeout_s)
    service = ShardService(None, store, SIGNER, ["fast.0"], options)  # type: ignore[arg-type]

    async def run() -> None:
        # bounded here too: a shard that waited for ever would fail the test instead of hanging it
        async with asyncio.timeout(5):
            await service._publish_and_mark("fast.0", publisher, [task(1), task(2)], ["release-1"])  # type: ignore[arg-type]

    asyncio.run(run())
    return store.marked


def test_unconfirmed_publishes_are_left_to_the_relay_and_the_shard_goes_on() -> None:
    # Given a broker that never confirms, when a batch's publishes have waited past the bound
    marked = settle(SilentBroker(), timeout_s=0.05)
    # Then only what the shard applied itself is marked sent: the tasks stay in the outbox
    assert marked == [["release-1"]]


def test_confirmed_publishes_are_marked_sent() -> None:
    assert settle(ConfirmingBroker(), timeout_s=0.05) == [["task-1", "task-2", "release-1"]]

"""The worker's coalesced acks: only a settled prefix is acked, once per loop turn, per channel."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from workers.acks import AckCoalescer


@dataclass
class FakeMessage:
    delivery_tag: int
    channel: object
    acks: list[tuple[int, bool]] = field(default_factory=list)

    async def ack(self, multiple: bool = False) -> None:
        self.acks.append((self.delivery_tag, multiple))


def run(steps: Any) -> None:
    asyncio.run(steps())


def test_only_the_settled_prefix_is_acked_with_one_multiple_ack() -> None:
    log: list[tuple[int, bool]] = []
    channel = object()
    messages = [FakeMessage(tag, channel, log) for tag in (1, 2, 3, 4)]

    async def steps() -> None:
        acks = AckCoalescer()
        for m in messages:
            acks.delivered(m)  # type: ignore[arg-type]
        acks.settled(messages[1])  # type: ignore[arg-type]
        acks.settled(messages[2])  # type: ignore[arg-type]
        await asyncio.sleep(0.01)
        assert log == []  # 1 is still in flight: nothing may be acked
        acks.settled(messages[0])  # type: ignore[arg-type]
        await asyncio.sleep(0.01)
        assert log == [(3, True)]  # one write settles 1, 2 and 3
        acks.settled(messages[3])  # type: ignore[arg-type]
        await acks.flush()

    run(steps)
    assert log == [(3, True), (4, True)]


def test_a_nacked_delivery_counts_as_settled_but_is_not_acked_itself() -> None:
    log: list[tuple[int, bool]] = []
    channel = object()
    messages = [FakeMessage(tag, channel, log) for tag in (1, 2)]

    async def steps() -> None:
        acks = AckCoalescer()
        for m in messages:
            acks.delivered(m)  # type: ignore[arg-type]
        acks.settled(messages[0], already_settled=True)  # type: ignore[arg-type]
        acks.settled(messages[1])  # type: ignore[arg-type]
        await acks.flush()

    run(steps)
    assert log == [(2, True)]


def test_a_new_channel_forgets_the_old_ones_tags() -> None:
    stuck = FakeMessage(7, object())
    fresh = FakeMessage(1, object())  # the connection dropped; the broker redelivers on a new channel

    async def steps() -> None:
        acks = AckCoalescer()
        acks.delivered(stuck)  # type: ignore[arg-type]
        acks.delivered(fresh)  # type: ignore[arg-type]
        acks.settled(stuck)  # type: ignore[arg-type]  # its task finished late: ignored
        acks.settled(fresh)  # type: ignore[arg-type]
        await acks.flush()

    run(steps)
    assert stuck.acks == []  # nothing acked on the dead channel
    assert fresh.acks == [(1, True)]  # and the old tag 7 does not block the new channel

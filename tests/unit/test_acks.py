"""The worker's coalesced acks: only a settled prefix is acked, per channel; at once when enough wait for
it, else a moment later, off the path of the run's next message."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from orchestrator.bus.inbound import Delivered
from workers.acks import AckCoalescer


@dataclass
class FakeChannel:
    """The AMQP channel a delivery came on: records the acks written to it."""

    acks: list[tuple[int, bool]] = field(default_factory=list)
    is_closed: bool = False

    async def basic_ack(self, delivery_tag: int, multiple: bool = False, wait: bool = True) -> None:
        assert not wait, "a coalesced ack is queued, not waited for (it joins the turn's other frames)"
        self.acks.append((delivery_tag, multiple))


def delivery(tag: int, channel: FakeChannel) -> Delivered:
    """A real delivery (its own settling rules) on a stand-in channel."""
    return Delivered(b"", None, f"task-{tag}", tag, channel)  # type: ignore[arg-type]  # acks and state only


def run(steps: Any) -> None:
    asyncio.run(steps())


def test_only_the_settled_prefix_is_acked_with_one_multiple_ack() -> None:
    channel = FakeChannel()
    log = channel.acks
    messages = [delivery(tag, channel) for tag in (1, 2, 3, 4)]

    async def steps() -> None:
        acks = AckCoalescer()
        for m in messages:
            acks.delivered(m)
        acks.settled(messages[1])
        acks.settled(messages[2])
        await asyncio.sleep(0.01)
        assert log == []  # 1 is still in flight: nothing may be acked
        acks.settled(messages[0])
        await asyncio.sleep(0.01)
        assert log == [(3, True)]  # one write settles 1, 2 and 3
        acks.settled(messages[3])
        await acks.flush()

    run(steps)
    assert log == [(3, True), (4, True)]


def test_a_nacked_delivery_counts_as_settled_but_is_not_acked_itself() -> None:
    channel = FakeChannel()
    log = channel.acks
    messages = [delivery(tag, channel) for tag in (1, 2)]

    async def steps() -> None:
        acks = AckCoalescer()
        for m in messages:
            acks.delivered(m)
        acks.settled(messages[0], already_settled=True)
        acks.settled(messages[1])
        await acks.flush()

    run(steps)
    assert log == [(2, True)]


def test_a_new_channel_forgets_the_old_ones_tags() -> None:
    stuck = delivery(7, FakeChannel())
    fresh = delivery(1, FakeChannel())  # the connection dropped; the broker redelivers on a new channel

    async def steps() -> None:
        acks = AckCoalescer()
        acks.delivered(stuck)
        acks.delivered(fresh)
        acks.settled(stuck)  # its task finished late: ignored
        acks.settled(fresh)
        await acks.flush()

    run(steps)
    assert stuck.channel.acks == []  # nothing acked on the dead channel
    assert fresh.channel.acks == [(1, True)]  # and the old tag 7 does not block the new channel


def test_nothing_is_acked_on_a_channel_that_closed_before_a_new_one_delivered() -> None:
    """The channel closed (its connection dropped, or the broker closed it) and no delivery came on a
    new one yet: tasks that finish now are not acked on it (a frame for a closed channel's number would
    close the connection, or settle another channel's deliveries); the broker redelivers them."""
    channel = FakeChannel()
    messages = [delivery(tag, channel) for tag in (1, 2, 3)]

    async def steps() -> None:
        acks = AckCoalescer()
        for m in messages:
            acks.delivered(m)
        acks.settled(messages[0])
        channel.is_closed = True  # before the turn's flush
        acks.settled(messages[1])
        await acks.flush()
        acks.settled(messages[2])
        await acks.flush()

    run(steps)
    assert channel.acks == []


def _lone(settle_then: Any) -> list[tuple[int, bool]]:
    """The acks written for one delivery settled on a coalescer that would ack it 0.2 s later, after
    ``settle_then(acks)``, then after half a second more."""
    channel = FakeChannel()
    message = delivery(1, channel)

    async def steps() -> None:
        acks = AckCoalescer(prompt_at=4, linger_s=0.2)
        acks.delivered(message)
        acks.settled(message)
        await settle_then(acks, channel)
        await asyncio.sleep(0.5)

    run(steps)
    return channel.acks


def test_a_lone_settled_delivery_is_acked_a_moment_later_not_in_its_own_turn() -> None:
    async def early(acks: AckCoalescer, channel: FakeChannel) -> None:
        for _ in range(3):
            await asyncio.sleep(0)
        assert channel.acks == []  # lingering

    assert _lone(early) == [(1, True)]


def test_a_drain_acks_at_once_and_drops_the_linger() -> None:
    async def drained(acks: AckCoalescer, channel: FakeChannel) -> None:
        await acks.flush()
        assert channel.acks == [(1, True)]

    assert _lone(drained) == [(1, True)]  # nothing more when the dropped linger would have fired


def test_enough_settled_deliveries_are_acked_in_their_turn_and_the_linger_is_dropped() -> None:
    channel = FakeChannel()
    messages = [delivery(tag, channel) for tag in (1, 2, 3)]

    async def steps() -> None:
        acks = AckCoalescer(prompt_at=3, linger_s=0.2)
        for m in messages:
            acks.delivered(m)
        acks.settled(messages[0])  # lingers
        acks.settled(messages[1])
        acks.settled(messages[2])  # the third: acked at once
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert channel.acks == [(3, True)]
        await asyncio.sleep(0.5)
        assert channel.acks == [(3, True)]  # nothing more when the dropped linger would have fired

    run(steps)

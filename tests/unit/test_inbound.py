"""A shard's deliveries taken straight from aiormq: what they read of a message, and where they settle."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiormq.abc import DeliveredMessage
from aiormq.exceptions import ChannelInvalidStateError
from pamqp import commands as spec
from pamqp.header import ContentHeader

from orchestrator.bus.inbound import Delivered
from orchestrator.wire.bodies import MAX_ACCEPT_AFTER_MS, TaskBody


@dataclass
class FakeChannel:
    is_closed: bool = False
    settled: list[tuple[str, int, bool]] = field(default_factory=list)

    async def basic_ack(self, delivery_tag: int, multiple: bool = False, wait: bool = True) -> None:
        self.settled.append(("ack", delivery_tag, multiple))

    async def basic_nack(self, delivery_tag: int, multiple: bool = False, requeue: bool = True) -> None:
        self.settled.append(("requeue" if requeue else "dead-letter", delivery_tag, multiple))


def delivered(channel: FakeChannel) -> Delivered:
    header = ContentHeader(
        properties=spec.Basic.Properties(message_id="result-1", headers={"x-delivery-count": 2}),
        body_size=4,
    )
    deliver = spec.Basic.Deliver(consumer_tag="c", delivery_tag=7, exchange="x", routing_key="fast.0")
    return Delivered.of(DeliveredMessage(deliver, header, b"body", channel))  # type: ignore[arg-type]


def test_a_delivery_reads_its_body_headers_id_and_tag() -> None:
    message = delivered(FakeChannel())
    assert (message.body, message.message_id, message.delivery_tag) == (b"body", "result-1", 7)
    assert message.headers == {"x-delivery-count": 2}


def test_a_delivery_settles_on_its_own_open_channel() -> None:
    channel = FakeChannel()
    asyncio.run(delivered(channel).ack())
    asyncio.run(delivered(channel).nack(requeue=False))
    assert channel.settled == [("ack", 7, False), ("dead-letter", 7, False)]


def test_a_delivery_whose_channel_closed_is_not_settled_on_whatever_took_its_number() -> None:
    channel = FakeChannel(is_closed=True)
    message = delivered(channel)
    for settle in (message.ack, message.nack):
        with pytest.raises(ChannelInvalidStateError):
            asyncio.run(settle())
    assert channel.settled == []


@pytest.mark.parametrize(
    ("report", "after"),
    [
        ({"accept": True}, 0),
        ({"accept": True, "accept_after_ms": 50}, 50),
        ({"accept": True, "accept_after_ms": 10**9}, MAX_ACCEPT_AFTER_MS),
        ({"accept": True, "accept_after_ms": -5}, 0),
        ({"accept": True, "accept_after_ms": True}, 0),
        ({"accept": True, "accept_after_ms": "50"}, 0),
    ],
)
def test_a_task_says_how_long_its_acceptance_may_wait_within_bounds(
    report: dict[str, Any], after: int
) -> None:
    assert TaskBody.of({"input": {}, "report": report}, "task-1").accept_after_ms == after

"""Which publish failures are retried (the same message again) and which are not."""

from __future__ import annotations

import aiormq.exceptions
from aiormq.abc import DeliveredMessage
from pamqp import commands as spec

from orchestrator.bus.publisher import _transient


def test_broker_trouble_is_transient() -> None:
    assert _transient(aiormq.exceptions.DeliveryError(None, None))  # a negative confirm
    assert _transient(aiormq.exceptions.ChannelInvalidStateError("closed"))
    assert _transient(aiormq.exceptions.ConnectionClosed(320, "forced"))
    assert _transient(ConnectionResetError())


def test_an_unroutable_message_and_a_bug_are_not() -> None:
    returned = spec.Basic.Return(reply_code=312, reply_text="NO_ROUTE", exchange="x", routing_key="k")
    message = DeliveredMessage(delivery=returned, header=None, body=b"", channel=None)  # type: ignore[arg-type]
    assert not _transient(aiormq.exceptions.PublishError(message, None))  # type: ignore[arg-type]
    assert not _transient(ValueError("not the broker's fault"))

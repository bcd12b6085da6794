"""Fewer socket writes for aiormq: frames queued in the same event-loop turn go out in one write.

aiormq writes every queued frame with its own ``transport.write``, which is a ``send`` system call
whenever the transport's buffer is empty. Under load a shard publishes dozens of messages and acks in one
loop turn; profiles showed those writes as the largest single cost of both the orchestrator and the
worker. This generator hands aiormq's writer the payloads of every ordinary frame already queued, joined,
and keeps frames that need special handling (a drain or a close) on their own, in order.

Installed once by :func:`install` (idempotent); aiormq's writer loop itself is unchanged.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiormq.connection
from aiormq.abc import ChannelFrame

MAX_FRAMES_PER_WRITE = 256
_ORIGINAL = aiormq.connection.FrameGenerator


class CoalescingFrameGenerator(_ORIGINAL):
    def __init__(self, queue: asyncio.Queue[Any]) -> None:
        super().__init__(queue)
        self._held: ChannelFrame | None = None

    async def __anext__(self) -> ChannelFrame:
        if self._held is not None:
            frame, self._held = self._held, None
        else:
            frame = await super().__anext__()
        if _special(frame):
            return frame
        payloads = [frame.payload]
        while len(payloads) < MAX_FRAMES_PER_WRITE and not self.queue.empty():
            following: ChannelFrame = self.queue.get_nowait()
            self.queue.task_done()
            if _special(following):
                self._held = following  # written on its own, right after this batch: order is kept
                break
            payloads.append(following.payload)
        if len(payloads) == 1:
            return frame
        return ChannelFrame(payload=b"".join(payloads), should_close=False)


def _special(frame: ChannelFrame) -> bool:
    return bool(frame.should_close or frame.should_drain)


def install() -> None:
    aiormq.connection.FrameGenerator = CoalescingFrameGenerator  # type: ignore[misc]

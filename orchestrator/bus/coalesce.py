"""Fewer socket writes for aiormq: frames queued in the same event-loop turn go out in one write.

aiormq writes every queued frame with its own ``transport.write``, which is a ``send`` system call
whenever the transport's buffer is empty. Under load a shard publishes dozens of messages and acks in one
loop turn; profiles showed those writes as the largest single cost of both the orchestrator and the
worker. This generator hands aiormq's writer the payloads of every ordinary frame already queued, joined,
and keeps frames that need special handling (a drain or a close) on their own, in order.

Installed once by :func:`install` (idempotent); aiormq's writer loop itself is unchanged. It replaces a
private aiormq class, so it relies on aiormq's internals as of 6.8-6.9: the writer builds
``FrameGenerator(write_queue)`` by its module-global name and writes each ``ChannelFrame``'s ``payload``,
draining for ``should_drain``/``should_close``. :func:`install` checks the shapes it needs and leaves
aiormq as it is (with a warning) when they changed; ``tests/unit/test_coalesce.py`` fails loudly then.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.metadata
import logging
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


def compatible() -> str | None:
    """None when this aiormq has the shapes the coalescing relies on; else what changed."""
    fields = (
        {f.name for f in dataclasses.fields(ChannelFrame)}
        if dataclasses.is_dataclass(ChannelFrame)
        else set()
    )
    if not {"payload", "should_close", "drain_future"} <= fields or not hasattr(ChannelFrame, "should_drain"):
        return f"aiormq.abc.ChannelFrame has fields {sorted(fields)}"
    probe = _ORIGINAL(asyncio.Queue())
    if not isinstance(getattr(probe, "queue", None), asyncio.Queue) or not hasattr(probe, "close_event"):
        return "aiormq.connection.FrameGenerator no longer keeps its queue and close_event"
    return None


def install() -> None:
    if aiormq.connection.FrameGenerator is CoalescingFrameGenerator:
        return
    changed = compatible()
    if changed is not None:
        logging.getLogger(__name__).warning(
            "frame coalescing not installed: %s (aiormq %s changed its internals; messages still go out, "
            "one socket write each)",
            changed,
            importlib.metadata.version("aiormq"),
        )
        return
    aiormq.connection.FrameGenerator = CoalescingFrameGenerator  # type: ignore[misc]

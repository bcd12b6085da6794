"""The frame coalescing of ``orchestrator/bus/coalesce.py`` replaces a private aiormq class: these tests
fail loudly on an aiormq whose writer or frames changed shape, and check what the coalescing does."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect

import aiormq.connection
import pytest
from aiormq.abc import ChannelFrame

import orchestrator.bus  # noqa: F401  (installs the coalescing, as every saga process does)
from orchestrator.bus import coalesce
from orchestrator.bus.coalesce import CoalescingFrameGenerator


def test_this_aiormq_has_the_shapes_the_coalescing_relies_on() -> None:
    assert coalesce.compatible() is None
    writer = inspect.getsource(aiormq.connection.Connection._Connection__writer)  # type: ignore[attr-defined]
    # the writer builds the generator by its module-global name (so replacing it takes effect) ...
    assert "FrameGenerator(self.write_queue)" in writer
    # ... and handles each frame by these fields alone
    assert "channel_frame.payload" in writer
    assert "channel_frame.should_close" in writer and "channel_frame.should_drain" in writer


def test_importing_the_bus_installs_it() -> None:
    assert aiormq.connection.FrameGenerator is CoalescingFrameGenerator
    coalesce.install()  # idempotent
    assert aiormq.connection.FrameGenerator is CoalescingFrameGenerator


def frame(payload: bytes, *, drain: bool = False, close: bool = False) -> ChannelFrame:
    future = asyncio.get_running_loop().create_future() if drain else None
    return ChannelFrame(payload=payload, should_close=close, drain_future=future)


def test_frames_of_one_turn_go_out_in_one_write_in_order_and_special_ones_alone() -> None:
    async def written() -> list[tuple[bytes, bool, bool]]:
        queue: asyncio.Queue[ChannelFrame] = asyncio.Queue()
        for item in (
            frame(b"a"),
            frame(b"b"),
            frame(b"c"),
            frame(b"D", drain=True),
            frame(b"e"),
            frame(b"f"),
            frame(b"X", close=True),
        ):
            queue.put_nowait(item)
        generator = CoalescingFrameGenerator(queue)
        out = []
        for _ in range(4):
            got = await generator.__anext__()
            out.append((got.payload, got.should_drain, got.should_close))
        assert queue.empty()
        return out

    assert asyncio.run(written()) == [
        (b"abc", False, False),
        (b"D", True, False),  # a frame to drain for is written on its own, right after those before it
        (b"ef", False, False),
        (b"X", False, True),  # and so is the connection's close
    ]


def test_a_single_frame_is_passed_on_as_it_is() -> None:
    async def once() -> bool:
        queue: asyncio.Queue[ChannelFrame] = asyncio.Queue()
        alone = frame(b"only")
        queue.put_nowait(alone)
        return await CoalescingFrameGenerator(queue).__anext__() is alone

    assert asyncio.run(once())


def test_an_aiormq_whose_frames_changed_is_left_as_it_is_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    @dataclasses.dataclass(frozen=True)
    class ReshapedFrame:
        data: bytes

    monkeypatch.setattr(coalesce, "ChannelFrame", ReshapedFrame)
    monkeypatch.setattr(aiormq.connection, "FrameGenerator", coalesce._ORIGINAL)
    assert "ChannelFrame has fields ['data']" in (coalesce.compatible() or "")
    coalesce.install()
    assert aiormq.connection.FrameGenerator is coalesce._ORIGINAL
    assert "frame coalescing not installed" in caplog.text

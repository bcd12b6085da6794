"""The worker's result batcher (workers/results.py), with a fake publish: the reports of one loop turn
for one shard leave in one container, a lone report as the plain message it always was, a container
never outgrows the message limit, and every sender hears the fate of the message that carried it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from orchestrator.bus import batch
from workers.results import Outbound, ResultBatcher


class FakePublisher:
    def __init__(self, error: BaseException | None = None) -> None:
        self.sent: list[Outbound] = []
        self.error = error

    async def __call__(self, message: Outbound) -> None:
        await asyncio.sleep(0)  # a confirm takes a turn or more
        if self.error is not None:
            raise self.error
        self.sent.append(message)

    def unpacked(self, message: Outbound) -> list[bytes]:
        if message.headers is None:
            return [message.body]
        return batch.unpack(message.body, message.headers, 1 << 20)


def run(steps: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(steps())  # type: ignore[arg-type]


def report(n: int) -> tuple[bytes, str]:
    return b'{"n":%d}' % n, f"result-{n}"


def test_the_reports_of_one_turn_for_one_shard_leave_in_one_container_in_order() -> None:
    publish = FakePublisher()

    async def steps() -> None:
        reports = ResultBatcher(publish, 1 << 20)
        await asyncio.gather(*(reports.send(*report(n), "fast.0") for n in range(5)))

    run(steps)
    (message,) = publish.sent
    assert message.headers is not None and message.headers[batch.BATCH_HEADER] == 5
    assert message.ids == tuple(f"result-{n}" for n in range(5))
    assert message.message_id == "batch-result-0+4"
    assert publish.unpacked(message) == [report(n)[0] for n in range(5)]


def test_a_lone_report_goes_as_the_plain_message_it_always_was() -> None:
    publish = FakePublisher()

    async def steps() -> None:
        await ResultBatcher(publish, 1 << 20).send(*report(7), "fast.0")

    run(steps)
    assert publish.sent == [Outbound(report(7)[0], "result-7", "fast.0", ("result-7",), None)]


def test_each_shard_gets_a_message_of_its_own() -> None:
    publish = FakePublisher()

    async def steps() -> None:
        reports = ResultBatcher(publish, 1 << 20)
        shards = ["fast.0", "fast.1", "fast.0", "slow.0", "fast.1"]
        await asyncio.gather(*(reports.send(*report(n), shard) for n, shard in enumerate(shards)))

    run(steps)
    by_shard = {m.shard: m.ids for m in publish.sent}
    assert by_shard == {
        "fast.0": ("result-0", "result-2"),
        "fast.1": ("result-1", "result-4"),
        "slow.0": ("result-3",),
    }
    assert len(publish.sent) == 3


def test_reports_of_different_turns_travel_apart() -> None:
    publish = FakePublisher()

    async def steps() -> None:
        reports = ResultBatcher(publish, 1 << 20)
        first = asyncio.ensure_future(reports.send(*report(1), "fast.0"))
        await asyncio.sleep(0)  # the turn ends: its flush is on its way
        second = asyncio.ensure_future(reports.send(*report(2), "fast.0"))
        await asyncio.gather(first, second)

    run(steps)
    assert [m.ids for m in publish.sent] == [("result-1",), ("result-2",)]
    assert all(m.headers is None for m in publish.sent)


def test_a_container_is_flushed_early_rather_than_outgrow_the_message_limit() -> None:
    publish = FakePublisher()
    body = b"x" * 96  # 100 bytes framed

    async def steps() -> None:
        reports = ResultBatcher(publish, 250)  # two fit, a third would not
        await asyncio.gather(*(reports.send(body, f"result-{n}", "fast.0") for n in range(5)))

    run(steps)
    assert [m.ids for m in publish.sent] == [
        ("result-0", "result-1"),
        ("result-2", "result-3"),
        ("result-4",),
    ]
    assert all(len(m.body) <= 250 for m in publish.sent)
    assert publish.sent[-1].headers is None  # the last one alone: a plain message


def test_a_report_as_large_as_the_limit_goes_alone() -> None:
    publish = FakePublisher()

    async def steps() -> None:
        reports = ResultBatcher(publish, 100)
        await asyncio.gather(
            reports.send(b"a" * 10, "result-a", "fast.0"),
            reports.send(b"b" * 100, "result-b", "fast.0"),
            reports.send(b"c" * 10, "result-c", "fast.0"),
        )

    run(steps)
    assert [m.ids for m in publish.sent] == [("result-a",), ("result-b",), ("result-c",)]


def test_every_sender_of_a_message_hears_its_error() -> None:
    class Unroutable(Exception):
        pass

    publish = FakePublisher(Unroutable("no queue"))

    async def steps() -> list[Any]:
        reports = ResultBatcher(publish, 1 << 20)
        return await asyncio.gather(
            *(reports.send(*report(n), "gone.0") for n in range(3)), return_exceptions=True
        )

    outcomes = run(steps)
    assert [type(o) for o in outcomes] == [Unroutable] * 3


def test_a_sender_returns_only_once_its_message_is_confirmed() -> None:
    async def steps() -> None:
        confirmed = asyncio.Event()
        done: list[str] = []

        async def publish(message: Outbound) -> None:
            await confirmed.wait()

        reports = ResultBatcher(publish, 1 << 20)

        async def send(n: int) -> None:
            await reports.send(*report(n), "fast.0")
            done.append(f"result-{n}")

        senders = [asyncio.ensure_future(send(n)) for n in range(3)]
        for _ in range(5):
            await asyncio.sleep(0)
        assert done == []  # not confirmed yet: no task may be acked
        confirmed.set()
        await asyncio.gather(*senders)
        assert sorted(done) == ["result-0", "result-1", "result-2"]

    run(steps)


def test_a_cancelled_sender_is_left_out_of_the_container() -> None:
    publish = FakePublisher()

    async def steps() -> None:
        reports = ResultBatcher(publish, 1 << 20)
        senders = [asyncio.ensure_future(reports.send(*report(n), "fast.0")) for n in range(3)]
        await asyncio.sleep(0)  # each has added its report; the flush is due at the end of this turn
        senders[1].cancel()
        await asyncio.gather(*senders, return_exceptions=True)

    run(steps)
    assert [m.ids for m in publish.sent] == [("result-0", "result-2")]


@pytest.mark.parametrize("shards", [["fast.0"] * 4, ["fast.0", "fast.1"] * 2])
def test_turned_off_every_report_goes_alone(shards: list[str]) -> None:
    publish = FakePublisher()

    async def steps() -> None:
        reports = ResultBatcher(publish, 1 << 20, enabled=False)
        await asyncio.gather(*(reports.send(*report(n), shard) for n, shard in enumerate(shards)))

    run(steps)
    assert len(publish.sent) == len(shards)
    assert all(m.headers is None for m in publish.sent)

"""A worker's packed tasks that cannot start soon (workers/runtime.py ``_wait_turn``, ``_spill``,
``_give_back``), without a broker: the slot wait gives up after ``spill_after_s`` and leaks no slot, a
task cancelled while it waited is reported cancelled rather than sent on, a stopping worker sends its
waiting packed tasks back alone instead of giving their container back whole, and a task that could not be
sent back is given back with its delivery."""

from __future__ import annotations

import asyncio
from typing import Any

from orchestrator.bus.envelope import Envelope, Signer
from orchestrator.bus.inbound import Delivered
from orchestrator.wire.kinds import Kind
from tests.unit.test_task_packing import Settled
from workers.runtime import Turn, WorkerRuntime, _Delivered, _Spill

QUEUE = "saga.task.tasks.parallel:render@1"


class Channel:
    def __init__(self, closed: bool = False) -> None:
        self.is_closed = closed


def container(closed: bool = False) -> Delivered:
    """A worker's delivery of a container, on a channel open or closed."""
    return Delivered(
        b"the container's frames",
        None,
        "container-1",
        1,
        Channel(closed),  # type: ignore[arg-type]  # only its state is read
        exchange="saga.tasks",
        routing_key=QUEUE,
    )


class Publisher:
    def __init__(self, fail: bool = False) -> None:
        self.sent: list[tuple[bytes, str, str, str]] = []
        self.fail = fail

    async def publish_bytes(self, body: bytes, message_id: str, exchange: str, key: str, **_: Any) -> None:
        if self.fail:
            raise ConnectionError("the broker is away")
        self.sent.append((body, message_id, exchange, key))


def runtime(concurrency: int = 1) -> WorkerRuntime:
    return WorkerRuntime(
        connection=None,  # type: ignore[arg-type]  # nothing here touches the broker
        handlers={},
        serving=[],
        signer=Signer.from_settings(("k:secret",)),
        concurrency=concurrency,
        spill_after_s=0.05,
    )


TASK = Envelope(
    kind=Kind.TASK,
    message_id="task-7",
    run_id="run-7",
    shard="fast.0",
    stage="render",
    attempt=1,
    fence="1.1",
    contract="render@1",
    body={"input": {}},
)
KEY = ("run-7", "render", "1.1")


def packed(closed: bool = False) -> _Delivered:
    return _Delivered(container(closed), b"the task's own signed bytes")


def alone() -> _Delivered:
    message = container()
    return _Delivered(message, message.body)


def test_a_packed_task_with_no_free_slot_in_time_is_to_be_spilled_and_leaks_no_slot() -> None:
    async def go() -> None:
        worker = runtime()
        await worker._slots.acquire()  # the one slot is busy
        assert isinstance(await worker._wait_turn(TASK, False, packed()), _Spill)
        worker._slots.release()
        assert not worker._slots.locked()  # the wait that gave up holds nothing
        assert worker._waiting == {}

    asyncio.run(go())


def test_a_task_that_came_alone_waits_for_its_slot_however_long() -> None:
    async def go() -> None:
        worker = runtime()
        await worker._slots.acquire()
        asyncio.get_running_loop().call_later(0.2, worker._slots.release)  # four times spill_after_s
        turn = await worker._wait_turn(TASK, False, alone())
        assert isinstance(turn, Turn) and turn.slot and not turn.cancelled

    asyncio.run(go())


def test_a_packed_task_cancelled_while_it_waited_is_reported_cancelled_not_sent_on() -> None:
    async def go() -> None:
        worker = runtime()
        await worker._slots.acquire()
        worker._cancelled[KEY] = None
        turn = await worker._wait_turn(TASK, False, packed())
        assert isinstance(turn, Turn) and turn.cancelled and not turn.slot
        turn.finished()  # it held no slot: giving it back frees none
        assert worker._slots.locked()

    asyncio.run(go())


def test_a_stopping_worker_gives_its_waiting_packed_task_back() -> None:
    async def go() -> None:
        worker = runtime()
        await worker._slots.acquire()
        worker._giving_up = True
        assert await worker._wait_turn(TASK, False, packed()) is None

    asyncio.run(go())


def test_spilling_sends_the_tasks_own_bytes_to_its_queue_then_settles_its_part() -> None:
    async def go() -> None:
        worker, publisher, settle = runtime(), Publisher(), Settled()
        task = packed()
        assert await worker._spill(publisher, task, TASK, settle)  # type: ignore[arg-type]
        assert publisher.sent == [(task.body, "task-7", "saga.tasks", QUEUE)]
        assert settle.calls == ["ack"]

    asyncio.run(go())


def test_a_spill_the_broker_refuses_leaves_the_task_unsettled_to_wait_for_a_slot() -> None:
    async def go() -> None:
        worker, settle = runtime(), Settled()
        assert not await worker._spill(Publisher(fail=True), packed(), TASK, settle)  # type: ignore[arg-type]
        assert settle.calls == []

    asyncio.run(go())


def test_nothing_is_sent_or_settled_for_a_task_whose_channel_closed() -> None:
    async def go() -> None:
        worker, publisher, settle = runtime(), Publisher(), Settled()
        assert await worker._spill(publisher, packed(closed=True), TASK, settle)  # type: ignore[arg-type]
        assert publisher.sent == [] and settle.calls == []

    asyncio.run(go())


def test_giving_back_sends_a_packed_task_alone_and_requeues_any_other() -> None:
    async def go() -> None:
        worker = runtime()
        cases = [(packed(), Publisher(), ["ack"]), (packed(), Publisher(fail=True), ["requeue"])]
        cases.append((alone(), Publisher(), ["requeue"]))
        for task, publisher, settled in cases:
            settle = Settled()
            await worker._give_back(publisher, task, TASK, settle)  # type: ignore[arg-type]
            assert settle.calls == settled, (task.packed, publisher.fail)
            assert len(publisher.sent) == (1 if settled == ["ack"] else 0)

    asyncio.run(go())

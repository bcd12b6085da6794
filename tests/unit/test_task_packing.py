"""A map's ``items_per_message``: the compiler keeps the digest of plans that do not use it, the engine
writes it into each item task, and the publisher packs those tasks into containers of at most that many,
per contract queue and within the message size readers take, each task signed on its own."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from orchestrator.bus import batch
from orchestrator.bus.envelope import Signer, decode
from orchestrator.bus.names import Names
from orchestrator.bus.publisher import Publisher
from orchestrator.compiler import compile_text
from orchestrator.wire import bodies
from orchestrator.wire.kinds import Kind
from orchestrator.wire.outgoing import Outgoing
from tests.conftest import DEMO_REGISTRY
from tests.unit.test_engine import DEFINITIONS
from tests.unit.test_engine_chunked_bags import WINDOW, bag_sim, item_tasks
from workers.runtime import _ContainerSettle

SIGNER = Signer.from_settings(("test:secret",))
SOURCE = (DEFINITIONS / "thumbnail-batch.yaml").read_text(encoding="utf-8")


def compiled_with(per_message: int | None) -> Any:
    """thumbnail-batch with ``items_per_message`` set to ``per_message`` (None: not written)."""
    lines = [line for line in SOURCE.splitlines() if "items_per_message" not in line]
    if per_message is not None:
        at = next(i for i, line in enumerate(lines) if "max_items:" in line)
        lines.insert(at + 1, f"    items_per_message: {per_message}")
    return compile_text("\n".join(lines) + "\n", str(Path("thumbnail-batch.yaml")), DEMO_REGISTRY)


def test_one_item_per_message_is_the_default_and_leaves_the_digest_as_it_was() -> None:
    unwritten, written = compiled_with(None), compiled_with(1)
    assert written.digest == unwritten.digest
    assert "items_per_message" not in unwritten.plan["stages"]["render-all"]
    assert compiled_with(10).digest != unwritten.digest  # a real setting is part of the plan's meaning


def test_each_item_task_carries_how_many_may_share_its_message() -> None:
    sim, _ = bag_sim(WINDOW + 3)
    sim.deliver_at(0)  # the start: the first chunk
    assert item_tasks(sim) == list(range(WINDOW))
    assert {bodies.per_message(t.body) for t in sim.tasks} == {50}  # definitions/thumbnail-batch.yaml


def test_a_task_that_names_no_packing_travels_alone() -> None:
    assert bodies.per_message({}) == 1
    for odd in (0, -3, True, "5", 1.5, None):
        assert bodies.per_message({bodies.PER_MESSAGE: odd}) == 1, odd


def item(i: int, *, per_message: int = 3, contract: str = "thumbnail.render@3", pad: int = 0) -> Outgoing:
    body = bodies.task(
        run_id="run-1",
        shard="fast.0",
        stage="render-all",
        attempt=1,
        fence="1.1",
        item=i,
        contract=contract,
        digest="sha256:x",
        tenant="default",
        payload={"modelId": f"m-{i}", "pad": "x" * pad},
        idempotency_key=f"task-{i}",
        per_message=per_message,
    )
    return Outgoing(f"task-{i}", Kind.TASK, ("task", "tasks.parallel"), body)


def publisher(max_bytes: int = 1_048_576, pack_tasks: int = 1) -> Publisher:
    return Publisher(  # type: ignore[arg-type]
        None, SIGNER, Names(), max_message_bytes=max_bytes, pack_tasks=pack_tasks
    )


def task(run: int, stage: str = "render", queue: str = "tasks.parallel") -> Outgoing:
    """A plain (not a bag's) task of run ``run``."""
    body = bodies.task(
        run_id=f"run-{run}",
        shard="fast.0",
        stage=stage,
        attempt=1,
        fence="1.1",
        item=None,
        contract="model.render@1",
        digest="sha256:x",
        tenant="default",
        payload={"modelId": f"m-{run}"},
        idempotency_key=f"{run}-{stage}",
    )
    return Outgoing(f"task-{run}-{stage}", Kind.TASK, ("task", queue), body)


def test_packs_hold_at_most_their_tasks_number_per_contract_queue_each_task_signed_alone() -> None:
    other = [item(i, contract="thumbnail.render@4") for i in (100, 101)]
    single = Outgoing("release-1", Kind.RELEASE, ("shard", "fast.0"), bodies.attempt("run-1", "s", "1.1"))
    lone = item(200, per_message=1)
    serial = Outgoing("task-300", Kind.TASK, ("task", "tasks.serial"), item(300).body)
    messages = [*(item(i) for i in range(7)), *other, single, lone, serial]
    alone, packs = publisher()._packed(messages, 0)
    # a pack of one would be a plain message anyway: it goes as one, with the bytes packing signed
    assert [m.message_id for m, _ in alone] == ["release-1", "task-200", "task-300", "task-6"]
    signed = {m.message_id: payload for m, payload in alone if payload is not None}
    assert list(signed) == ["task-6"]
    assert decode(signed["task-6"], SIGNER, 1_048_576).message_id == "task-6"
    assert [[m.message_id for m in p.messages] for p in packs] == [
        ["task-0", "task-1", "task-2"],
        ["task-3", "task-4", "task-5"],
        ["task-100", "task-101"],
    ]
    for pack in packs:
        container = batch.pack(pack.payloads, pack.messages[0].message_id)
        opened = batch.unpack(container.body, container.headers, 1_048_576)
        decoded = [decode(payload, SIGNER, 1_048_576).message_id for payload in opened]
        assert decoded == [m.message_id for m in pack.messages]


def test_a_pack_stays_within_the_message_size_its_reader_takes() -> None:
    tasks = [item(i, per_message=50, pad=300) for i in range(10)]
    one = len(publisher()._packed(tasks[:2], 0)[1][0].payloads[0])
    limit = 3 * batch.framed_bytes(one) + batch.framed_bytes(one) // 2  # room for three and a half
    alone, packs = publisher(limit)._packed(tasks, 0)
    assert sum(len(p.messages) for p in packs) + len(alone) == 10
    assert [len(p.messages) for p in packs] == [3, 3, 3]
    assert [m.message_id for m, _ in alone] == ["task-9"]
    for pack in packs:
        container = batch.pack(pack.payloads, pack.messages[0].message_id)
        assert len(container.body) <= limit
        assert len(batch.unpack(container.body, container.headers, limit)) == len(pack.messages)


def test_tasks_of_many_runs_for_one_contract_queue_share_packs_of_at_most_pack_tasks() -> None:
    plain = [task(r) for r in range(7)]
    elsewhere = [task(r, queue="gpu") for r in (10, 11)]
    serial = [task(r, queue="tasks.serial") for r in (20, 21)]
    bag = [item(i, per_message=5) for i in range(5)]  # a map's own setting, larger, counts for its items
    alone, packs = publisher(pack_tasks=3)._packed([*plain, *elsewhere, *serial, *bag], 0)
    assert [[m.message_id for m in p.messages] for p in packs] == [
        ["task-0-render", "task-1-render", "task-2-render"],
        ["task-3-render", "task-4-render", "task-5-render"],
        ["task-10-render", "task-11-render"],
        [f"task-{i}" for i in range(5)],
    ]
    assert [m.message_id for m, _ in alone] == ["task-20-render", "task-21-render", "task-6-render"]
    for pack in packs:  # each task as it would travel alone, under its own run's identity
        container = batch.pack(pack.payloads, pack.messages[0].message_id)
        opened = batch.unpack(container.body, container.headers, 1_048_576)
        runs = [decode(payload, SIGNER, 1_048_576).run_id for payload in opened]
        assert runs == [m.body["run_id"] for m in pack.messages]


def test_pack_tasks_of_one_sends_every_plain_task_alone() -> None:
    alone, packs = publisher(pack_tasks=1)._packed([task(r) for r in range(4)], 0)
    assert packs == [] and len(alone) == 4


def test_a_pack_size_out_of_range_is_refused_with_the_range() -> None:
    for wrong in (0, batch.MAX_PACKED_TASKS + 1):
        with pytest.raises(ValueError, match=f"pack_tasks is {wrong}: give 1 to {batch.MAX_PACKED_TASKS}"):
            publisher(pack_tasks=wrong)


class Settled:
    """A delivery's settling, as a container's tasks reach it."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def ack(self) -> None:
        self.calls.append("ack")

    async def requeue(self) -> None:
        self.calls.append("requeue")


def settle_container(outcomes: list[list[str]]) -> list[str]:
    """Settle a container of ``len(outcomes)`` tasks, each task calling the given settlings in turn."""
    delivery = Settled()
    container = _ContainerSettle(delivery, len(outcomes))  # type: ignore[arg-type]
    parts = [container.part() for _ in outcomes]

    async def go() -> None:
        for part, calls in zip(parts, outcomes, strict=True):
            for call in calls:
                await getattr(part, call)()

    asyncio.run(go())
    return delivery.calls


def test_a_container_is_acked_once_every_task_is_settled() -> None:
    assert settle_container([["ack"], ["ack"], ["ack"]]) == ["ack"]
    assert settle_container([["ack"], ["ack"], []]) == []  # one still running: nothing yet


def test_a_container_goes_back_whole_if_any_task_had_to() -> None:
    assert settle_container([["ack"], ["requeue"], ["ack"]]) == ["requeue"]
    assert settle_container([["requeue"], ["requeue"]]) == ["requeue"]


def test_a_task_settled_twice_counts_once() -> None:
    # a task that reported and then raised is settled again by its guard: it must not stand in for
    # another task still running
    assert settle_container([["ack", "requeue"], []]) == []
    assert settle_container([["ack", "requeue"], ["ack"]]) == ["ack"]

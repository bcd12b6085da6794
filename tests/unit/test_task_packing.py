"""A map's ``items_per_message``: the compiler keeps the digest of plans that do not use it, the engine
writes it into each item task, and the publisher packs those tasks into containers of at most that many,
per contract queue and within the message size readers take, each task signed on its own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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


def publisher(max_bytes: int = 1_048_576) -> Publisher:
    return Publisher(None, SIGNER, Names(), max_message_bytes=max_bytes)  # type: ignore[arg-type]


def test_packs_hold_at_most_their_tasks_number_per_contract_queue_each_task_signed_alone() -> None:
    other = [item(i, contract="thumbnail.render@4") for i in (100, 101)]
    single = Outgoing("release-1", Kind.RELEASE, ("shard", "fast.0"), bodies.attempt("run-1", "s", "1.1"))
    lone = item(200, per_message=1)
    alone, packs = publisher()._packed([*(item(i) for i in range(7)), *other, single, lone], 0)
    assert [m.message_id for m in alone] == ["release-1", "task-200"]
    assert [[m.message_id for m in p.messages] for p in packs] == [
        ["task-0", "task-1", "task-2"],
        ["task-3", "task-4", "task-5"],
        ["task-6"],
        ["task-100", "task-101"],
    ]
    for pack in packs:
        for message, payload in zip(pack.messages, pack.payloads, strict=True):
            assert decode(payload, SIGNER, 1_048_576).message_id == message.message_id


def test_a_pack_stays_within_the_message_size_its_reader_takes() -> None:
    tasks = [item(i, per_message=50, pad=300) for i in range(10)]
    limit = 1_500
    alone, packs = publisher(limit)._packed(tasks, 0)
    assert not alone
    assert sum(len(p.messages) for p in packs) == 10
    assert len(packs) > 1
    for pack in packs:
        assert sum(batch.framed_bytes(len(p)) for p in pack.payloads) <= limit

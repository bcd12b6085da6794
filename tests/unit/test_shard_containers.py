"""How the shard service opens and settles containers (orchestrator/shard/service.py), with stand-in
messages, store and publisher: each message inside is decoded and refused on its own, a malformed
container is refused whole, and an AMQP message is settled exactly once however many it carried."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from orchestrator.bus import batch
from orchestrator.bus.envelope import Signer, signed_message
from orchestrator.settings import DEVELOPMENT_SIGNING_KEY
from orchestrator.shard.processor import Outcome
from orchestrator.shard.service import ShardOptions, ShardService, _Delivery

SIGNER = Signer.from_settings((DEVELOPMENT_SIGNING_KEY,))
FORGER = Signer.from_settings(("dev:not-the-key",))
ISSUED = int(time.time() * 1000)  # fresh while the tests run: the shard takes such messages


def result(n: int, signer: Signer = SIGNER, issued_at_ms: int = ISSUED) -> bytes:
    return signed_message(
        signer,
        kind="result",
        message_id=f"result-{n}",
        run_id=f"run-{n}",
        shard="fast.0",
        stage="render",
        attempt=1,
        fence="1.1",
        digest="d",
        issued_at_ms=issued_at_ms,
        body={"ok": True, "result": {}},
    )


@dataclass
class FakeMessage:
    body: bytes
    message_id: str | None
    headers: dict[str, Any] = field(default_factory=dict)
    settled: list[str] = field(default_factory=list)

    async def ack(self) -> None:
        self.settled.append("ack")

    async def nack(self, requeue: bool = True) -> None:
        self.settled.append("requeue" if requeue else "dead-letter")


def container(bodies: list[bytes], redelivered: int = 0) -> FakeMessage:
    packed = batch.pack(bodies, "result-x")
    headers: dict[str, Any] = {**packed.headers, "x-delivery-count": redelivered}
    return FakeMessage(packed.body, packed.message_id, headers)


@dataclass
class FakeStore:
    poisoned: list[tuple[str, str]] = field(default_factory=list)
    client: Any = None  # the processor keeps it; nothing here reaches Redis
    prefix: str = "t"

    async def poison(self, shard: str, run_id: str, message_id: str, error: str, now_ms: int) -> None:
        self.poisoned.append((run_id, message_id))


@dataclass
class FakePublisher:
    parked: list[tuple[bytes, str, str | None]] = field(default_factory=list)

    async def reject(
        self, raw: bytes, reason: str, detail: str, source: str, message_id: str | None = None
    ) -> None:
        self.parked.append((raw, reason, message_id))


def service(store: FakeStore | None = None) -> ShardService:
    return ShardService(None, store or FakeStore(), SIGNER, ["fast.0"], ShardOptions())  # type: ignore[arg-type]


def test_each_message_of_a_container_is_decoded_and_refused_on_its_own() -> None:
    plain = FakeMessage(result(1), "result-1")
    mixed = container([result(2), result(3, FORGER), b"not json", result(4)])
    deliveries = service()._decoded([plain, mixed])  # type: ignore[list-item]
    assert [d.message for d in deliveries] == [plain, mixed, mixed, mixed, mixed]
    assert [d.envelope.message_id if d.envelope else None for d in deliveries] == [
        "result-1",
        "result-2",
        None,
        None,
        "result-4",
    ]
    reasons = [d.outcome.rejected[0] if d.outcome and d.outcome.rejected else None for d in deliveries]
    assert reasons == [None, None, "bad-signature", "malformed", None]
    assert [d.body for d in deliveries[1:]] == [result(2), result(3, FORGER), b"not json", result(4)]
    # known by their own ids, or until decoded by the container's and their place in it
    assert [d.message_id for d in deliveries] == [
        "result-1",
        "result-2",
        "batch-result-x+3/1",
        "batch-result-x+3/2",
        "result-4",
    ]


def test_a_malformed_container_is_one_delivery_refused_whole() -> None:
    bad = container([result(1), result(2)])
    bad.body = bad.body[:-3]
    (delivery,) = service()._decoded([bad])  # type: ignore[list-item]
    assert delivery.envelope is None and delivery.body == bad.body
    assert delivery.outcome is not None and delivery.outcome.rejected is not None
    assert delivery.outcome.rejected[0] == "malformed-batch"


def test_a_refused_message_of_a_container_is_parked_with_its_own_bytes() -> None:
    mixed = container([result(1), result(2, FORGER)])
    shard, publisher = service(), FakePublisher()
    deliveries = shard._decoded([mixed])  # type: ignore[list-item]
    asyncio.run(shard._pass_on("fast.0", deliveries, publisher))  # type: ignore[arg-type]
    assert publisher.parked == [(result(2, FORGER), "bad-signature", "batch-result-x+1/1")]


def settle(deliveries: list[_Delivery], store: FakeStore | None = None) -> None:
    asyncio.run(service(store)._ack("fast.0", deliveries))


def test_a_container_is_settled_once_requeued_whole_when_one_of_its_messages_failed() -> None:
    plain, box = FakeMessage(result(1), "result-1"), container([result(2), result(3), result(4)])
    deliveries = service()._decoded([plain, box])  # type: ignore[list-item]
    for delivery in deliveries:
        delivery.outcome = Outcome()
    deliveries[2].error = RuntimeError("a bug")
    settle(deliveries)
    assert plain.settled == ["ack"]
    assert box.settled == ["requeue"]  # once: a second settle of one delivery tag closes the channel


def test_a_container_whose_messages_all_committed_is_acked_once() -> None:
    failed, box = FakeMessage(result(1), "result-1"), container([result(2), result(3)])
    deliveries = service()._decoded([failed, box])  # type: ignore[list-item]
    deliveries[0].error = RuntimeError("a bug")
    settle(deliveries)
    assert failed.settled == ["requeue"]
    assert box.settled == ["ack"]


def test_a_poison_container_fails_only_the_runs_of_its_failing_messages_and_is_dead_lettered_once() -> None:
    box = container([result(1), result(2), result(3)], redelivered=ShardOptions().poison_after)
    store = FakeStore()
    deliveries = service(store)._decoded([box])  # type: ignore[list-item]
    deliveries[0].error = RuntimeError("a bug")
    deliveries[2].error = RuntimeError("a bug")
    settle(deliveries, store)
    assert store.poisoned == [("run-1", "result-1"), ("run-3", "result-3")]
    assert box.settled == ["dead-letter"]

"""Batched results on the real services: a worker sends the results it finished in one event-loop turn
for one shard in one message (a container, orchestrator/bus/batch.py), and the orchestrator takes each
result in it on its own.

- a bag of 200 items completes, and the metrics of both processes show results that came in containers;
- a container holding a valid result and a forged one: the valid one is applied, the forged one is
  parked on the rejected queue with its own bytes and reason;
- a container redelivered after its results committed (the orchestrator killed between commit and ack)
  is recognised as duplicates by the next orchestrator: no double effect.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import aio_pika
import pytest

from orchestrator.bus import batch
from orchestrator.bus.envelope import Envelope, Signer, decode, signed_message
from orchestrator.bus.names import Names
from orchestrator.client import SyncClient
from orchestrator.wire import ids
from tests.integration.stack import Stack, poll
from tests.integration.test_metrics import metered, scrape, total
from tests.integration.test_result_contract import take_tasks

pytestmark = pytest.mark.services

NAMES = Names()  # the stack runs in the default namespace, on a vhost of its own
CACHE_LOOKUP = NAMES.task_queue("tasks.actions", "cache.lookup@1")
FORGER = Signer.from_settings(("dev:not-the-signing-key",))  # the real key's id, another secret
WIDTH = 200


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[Stack, int, int]]:
    yield from metered(Stack("batching", env={"SAGA_DEMO_EFFECTS": "0"}))  # no-op handlers


def test_a_wide_bag_completes_with_its_results_batched(stack: tuple[Stack, int, int]) -> None:
    s, orchestrator_port, worker_port = stack
    # Given a worker running 16 tasks at once
    # When a bag of 200 no-op items runs
    run_bag(s, [f"m{i}" for i in range(WIDTH)])  # Then it completes with every result in item order
    # and some of the results travelled several to a message, on both sides of the broker
    worker = scrape(worker_port)
    orchestrator = scrape(orchestrator_port)
    assert worker is not None and orchestrator is not None
    sent = total(worker, "saga_worker_container_reports_count")
    received = total(orchestrator, "saga_shard_container_messages_count")
    assert sent > 0, "no container was sent"
    assert received == sent, (received, sent)
    carried = total(worker, "saga_worker_container_reports_sum")
    assert total(orchestrator, "saga_shard_container_messages_sum") == carried
    assert 2 * sent <= carried <= WIDTH + 1  # the items' results (and the finaliser's, alone or not)
    assert_nothing_refused(s)  # and nothing was refused or dead-lettered on the way


def test_a_forged_result_in_a_container_is_parked_alone_and_the_valid_one_applied(
    stack: tuple[Stack, int, int],
) -> None:
    s, _, _ = stack
    # Given two runs waiting for their cache lookups, which no worker will answer
    stop_worker(s)
    with SyncClient(s.settings) as client:
        runs = [client.start("model-ingest", {"modelId": f"forged-{i}"}) for i in range(2)]
    tasks = {t.run_id: t for t in take_tasks(s, CACHE_LOOKUP, 2)}
    valid, forged = answer(tasks[runs[0]], s.signer), answer(tasks[runs[1]], FORGER)
    shard = tasks[runs[0]].shard
    # When a container holds a valid result for the first and a forged one for the second
    publish_container(s, shard, [valid, forged])
    # Then the valid one is applied
    poll(
        lambda: s.record(runs[0]).get("s:render-thumbnail:status") == "dispatched",
        20,
        what="the valid result applied",
    )
    # and the forged one is parked on the rejected queue with its own bytes and the reason
    (parked,) = poll(lambda: take_parked(s), 20, what="the forged result parked")
    body, headers, message_id = parked
    assert body == forged
    assert headers["x-saga-reason"] == "bad-signature"
    assert headers["x-saga-source"] == NAMES.shard_queue(shard)
    assert message_id.startswith("batch-") and message_id.endswith("/1")
    # and the run it names did not move
    assert s.record(runs[1]).get("s:cache-lookup:status") == "dispatched"
    assert s.queue_depths().get(NAMES.shard_queue(shard), 0) == 0  # the container was acked


def test_a_container_redelivered_after_its_results_committed_is_recognised_as_duplicates(
    stack: tuple[Stack, int, int],
) -> None:
    s, _, _ = stack
    # Given two runs on one shard waiting for their cache lookups, which no worker will answer
    stop_worker(s)
    with SyncClient(s.settings) as client:
        started = [client.start("model-ingest", {"modelId": f"again-{i}"}) for i in range(3)]
    tasks = take_tasks(s, CACHE_LOOKUP, 3)
    shard = next(t.shard for t in tasks if sum(u.shard == t.shard for u in tasks) >= 2)
    pair = [t for t in tasks if t.shard == shard][:2]
    assert {t.run_id for t in tasks} == set(started)
    # and an orchestrator that dies after its next commit, before it acks
    s.stop("orchestrator")
    s.start_orchestrator("crashing", extra_env={"SAGA_CRASH_POINTS": "after-commit"})
    poll(lambda: s.list_queues("consumers").get(NAMES.shard_queue(shard), 0) == 1, 20, what="it consumes")
    # When a container of both results reaches it
    publish_container(s, shard, [answer(t, s.signer) for t in pair])
    assert s.wait_exit("crashing") == -9
    committed = {t.run_id: s.record(t.run_id) for t in pair}
    assert all(r["s:cache-lookup:status"] == "completed" for r in committed.values()), committed
    # and the next orchestrator gets the container again
    s.start_orchestrator("orchestrator")
    # Then each result in it is recognised as a duplicate, and changes nothing
    for task in pair:
        result_id = ids.result_id(task.message_id)
        poll(
            lambda run=task.run_id, rid=result_id: duplicates(s, run, rid) == 1,
            20,
            what=f"the result for {task.run_id} recognised as a duplicate",
        )
        assert s.record(task.run_id) == committed[task.run_id]
        completed = [e for e in s.history(task.run_id) if e["kind"] == "stage.completed"]
        assert [e["stage"] for e in completed] == ["cache-lookup"]
    poll(lambda: s.queue_depths().get(NAMES.shard_queue(shard), 0) == 0, 20, what="the container acked")
    depths = s.queue_depths()
    assert all(n == 0 for q, n in depths.items() if q.endswith(".dlq")), depths


# ---- helpers -----------------------------------------------------------------------------------------


def run_bag(stack: Stack, models: list[str]) -> str:
    """Run a thumbnail-batch bag over ``models`` to its end; asserts it completed with every item's
    result in item order, and returns its run id."""
    with SyncClient(stack.settings) as client:
        run_id = client.start("thumbnail-batch", {"modelIds": models})
        result = client.wait(run_id, timeout_s=60)
    assert result.state == "completed", result
    assert result.output == {
        "count": len(models),
        "thumbnails": [{"thumbnailUri": f"thumbs/{m}.png"} for m in models],
    }
    return run_id


def assert_nothing_refused(stack: Stack) -> None:
    """Nothing waits on the rejected queue or on a dead-letter queue."""
    depths = stack.queue_depths()
    assert depths.get(NAMES.rejected_queue, 0) == 0, depths
    assert all(n == 0 for q, n in depths.items() if q.endswith(".dlq")), depths


def stop_worker(stack: Stack) -> None:
    if "worker" in stack.processes:
        stack.stop("worker")


def answer(task: Envelope, signer: Signer) -> bytes:
    """The signed bytes of a successful cache lookup (a miss) for ``task``, as its worker would send."""
    identity = task.model_dump(include=TASK_IDENTITY)
    return signed_message(
        signer,
        kind="result",
        message_id=ids.result_id(task.message_id),
        issued_at_ms=int(time.time() * 1000),
        body={"ok": True, "result": {"modelId": task.body["input"]["modelId"], "hit": False}},
        **identity,
    )


# what a report copies from its task
TASK_IDENTITY = {"run_id", "shard", "stage", "attempt", "fence", "item", "digest", "contract", "tenant"}


def duplicates(stack: Stack, run_id: str, message_id: str) -> int:
    return sum(
        e["kind"] == "callback.rejected"
        and e["detail"].get("reason") == "duplicate"
        and e["detail"].get("message_id") == message_id
        for e in stack.history(run_id)
    )


def publish_container(stack: Stack, shard: str, payloads: list[bytes]) -> None:
    """Publish ``payloads`` in one container to ``shard``, as a worker does."""
    first = decode(payloads[0], stack.signer, stack.settings.max_message_bytes).message_id
    container = batch.pack(payloads, first)
    publish_framed(
        stack, NAMES.runs_exchange, shard, container.body, dict(container.headers), container.message_id
    )


def publish_framed(
    stack: Stack, exchange: str, routing_key: str, body: bytes, headers: dict[str, Any], message_id: str
) -> None:
    """Publish ``body`` as a container (its content type, ``headers``), confirmed and mandatory."""

    async def go() -> None:
        connection = await aio_pika.connect(stack.settings.amqp_url)
        try:
            channel = await connection.channel(publisher_confirms=True)
            target = await channel.get_exchange(exchange, ensure=False)
            message = aio_pika.Message(
                body,
                headers=headers,
                message_id=message_id,
                content_type=batch.CONTENT_TYPE,
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            )
            await target.publish(message, routing_key=routing_key, mandatory=True)
        finally:
            await connection.close()

    asyncio.run(go())


def take_parked(stack: Stack) -> list[tuple[bytes, dict[str, Any], str]]:
    """Everything on the rejected queue now, taken off it: (body, headers, message id)."""

    async def go() -> list[tuple[bytes, dict[str, Any], str]]:
        connection = await aio_pika.connect(stack.settings.amqp_url)
        try:
            channel = await connection.channel()
            queue = await channel.declare_queue(NAMES.rejected_queue, passive=True)
            found = []
            while (message := await queue.get(no_ack=True, fail=False)) is not None:
                found.append((message.body, dict(message.headers or {}), message.message_id or ""))
            return found
        finally:
            await connection.close()

    return asyncio.run(go())

"""Packed item tasks on the real services: a map with ``items_per_message`` sends its item tasks several to
a message (a container, orchestrator/bus/batch.py), each still signed on its own; the worker runs each on
its own and settles the message once every one of them has reported.

- a bag of 120 items (thumbnail-batch packs 50 to a message) completes with its results in item order,
  the worker received its tasks in containers, and every item ran its effect once;
- a container delivered again (its first delivery was given back unacked) is split by the worker into one
  message per task, and its run completes, each item's effect still once;
- a container that is not exactly its frames is parked whole on the rejected queue with the reason;
- tasks of different runs for one contract queue, sent at once, share a container (``SAGA_PACK_TASKS``),
  and every run completes with each effect once;
- a packed task that finds no free slot in time goes back to its queue alone (spilled), and runs once.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from collections.abc import Iterator
from typing import Any

import aio_pika
import pytest

from orchestrator.bus import batch
from orchestrator.bus.names import Names
from orchestrator.client import SyncClient
from tests.faults.invariants import assert_no_violations, check_runs
from tests.integration.stack import Stack, poll
from tests.integration.test_metrics import free_port, metered, scrape, total
from tests.integration.test_result_batching import (
    assert_nothing_refused,
    publish_framed,
    run_bag,
    take_parked,
)

pytestmark = pytest.mark.services

NAMES = Names()  # the stack runs in the default namespace, on a vhost of its own
RENDER = NAMES.task_queue("tasks.parallel", "thumbnail.render@3")
PER_MESSAGE = 50  # definitions/thumbnail-batch.yaml


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[Stack, int, int]]:
    yield from metered(Stack("packing"))


def test_a_bag_sends_its_items_packed_and_completes_with_each_item_run_once(
    stack: tuple[Stack, int, int],
) -> None:
    s, _, worker_port = stack
    # Given a map that packs 50 item tasks to a message
    width = 120
    # When a bag of 120 items runs, Then it completes with every item's result in item order
    run_id = run_bag(s, [f"packed-{i}" for i in range(width)])
    # and its tasks reached the worker in containers: 50, 50 and 20 (more only if one was sent again)
    worker = scrape(worker_port)
    assert worker is not None
    containers = total(worker, "saga_worker_container_tasks_count")
    carried = total(worker, "saga_worker_container_tasks_sum")
    assert containers >= -(-width // PER_MESSAGE), containers
    assert carried >= width and carried <= containers * PER_MESSAGE, (carried, containers)
    # and each item ran its effect once, with nothing refused or dead-lettered on the way
    assert_no_violations(check_runs(s.redis, s.prefix, [run_id]), "the shared invariants")
    assert_nothing_refused(s)


def test_a_container_delivered_again_is_split_into_one_message_per_task(
    stack: tuple[Stack, int, int],
) -> None:
    s, _, _ = stack
    # Given a bag of 7 items dispatched while no worker runs: one container of 7 tasks
    s.stop("worker")
    models = [f"again-{i}" for i in range(7)]
    with SyncClient(s.settings) as client:
        run_id = client.start("thumbnail-batch", {"modelIds": models})
    # and a consumer that took the container and gave it back unacked (it died holding it)
    headers = give_back_one(s, RENDER)
    assert headers[batch.BATCH_HEADER] == len(models), headers
    # When a worker gets it again
    s.start_worker("worker")
    # Then it sends its tasks back one per message, and the run completes with each item run once
    assert s.wait_finished(run_id, timeout_s=60)["status"] == "completed"
    assert "its 7 tasks were re-sent one per message" in s.log("worker")
    assert_no_violations(check_runs(s.redis, s.prefix, [run_id]), "the shared invariants")
    poll(lambda: s.queue_depths().get(RENDER, 0) == 0, 20, what="the container and its tasks acked")


def test_a_container_that_is_not_its_frames_is_parked_whole(stack: tuple[Stack, int, int]) -> None:
    s, _, _ = stack
    # Given a container on a task queue whose checksum does not match its body
    body = b"".join(len(p).to_bytes(4, "big") + p for p in (b'{"a":1}', b'{"b":2}'))
    headers: dict[str, Any] = {batch.BATCH_HEADER: 2, batch.CHECKSUM_HEADER: zlib.crc32(body) ^ 1}
    # When a worker takes it
    publish_framed(s, NAMES.tasks_exchange, RENDER, body, headers, "garbled-container")
    # Then it is parked whole, with the reason, and nothing of it runs
    (parked,) = poll(lambda: take_parked(s), 20, what="the container parked")
    parked_body, parked_headers, message_id = parked
    assert parked_body == body
    assert parked_headers["x-saga-reason"] == batch.REASON
    assert parked_headers["x-saga-source"] == RENDER
    assert message_id == "garbled-container"
    poll(lambda: s.queue_depths().get(RENDER, 0) == 0, 20, what="the container acked")


LOOKUP = NAMES.task_queue("tasks.actions", "cache.lookup@1")


def start_while_nothing_consumes(s: Stack, tag: str, count: int) -> list[str]:
    """Start ``count`` model-ingest runs while no orchestrator and no worker runs, then start the
    orchestrator: each shard takes its starts in one batch, so the runs' first tasks (one cache lookup
    each) leave in containers, which wait on the lookup queue as no worker runs."""
    s.stop("worker")
    s.stop("orchestrator")
    with SyncClient(s.settings) as client:
        run_ids = [client.start("model-ingest", {"modelId": f"{tag}-{i}"}) for i in range(count)]
    s.start_orchestrator("orchestrator")
    poll(lambda: s.queue_depths().get(LOOKUP, 0) > 0, 30, what="the runs' lookups dispatched")
    return run_ids


def test_tasks_of_different_runs_share_a_container_and_each_runs_once(
    stack: tuple[Stack, int, int],
) -> None:
    s, _, _ = stack
    # Given 40 runs whose first tasks were dispatched together (10 or so to each of the fast shards)
    run_ids = start_while_nothing_consumes(s, "across", 40)
    poll(lambda: all(s.record(r).get("status") for r in run_ids), 30, what="every run started")
    depth = poll(lambda: settled_depth(s, LOOKUP), 30, what="the lookups all dispatched")
    # Then the lookup queue holds fewer messages than lookups: some hold the lookups of several runs
    assert depth < len(run_ids), depth
    # When a worker runs, Then every run completes, each effect once, nothing refused
    s.start_worker("worker")
    for run_id in run_ids:
        assert s.wait_finished(run_id, timeout_s=60)["status"] == "completed", run_id
    assert_no_violations(check_runs(s.redis, s.prefix, run_ids), "the shared invariants")
    assert_nothing_refused(s)


def test_a_packed_task_with_no_free_slot_in_time_goes_back_alone_and_runs_once(
    stack: tuple[Stack, int, int],
) -> None:
    s, _, _ = stack
    # Given runs whose lookups take 1.5 s each, dispatched together in containers
    models = [f"spill-{i}" for i in range(8)]
    for model in models:
        s.world.set_fault(model, "cache.lookup", delay_ms=1500)
    run_ids = start_while_nothing_consumes(s, "spill", len(models))
    # When a worker with one slot takes them (it starts one lookup; the others wait for the slot)
    port = free_port()
    logged_before = len(s.log("worker"))
    s.start_worker("worker", "--concurrency", "1", "--metrics-port", str(port))
    # Then those that waited over a second went back to the queue one per message
    spilled = poll(
        lambda: total(scrape(port) or [], "saga_worker_tasks_spilled_total", contract="cache.lookup@1"),
        30,
        what="a packed lookup spilled",
    )
    assert spilled >= 1
    # and every run completes, each lookup's effect once, nothing refused
    for run_id in run_ids:
        assert s.wait_finished(run_id, timeout_s=90)["status"] == "completed", run_id
    assert_no_violations(check_runs(s.redis, s.prefix, run_ids), "the shared invariants")
    assert_nothing_refused(s)
    # and every container was acked, not given back whole and split (its tasks would then run again)
    logged = s.log("worker")[logged_before:]
    assert "could not send packed task" not in logged and "came back" not in logged, logged[-2000:]
    poll(lambda: s.queue_depths().get(LOOKUP, 0) == 0, 20, what="the lookup queue empty and acked")
    s.stop("worker")
    s.start_worker("worker")


# ---- helpers -----------------------------------------------------------------------------------------


def settled_depth(stack: Stack, queue: str) -> int | None:
    """The depth of ``queue`` once it is the same, and not 0, twice half a second apart (else None)."""
    first = stack.queue_depths().get(queue, 0)
    time.sleep(0.5)
    return first if first and stack.queue_depths().get(queue, 0) == first else None


def give_back_one(stack: Stack, queue: str, timeout_s: float = 20.0) -> dict[str, object]:
    """Take one message off ``queue`` and close the channel without acking it: the broker delivers it
    again, marked redelivered. Returns its headers."""

    async def go() -> dict[str, object]:
        connection = await aio_pika.connect(stack.settings.amqp_url)
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout_s
            while True:
                channel = await connection.channel()
                try:
                    source = await channel.declare_queue(queue, passive=True)
                    message = await source.get(no_ack=False, fail=False)
                except aio_pika.exceptions.ChannelClosed:  # not declared yet: nothing dispatched
                    message = None
                if message is not None:
                    await channel.close()  # unacked: back to the queue
                    return dict(message.headers or {})
                assert loop.time() < deadline, f"nothing came on {queue}"
                if not channel.is_closed:
                    await channel.close()
                await asyncio.sleep(0.05)
        finally:
            await connection.close()

    return asyncio.run(go())

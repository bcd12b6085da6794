"""Results checked at the door, on the real services: a correctly signed report of the current attempt
whose result breaks the output contract the run pins fails the attempt at the orchestrator, for good, with
the schema error in history, and the run fails; the result never becomes state.

No worker runs: the run's tasks wait on their contract queues, where the test takes them and answers as a
worker that skipped the SDK's own output check would (a report under the task's report id, signed with
the stack's key). The run pins its versions at creation, and ``saga status --json`` shows them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import aio_pika
import pytest

from orchestrator.bus import batch
from orchestrator.bus.envelope import Envelope, decode
from orchestrator.bus.names import Names
from orchestrator.client import SyncClient
from orchestrator.versions import COMPILER_VERSION, DSL_VERSION, ENGINE_VERSION
from orchestrator.wire import ids
from orchestrator.wire.kinds import Kind
from tests.integration.stack import Stack, poll

pytestmark = pytest.mark.services

NAMES = Names()  # the stack runs in the default namespace, on a vhost of its own
AUDIT = NAMES.task_queue("tasks.actions", "audit.run-terminal@1")


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    stack = Stack("result-contract")
    stack.setup()
    try:
        stack.start_orchestrator()  # and no worker: the test is the worker
        yield stack
    finally:
        stack.teardown()


@pytest.fixture(scope="module")
def client(stack: Stack) -> Iterator[SyncClient]:
    with SyncClient(stack.settings) as c:
        yield c


def take_tasks(stack: Stack, queue: str, count: int, timeout_s: float = 10.0) -> list[Envelope]:
    """Take at least ``count`` tasks off a contract queue (acked: no worker will see them), opened and
    verified like a worker opens and verifies them (a container holds several)."""

    async def go() -> list[Envelope]:
        connection = await aio_pika.connect(stack.settings.amqp_url)
        try:
            channel = await connection.channel()
            taken: list[Envelope] = []
            deadline = time.monotonic() + timeout_s
            while len(taken) < count:
                assert time.monotonic() < deadline, f"only {len(taken)} of {count} tasks came on {queue}"
                try:
                    source = await channel.declare_queue(queue, passive=True)
                except aio_pika.exceptions.ChannelClosed:  # not declared yet: nothing was dispatched
                    channel = await connection.channel()
                    await asyncio.sleep(0.05)
                    continue
                message = await source.get(no_ack=False, fail=False)
                if message is None:
                    await asyncio.sleep(0.05)
                    continue
                limit = stack.settings.max_message_bytes
                if batch.is_container(message.headers):  # a bag's item tasks packed together
                    payloads = batch.unpack(message.body, message.headers or {}, limit)
                else:
                    payloads = [message.body]
                taken += [decode(payload, stack.signer, limit) for payload in payloads]
                await message.ack()
            return taken
        finally:
            await connection.close()

    return asyncio.run(go())


def answer(stack: Stack, task: Envelope, result: Any) -> None:
    """Report success with ``result`` on ``task``, as a worker would, but with no output check."""
    report = Envelope(
        kind=Kind.RESULT,
        message_id=ids.result_id(task.message_id),
        run_id=task.run_id,
        shard=task.shard,
        stage=task.stage,
        attempt=task.attempt,
        fence=task.fence,
        item=task.item,
        digest=task.digest,
        contract=task.contract,
        tenant=task.tenant,
        issued_at_ms=int(time.time() * 1000),
        body={"ok": True, "result": result},
    )
    stack.publish_envelope(report, NAMES.runs_exchange, task.shard)


def failures(stack: Stack, run_id: str, stage: str) -> list[dict[str, Any]]:
    return [e for e in stack.history(run_id) if e["kind"] == "stage.failed" and e["stage"] == stage]


def finish_with_the_audit(stack: Stack, run_id: str) -> dict[str, str]:
    """Answer the run's finaliser with a result that fits; the run then ends."""
    (audit,) = take_tasks(stack, AUDIT, 1)
    assert audit.run_id == run_id
    answer(stack, audit, {"recorded": True})
    return stack.wait_finished(run_id, timeout_s=10)


def test_a_result_that_breaks_the_contract_fails_the_attempt_and_the_run(
    stack: Stack, client: SyncClient
) -> None:
    # Given a model-ingest run whose first task (cache.lookup@1) waits on its queue
    run_id = client.start("model-ingest", {"modelId": "breach-1"})
    (task,) = take_tasks(stack, NAMES.task_queue("tasks.actions", "cache.lookup@1"), 1)
    assert (task.run_id, task.stage) == (run_id, "cache-lookup")

    # When a validly signed report of that very attempt carries a result that breaks the contract
    answer(stack, task, {"modelId": "breach-1", "hit": "yes"})

    # Then the orchestrator fails the attempt for good, with the schema error in history
    (failed,) = poll(lambda: failures(stack, run_id, "cache-lookup"), 10, what="the attempt failed")
    error = (
        "the result does not fit the output schema of cache.lookup@1: "
        "result.hit: 'yes' is not of type 'boolean'"
    )
    assert failed["detail"] == {"error": error, "retryable": False, "reason": "contract"}
    record = stack.record(run_id)
    assert record["s:cache-lookup:status"] == "failed"
    assert "s:cache-lookup:result" not in record  # it never became state
    assert record["intent"] == "failed" and record["reason"] == f"cache-lookup: {error}"
    # and the run fails, through its finaliser
    assert finish_with_the_audit(stack, run_id)["status"] == "failed"
    kinds = [e["kind"] for e in stack.history(run_id)]
    assert "retry.scheduled" not in kinds and "decision.taken" not in kinds
    assert kinds[-2:] == ["finaliser.completed", "run.failed"]

    # And the run pinned the versions of its plan and of the engine that created it
    status = stack.saga_json("status", run_id)
    assert status["versions"]["plan"] == {"compiler": COMPILER_VERSION, "dsl": DSL_VERSION, "engine": "1"}
    assert status["versions"]["engine"] == ENGINE_VERSION
    assert "cache.lookup@1" in status["versions"]["contracts"]


def test_a_map_item_that_breaks_the_contract_fails_the_map(stack: Stack, client: SyncClient) -> None:
    # Given a bag of two renders waiting on their queue
    run_id = client.start("thumbnail-batch", {"modelIds": ["a", "b"]})
    tasks = take_tasks(stack, NAMES.task_queue("tasks.parallel", "thumbnail.render@3"), 2)
    first, second = sorted(tasks, key=lambda t: t.item or 0)
    assert {t.run_id for t in tasks} == {run_id} and (first.item, second.item) == (0, 1)

    # When item 0 reports a result that fits, and item 1 one without its required field
    answer(stack, first, {"thumbnailUri": "thumbs/a.png"})
    poll(lambda: stack.record(run_id).get("b:render-all") == "1", 10, what="item 0 arrived")
    answer(stack, second, {"thumbnail": "thumbs/b.png"})

    # Then item 1 fails the map for good (the map allows two attempts per item), and the run fails
    (failed,) = poll(lambda: failures(stack, run_id, "render-all"), 10, what="the item failed")
    assert failed["detail"]["item"] == 1 and failed["detail"]["reason"] == "contract"
    assert failed["detail"]["error"].endswith(
        "thumbnail.render@3: result: 'thumbnailUri' is a required property"
    )
    assert stack.record(run_id)["s:render-all:status"] == "failed"
    assert finish_with_the_audit(stack, run_id)["status"] == "failed"
    assert "retry.scheduled" not in [e["kind"] for e in stack.history(run_id)]

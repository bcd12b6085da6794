"""Validly signed garbage through RabbitMQ into a real orchestrator process, while a run waits.

The strategies of ``garbage.py`` draw the messages; they are published, correctly signed, onto the
run's shard queue while its first task waits for a worker (the worker process is stopped). Then: the
orchestrator is still running and logged no failed transition, nothing was dead-lettered, every message
left exactly one trace (parked on ``saga.rejected`` with its reason, or one rejection in the run's
history), the run's record did not change, and once a worker is back the run completes normally.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import aio_pika
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.bus.names import Names
from orchestrator.client import SyncClient
from orchestrator.store.spec import snapshot_from_record
from tests.faults import invariants
from tests.integration.garbage import Target, garbage, is_legitimate, sign
from tests.integration.stack import Stack, poll, running
from tests.unit.redrive_cases import compiled

NAMES = Names()  # the stack runs in the default namespace, on a vhost of its own

pytestmark = pytest.mark.services


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with running("garbage") as s:
        yield s


async def publish_all(stack: Stack, shard: str, bodies: list[bytes]) -> None:
    connection = await aio_pika.connect(stack.settings.amqp_url)
    try:
        channel = await connection.channel(publisher_confirms=True)
        exchange = await channel.get_exchange(NAMES.runs_exchange, ensure=False)
        for body in bodies:
            message = aio_pika.Message(body, delivery_mode=aio_pika.DeliveryMode.PERSISTENT)
            await exchange.publish(message, routing_key=shard, mandatory=True)
    finally:
        await connection.close()


def rejections(stack: Stack, run_id: str) -> int:
    return sum(e["kind"] == "callback.rejected" for e in stack.history(run_id))


def test_signed_garbage_through_the_broker_changes_nothing_and_crashes_nothing(stack: Stack) -> None:
    # Given a live run whose first task waits for a worker
    stack.stop("worker")
    client = SyncClient(stack.settings)
    run_id = client.start("model-ingest", {"modelId": "garbage-e2e"})
    poll(lambda: stack.record(run_id).get("s:cache-lookup:status") == "dispatched", 20, what="cache-lookup")
    record = stack.record(run_id)
    shard = record["shard"]
    other = next(s for s in ("fast.0", "fast.1") if s != shard)
    target = Target(run_id, shard, record["digest"], tuple(compiled("model-ingest").plan["stages"]), other)
    snapshot = snapshot_from_record(record, {})
    drawn: list[bytes] = []

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def draw(data: st.DataObject) -> None:
        fields = data.draw(garbage(target))
        if not is_legitimate(fields, snapshot, target):
            drawn.append(sign(stack.signer, fields))

    draw()
    parked_before = stack.queue_depths().get(NAMES.rejected_queue, 0)
    recorded_before = rejections(stack, run_id)

    # When they are published onto the run's shard queue
    asyncio.run(publish_all(stack, shard, drawn))

    # Then each left exactly one trace: parked with its reason, or one rejection in the run's history
    def traces() -> int:
        parked = stack.queue_depths().get(NAMES.rejected_queue, 0) - parked_before
        return parked + rejections(stack, run_id) - recorded_before

    poll(lambda: traces() >= len(drawn), 60, what=f"{len(drawn)} refusals")
    assert traces() == len(drawn)
    depths = stack.queue_depths()
    assert all(depths.get(q, 0) == 0 for q in depths if q.endswith(".dlq")), depths
    assert stack.record(run_id) == record
    orchestrator = stack.processes["orchestrator"]
    assert orchestrator.poll() is None, "the orchestrator died"
    log = stack.log("orchestrator")
    assert "Traceback" not in log and "failed on" not in log, log[-3000:]

    # And once a worker is back, the run completes as if nothing had happened
    stack.start_worker()
    result = client.wait(run_id, timeout_s=30)
    assert result.state == "completed", result
    assert result.output == {"modelId": "garbage-e2e", "catalogueId": "cat-garbage-e2e"}
    assert not [e for e in stack.history(run_id) if e["kind"] == "message.poisoned"]
    # and the fault suite's shared invariants hold (the refusals parked on saga.rejected are expected)
    violations = invariants.check_runs(stack.redis, stack.prefix, [run_id], all_runs=True)
    depths = {q: n for q, n in stack.queue_depths().items() if q.endswith(".dlq")}
    invariants.assert_no_violations(violations + invariants.dead_letters(depths), "signed garbage")

"""``saga dead-letters`` against the real broker: messages reach the dead-letter queues the real way (a
refusal without requeue, a delivery limit spent, ``Publisher.reject``), and the commands run as subprocesses.

Each test has a stack (vhost and key prefix) of its own, so the queue counts it asserts are its own. No
orchestrator or worker runs: what a replay puts back on a queue stays there to be counted.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import aio_pika
import pytest

from orchestrator.bus.envelope import Envelope, encode
from orchestrator.bus.names import Names
from orchestrator.bus.publisher import Publisher
from orchestrator.wire.kinds import Kind
from tests.integration.stack import ROOT, Stack, poll

NAMES = Names()  # the stack runs in the default namespace, on a vhost of its own
# Contract queues that topology apply declares for the demo contracts, and the dead-letter queues they share
PARALLEL = NAMES.task_queue("tasks.parallel", "thumbnail.render@3")
ACTIONS = NAMES.task_queue("tasks.actions", "catalogue.publish@2")
PARALLEL_DLQ = NAMES.task_dead_letters("tasks.parallel")
ACTIONS_DLQ = NAMES.task_dead_letters("tasks.actions")
DLQ_OF = {PARALLEL: PARALLEL_DLQ, ACTIONS: ACTIONS_DLQ}

pytestmark = pytest.mark.services

GARBAGE = b"\x1b[31mnot json\x00\xff"


@pytest.fixture
def stack() -> Iterator[Stack]:
    s = Stack("deadletters")
    s.setup()
    try:
        yield s
    finally:
        s.teardown()


def saga(stack: Stack, *args: str) -> subprocess.CompletedProcess[str]:
    return stack.saga("dead-letters", *args)


def saga_json(stack: Stack, *args: str) -> Any:
    return stack.saga_json("dead-letters", *args)


def task(stage: str = "render-thumbnail") -> Envelope:
    run_id = uuid.uuid4().hex
    return Envelope(
        kind=Kind.TASK,
        message_id=f"task-{run_id}",
        run_id=run_id,
        shard="fast.0",
        stage=stage,
        attempt=1,
        fence="1.1",
        body={"input": {"modelId": "m-1"}},
    )


def depth(stack: Stack, queue: str) -> int:
    """Ready messages, from the queue itself (rabbitmqctl's counts lag by seconds)."""

    async def go() -> int:
        connection = await aio_pika.connect(stack.settings.amqp_url)
        try:
            channel = await connection.channel()
            declared = await channel.declare_queue(queue, passive=True)
            return declared.declaration_result.message_count or 0
        finally:
            await connection.close()

    return asyncio.run(go())


def wait_depth(stack: Stack, queue: str, expected: int) -> None:
    poll(lambda: depth(stack, queue) == expected, 10, what=f"{queue} to hold {expected} messages")


async def _take(stack: Stack, queue: str, settle: str, times: int = 1) -> None:
    """Get the next message of ``queue`` ``times`` times and settle it as a worker would: ``reject`` (refused
    without requeue) or ``requeue`` (a nack with requeue, which spends the delivery limit)."""
    connection = await aio_pika.connect(stack.settings.amqp_url)
    try:
        channel = await connection.channel()
        source = await channel.get_queue(queue, ensure=False)
        for _ in range(times):
            message = await source.get(no_ack=False, timeout=10)
            await (message.reject(requeue=False) if settle == "reject" else message.nack(requeue=True))
    finally:
        await connection.close()


def publish_task(stack: Stack, queue: str, envelope: Envelope) -> None:
    """Publish a signed task as the orchestrator does (confirmed, its envelope id as message id)."""

    async def go() -> None:
        connection = await aio_pika.connect(stack.settings.amqp_url)
        try:
            channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
            signed = stack.signer.sign(envelope)
            publisher = Publisher(channel, stack.signer, NAMES)
            await publisher.publish_envelope(signed, NAMES.tasks_exchange, queue)
        finally:
            await connection.close()

    asyncio.run(go())


def dead_letter_task(stack: Stack, queue: str, envelope: Envelope) -> None:
    """Publish a task to ``queue`` and refuse it without requeue: the broker dead-letters it."""
    publish_task(stack, queue, envelope)
    asyncio.run(_take(stack, queue, "reject"))
    wait_depth(stack, DLQ_OF[queue], 1)


def refuse(stack: Stack, raw: bytes, reason: str, detail: str, source: str) -> None:
    """Park a message on saga.rejected exactly as the orchestrator and workers do."""

    async def go() -> None:
        connection = await aio_pika.connect(stack.settings.amqp_url)
        try:
            channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
            await Publisher(channel, stack.signer, NAMES).reject(raw, reason, detail, source)
        finally:
            await connection.close()

    asyncio.run(go())


def take_all(stack: Stack, queue: str) -> list[aio_pika.abc.AbstractIncomingMessage]:
    """Consume (and ack) every message ready on ``queue``, then check that none is left. A consumer, not
    basic.get: shard queues have a single active consumer, which basic.get cannot share."""

    async def go() -> list[aio_pika.abc.AbstractIncomingMessage]:
        connection = await aio_pika.connect(stack.settings.amqp_url)
        try:
            channel = await connection.channel()
            source = await channel.declare_queue(queue, passive=True)
            ready = source.declaration_result.message_count or 0
            taken: list[aio_pika.abc.AbstractIncomingMessage] = []
            if ready:
                async with source.iterator(timeout=10) as messages:
                    async for message in messages:
                        await message.ack()
                        taken.append(message)
                        if len(taken) == ready:
                            break
            left = await channel.declare_queue(queue, passive=True)
            assert left.declaration_result.message_count == 0, f"{queue} still holds messages"
            return taken
        finally:
            await connection.close()

    return asyncio.run(go())


def listed(stack: Stack, *args: str) -> dict[str, dict[str, Any]]:
    return {q["queue"]: q for q in saga_json(stack, "list", *args)["queues"]}


# ---- list and show -------------------------------------------------------------------------------------


def test_list_and_show_describe_every_dead_letter_and_leave_it_in_place(stack: Stack) -> None:
    # Given a task a worker refused, a forged message refused on a shard queue, and garbage a worker
    # refused on a queue it could not name
    dead = task()
    dead_letter_task(stack, PARALLEL, dead)
    forged = stack.signer.sign(task()).model_copy(update={"signature": "0" * 64})
    forged_raw = forged.model_dump_json().encode()
    refuse(
        stack,
        forged_raw,
        "bad-signature",
        f"message {forged.message_id} has a bad signature",
        "saga.shard.fast.0",
    )
    refuse(stack, GARBAGE, "malformed", "message: Invalid JSON", "")
    wait_depth(stack, NAMES.rejected_queue, 2)

    # When the dead letters are listed
    queues = listed(stack)

    # Then each queue has its count and each message what it is, why it died and where it came from
    dlq = queues[PARALLEL_DLQ]
    assert dlq["exists"] and dlq["count"] == 1
    [entry] = dlq["messages"]
    assert entry["message_id"] == dead.message_id and entry["amqp_message_id"] == dead.message_id
    assert (entry["kind"], entry["run_id"], entry["stage"]) == ("task", dead.run_id, "render-thumbnail")
    assert (entry["reason"], entry["death_count"], entry["origin"]) == ("rejected", 1, PARALLEL)
    rejected = queues[NAMES.rejected_queue]
    assert rejected["count"] == 2
    first, garbage = rejected["messages"]
    assert (first["message_id"], first["kind"], first["run_id"]) == (forged.message_id, "task", forged.run_id)
    assert first["reason"] == "bad-signature" and forged.message_id in first["detail"]
    assert first["origin"] == "saga.shard.fast.0"
    assert garbage["kind"] is None and garbage["reason"] == "malformed" and garbage["origin"] is None
    assert garbage["message_id"] == garbage["amqp_message_id"]  # no envelope: the AMQP id names it
    assert all(
        q["count"] == 0 for name, q in queues.items() if name not in (NAMES.rejected_queue, dlq["queue"])
    )
    # shard and contract queues too
    assert "saga.shard.fast.0.dlq" in queues and NAMES.task_dead_letters("rendering") in queues

    # When they are shown, one by one
    [shown] = saga_json(stack, "show", dead.message_id)
    [shown_garbage] = saga_json(stack, "show", garbage["message_id"], "--queue", NAMES.rejected_queue)

    # Then headers and body are there: the body decoded, garbage as base64
    assert shown["queue"] == PARALLEL_DLQ
    assert shown["headers"]["x-death"][0]["queue"] == PARALLEL
    assert shown["body_format"] == "json" and shown["body"]["run_id"] == dead.run_id
    assert shown["properties"]["message_id"] == dead.message_id
    assert shown_garbage["headers"]["x-saga-reason"] == "malformed"
    assert shown_garbage["body_format"] == "base64"

    # And the text forms never print a control character a hostile message carried
    text = saga(stack, "show", garbage["message_id"])
    assert text.returncode == 0, text.stderr
    assert "\x1b" not in text.stdout and "\\x1b[31mnot json\\x00" in text.stdout
    text = saga(stack, "list")
    assert text.returncode == 0, text.stderr
    assert (
        dead.message_id in text.stdout and "rejected x1" in text.stdout and f"from {PARALLEL}" in text.stdout
    )

    # And every message is still where it was, in the same order, each read counted as a delivery
    assert depth(stack, PARALLEL_DLQ) == 1 and depth(stack, NAMES.rejected_queue) == 2
    again = listed(stack)
    assert [m["message_id"] for m in again[NAMES.rejected_queue]["messages"]] == [
        first["message_id"],
        garbage["message_id"],
    ]
    assert again[PARALLEL_DLQ]["messages"][0]["delivery_count"] > entry["delivery_count"]


def test_a_message_over_the_delivery_limit_is_listed_with_that_reason(stack: Stack) -> None:
    # Given a task handed back more often than the queue's delivery limit allows
    poison = task("poison")
    publish_task(stack, PARALLEL, poison)
    asyncio.run(_take(stack, PARALLEL, "requeue", stack.settings.delivery_limit + 1))
    wait_depth(stack, PARALLEL_DLQ, 1)

    # When its dead-letter queue is listed
    [entry] = listed(stack, "--queue", PARALLEL_DLQ)[PARALLEL_DLQ]["messages"]

    # Then the broker's reason says so
    assert (entry["message_id"], entry["reason"], entry["origin"]) == (
        poison.message_id,
        "delivery_limit",
        PARALLEL,
    )


# ---- replay ----------------------------------------------------------------------------------------------


def test_replay_puts_a_message_back_on_its_queue_exactly_once(stack: Stack) -> None:
    # Given a dead-lettered task next to another one, and a refused message that names its shard queue
    dead, other = task(), task()
    dead_letter_task(stack, ACTIONS, dead)
    publish_task(stack, ACTIONS, other)
    asyncio.run(_take(stack, ACTIONS, "reject"))
    wait_depth(stack, ACTIONS_DLQ, 2)
    refused = stack.signer.sign(task())
    refuse(
        stack,
        refused.model_dump_json().encode(),
        "unknown-key",
        "key id 'old' is not configured",
        "saga.shard.fast.1",
    )

    # When one of them is replayed by id
    done = saga(stack, "replay", dead.message_id)

    # Then it is back on tasks.actions once, and only it left the dead-letter queue
    assert done.returncode == 0, done.stderr
    assert f"replayed {dead.message_id} from {ACTIONS_DLQ} to {ACTIONS}" in done.stdout
    wait_depth(stack, ACTIONS_DLQ, 1)
    [back] = take_all(stack, ACTIONS)
    assert back.message_id == dead.message_id
    # a task goes back as it was (bus/reissue.py issues again only what a shard takes: a worker takes a task
    # whatever its age, up to its deadline)
    assert back.body == encode(stack.signer.sign(dead))
    assert "x-saga-reissued-by" not in back.headers
    assert (
        back.headers[  # the replayed copy says where it came from, not how it died
            "x-saga-replayed-from"
        ]
        == ACTIONS_DLQ
        and "x-death" not in back.headers
    )
    [left] = listed(stack, "--queue", ACTIONS_DLQ)[ACTIONS_DLQ]["messages"]
    assert left["message_id"] == other.message_id

    # When the refused message is replayed: it goes to the queue it was refused on, with its envelope id
    done = saga(stack, "replay", refused.message_id, "--queue", NAMES.rejected_queue)
    assert done.returncode == 0, done.stderr
    wait_depth(stack, NAMES.rejected_queue, 0)
    [back] = take_all(stack, "saga.shard.fast.1")
    assert back.message_id == refused.message_id and "x-saga-reason" not in back.headers

    # When everything left is replayed
    done = saga(stack, "replay", "--all")
    assert done.returncode == 0, done.stderr
    wait_depth(stack, ACTIONS_DLQ, 0)
    assert [m.message_id for m in take_all(stack, ACTIONS)] == [other.message_id]


def test_a_refused_message_that_names_no_queue_is_not_replayed(stack: Stack) -> None:
    # Given garbage refused on a queue nobody recorded
    refuse(stack, GARBAGE, "malformed", "message: Invalid JSON", "")
    [entry] = listed(stack, "--queue", NAMES.rejected_queue)[NAMES.rejected_queue]["messages"]

    # When it is replayed
    done = saga(stack, "replay", entry["message_id"])

    # Then the command says why not, with the id, and the message stays
    assert done.returncode == 1
    assert entry["message_id"] in done.stderr and "x-saga-source header is missing" in done.stderr
    assert depth(stack, NAMES.rejected_queue) == 1


@pytest.mark.parametrize(
    ("args", "code", "says"),
    [
        (("show", "no-such-id"), 1, "message 'no-such-id' is not on any of"),
        (("replay", "no-such-id", "--queue", PARALLEL_DLQ), 1, f"is not on {PARALLEL_DLQ}"),
        (("show", "x", "--queue", "saga.task.nope.dlq"), 1, "'saga.task.nope.dlq' does not exist"),
        (("list", "--queue", PARALLEL), 2, f"'{PARALLEL}' is not a dead-letter queue"),
        (("replay",), 2, "give either a MESSAGE_ID or --all"),
        (("replay", "x", "--all"), 2, "give either a MESSAGE_ID or --all"),
    ],
)
def test_errors_name_what_is_missing(stack: Stack, args: tuple[str, ...], code: int, says: str) -> None:
    done = saga(stack, *args)
    assert done.returncode == code, (done.stdout, done.stderr)
    assert says in done.stderr and "Traceback" not in done.stderr


def test_an_unreachable_broker_is_a_configuration_error(stack: Stack) -> None:
    env = {**stack.env, "SAGA_AMQP_URL": "amqp://guest:secret@127.0.0.1:1/"}
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator", "dead-letters", "list", "--queue", NAMES.rejected_queue],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2 and "cannot connect to RabbitMQ" in done.stderr
    assert "secret" not in done.stderr

"""The pure half of ``orchestrator.deadletters``: what a dead letter is, where it goes back, how it prints."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from orchestrator.bus.names import Names
from orchestrator.bus.topology import build_topology
from orchestrator.deadletters import (
    REPLAYED_FROM_HEADER,
    NotADeadLetterQueue,
    NotReplayable,
    body_document,
    dead_letter_queues,
    describe,
    is_dead_letter_queue,
    jsonable,
    printable,
    render_body,
    replay_headers,
    replay_target,
    require_dead_letter_queue,
)
from orchestrator.shardmap import ShardMap

NAMES = Names()
REJECTED_QUEUE = NAMES.rejected_queue
ENVELOPE = json.dumps(
    {"kind": "task", "message_id": "task-1", "run_id": "run-1", "stage": "render", "body": {}}
).encode()
DEATH = {
    "x-death": [
        {"count": 3, "reason": "delivery_limit", "queue": "tasks.parallel", "time": datetime(2026, 1, 1)},
        {"count": 1, "reason": "rejected", "queue": "tasks.actions"},
    ],
    "x-delivery-count": 4,
}


def test_a_broker_dead_letter_says_its_newest_death_and_where_it_came_from() -> None:
    letter = describe("tasks.parallel.dlq", DEATH, "task-1", ENVELOPE)
    assert (letter.message_id, letter.kind, letter.run_id, letter.stage) == (
        "task-1",
        "task",
        "run-1",
        "render",
    )
    assert (letter.reason, letter.death_count, letter.origin) == ("delivery_limit", 3, "tasks.parallel")
    assert letter.delivery_count == 4 and letter.detail is None
    assert replay_target(letter) == "tasks.parallel"


def test_a_refused_message_is_named_by_its_envelope_id_not_the_random_amqp_id() -> None:
    headers = {"x-saga-reason": "bad-signature", "x-saga-detail": b"bad mac", "x-saga-source": "orch.fast.2"}
    letter = describe(REJECTED_QUEUE, headers, "0f0f", ENVELOPE)
    assert letter.message_id == "task-1" and letter.amqp_message_id == "0f0f"
    assert letter.matches("task-1") and letter.matches("0f0f") and not letter.matches("other")
    assert (letter.reason, letter.detail, letter.origin) == ("bad-signature", "bad mac", "orch.fast.2")
    assert replay_target(letter) == "orch.fast.2"


@pytest.mark.parametrize(
    ("queue", "headers", "says"),
    [
        (
            REJECTED_QUEUE,
            {"x-saga-reason": "malformed", "x-saga-source": ""},
            "x-saga-source header is missing",
        ),
        ("tasks.parallel.dlq", {}, "no x-death header"),
        ("tasks.parallel.dlq", {"x-death": [{"queue": "tasks.serial.dlq", "reason": "expired"}]}, "itself a"),
    ],
    ids=["refused-without-source", "no-x-death", "from-a-dead-letter-queue"],
)
def test_a_dead_letter_that_names_no_live_queue_is_not_replayable(
    queue: str, headers: dict[str, object], says: str
) -> None:
    letter = describe(queue, headers, "m-7", b"{}")
    with pytest.raises(NotReplayable, match=says) as caught:
        replay_target(letter)
    assert caught.value.message_id == "m-7" and f"stays on {queue}" in str(caught.value)


@pytest.mark.parametrize(
    "body",
    [b"\xff\xfe garbage", b"[1, 2]", b"", b'{"message_id": 7}'],
    ids=["bytes", "list", "empty", "bad-id"],
)
def test_describe_never_raises_and_always_finds_an_id(body: bytes) -> None:
    without_amqp_id = describe(REJECTED_QUEUE, None, None, body)
    assert without_amqp_id.message_id.startswith("sha256:") and without_amqp_id.kind is None
    assert describe(REJECTED_QUEUE, None, "amqp-1", body).message_id == "amqp-1"
    assert without_amqp_id.reason == "unknown" and without_amqp_id.origin is None


def test_only_dead_letter_queues_may_be_read() -> None:
    assert is_dead_letter_queue("saga.shard.fast.0.dlq") and is_dead_letter_queue(REJECTED_QUEUE)
    assert require_dead_letter_queue("saga.task.rendering.dlq", NAMES) == "saga.task.rendering.dlq"
    for live in ("saga.shard.fast.0", "saga.task.tasks.parallel:x@1", "rendering"):
        with pytest.raises(NotADeadLetterQueue, match=f"'{live}' is not a dead-letter queue"):
            require_dead_letter_queue(live, NAMES)


def test_another_namespace_s_dead_letters_are_not_this_one_s() -> None:
    with pytest.raises(NotADeadLetterQueue, match="of namespace 'demo'"):
        require_dead_letter_queue("saga.task.tasks.parallel.dlq", Names("demo"))


def test_every_dead_letter_queue_of_the_topology_is_searched() -> None:
    topology = build_topology(
        NAMES, ShardMap.seed(("fast",), 2), [("rendering", "r@1"), ("tasks.serial", "r@1")], 20
    )
    assert dead_letter_queues(topology, NAMES) == [
        "saga.shard.fast.0.dlq",
        "saga.shard.fast.1.dlq",
        "saga.task.rendering.dlq",
        "saga.task.tasks.serial.dlq",
        REJECTED_QUEUE,
    ]


def test_the_replayed_copy_drops_how_it_died_and_says_where_it_was() -> None:
    headers = {**DEATH, "x-first-death-queue": "q", "x-saga-reason": "r", "x-saga-source": "s", "tenant": "t"}
    assert replay_headers(headers, "tasks.parallel.dlq") == {
        "tenant": "t",
        REPLAYED_FROM_HEADER: "tasks.parallel.dlq",
    }


def test_header_values_become_json() -> None:
    value = {"time": datetime(2026, 1, 1, tzinfo=UTC), "raw": b"\xff", "text": b"ok", "n": [1, None, True]}
    assert jsonable(value) == {
        "time": "2026-01-01T00:00:00+00:00",
        "raw": "base64:/w==",
        "text": "ok",
        "n": [1, None, True],
    }


def test_bodies_print_safely() -> None:
    assert json.loads(render_body(ENVELOPE)) == json.loads(ENVELOPE)
    hostile = b"\x1b[2J\xff\xe2\x80\xaeevil\n"
    shown = render_body(hostile)
    assert "\x1b" not in shown and "\u202e" not in shown
    assert shown.startswith(f"({len(hostile)} bytes, not JSON") and "\\x1b[2J\\xff\\u202eevil" in shown
    assert printable("a\nb", keep_newlines=False) == "a\\nb"
    assert body_document(b"\x00") == {"body_format": "base64", "body": "AA=="}
    assert body_document(b'{"a": 1}') == {"body_format": "json", "body": {"a": 1}}

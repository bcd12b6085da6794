"""What the API refuses at the door, and how its errors are written, without services."""

from __future__ import annotations

import json

import pytest

from orchestrator.bus.names import Names
from orchestrator.deadletters import NotADeadLetterQueue, require_dead_letter_queue
from orchestrator.server.bodies import unencodable
from orchestrator.server.errors import MAX_PROBLEM_LINES, ErrorResponse, document


def test_a_lone_surrogate_anywhere_in_a_json_body_is_refused() -> None:
    assert unencodable(b'{"reason": "x\\ud800"}') is not None
    assert unencodable(b'{"context": {"a": ["ok", {"\\udfff": 1}]}}') is not None
    assert unencodable('{"name": "é 🎉 \\u00e9"}'.encode()) is None  # real Unicode is fine
    assert unencodable(b"not json") is None  # the route's own validation answers that


def test_errors_that_repeat_what_was_sent_are_always_sendable_and_bounded() -> None:
    body = ErrorResponse(document("x", "name 'a\ud800' is invalid", {"name": "a\ud800"})).body
    assert json.loads(body)["error"]["ids"]["name"] == "a\ud800"
    problems = "definition has 500 problems:\n" + "\n".join(f"f.yaml:{i}: x: bad" for i in range(500))
    message = document("definition_invalid", problems, {})["error"]["message"]
    assert len(message.splitlines()) == MAX_PROBLEM_LINES + 2 and message.endswith("... and 450 more")


@pytest.mark.parametrize("queue", ["saga." + "q" * 300 + ".dlq", "saga.\x00.dlq", "saga.é.dlq", "saga.runs"])
def test_a_queue_name_amqp_cannot_carry_is_not_a_dead_letter_queue(queue: str) -> None:
    with pytest.raises(NotADeadLetterQueue):
        require_dead_letter_queue(queue, Names("saga"))


def test_real_dead_letter_queues_pass() -> None:
    names = Names("saga")
    for queue in ("saga.rejected", "saga.task.tasks.parallel.dlq", "saga.shard.fast.0.dlq"):
        assert require_dead_letter_queue(queue, names) == queue

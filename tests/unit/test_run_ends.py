"""What a run's end announcement carries, as a waiter reads it; one that does not parse is none."""

from __future__ import annotations

import json

import pytest

from orchestrator.run_ends import Ending, parse_ending


def test_an_announcement_carries_state_output_and_reason() -> None:
    data = json.dumps({"state": "completed", "output": json.dumps({"published": True, "n": 2})})
    assert parse_ending(data) == Ending("completed", {"published": True, "n": 2}, None)
    refused = json.dumps({"state": "refused", "reason": "plan sha256:00 is not a published version"})
    assert parse_ending(refused.encode()) == Ending(
        "refused", None, "plan sha256:00 is not a published version"
    )


@pytest.mark.parametrize(
    "data", [None, "", "failed", "[]", '{"output": "{}"}', '{"state": "x", "output": "{"}']
)
def test_an_announcement_that_does_not_parse_is_none(data: object) -> None:
    assert parse_ending(data) is None

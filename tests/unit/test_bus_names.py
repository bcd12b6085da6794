"""Every AMQP name comes from orchestrator.bus.names; parse_shards turns --shards options into shard ids."""

from __future__ import annotations

import pytest

from orchestrator.bus import names
from orchestrator.bus.names import (
    BUILTIN_TASK_QUEUES,
    dead_letter_queue,
    parse_shards,
    shard_id,
    shard_queue,
    start_exchange,
)


def test_fixed_names() -> None:
    assert names.RUNS_EXCHANGE == "saga.runs"
    assert names.TASKS_EXCHANGE == "saga.tasks"
    assert names.EVENTS_EXCHANGE == "saga.events"
    assert names.DEAD_LETTER_EXCHANGE == "saga.dlx"
    assert names.REJECTED_QUEUE == "saga.rejected"
    assert BUILTIN_TASK_QUEUES == ("tasks.serial", "tasks.parallel", "tasks.actions")


def test_builtin_task_queues_match_the_contract_defaults() -> None:
    from orchestrator.contracts import ACTIONS_QUEUE, PARALLEL_QUEUE, SERIAL_QUEUE

    assert (names.SERIAL_TASKS, names.PARALLEL_TASKS, names.ACTION_TASKS) == (
        SERIAL_QUEUE,
        PARALLEL_QUEUE,
        ACTIONS_QUEUE,
    )


def test_derived_names() -> None:
    assert shard_id("fast", 3) == "fast.3"
    assert shard_queue("fast.3") == "orch.fast.3"
    assert shard_queue(shard_id("slow", 0)) == "orch.slow.0"
    assert start_exchange("fast") == "saga.start.fast"
    assert dead_letter_queue("orch.fast.3") == "orch.fast.3.dlq"
    assert dead_letter_queue("rendering") == "rendering.dlq"


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("0-3", ["fast.0", "fast.1", "fast.2", "fast.3"]),
        ("1,3", ["fast.1", "fast.3"]),
        ("2", ["fast.2"]),
        ("2-2", ["fast.2"]),
        ("0-1,3", ["fast.0", "fast.1", "fast.3"]),
        (" 3 , 1 ", ["fast.1", "fast.3"]),  # spaces ignored, numbers sorted
        ("1,1,0-1", ["fast.0", "fast.1"]),  # duplicates collapse
        ("", ["fast.0", "fast.1", "fast.2", "fast.3"]),  # empty = every shard
        (" , ", ["fast.0", "fast.1", "fast.2", "fast.3"]),
    ],
)
def test_parse_shards(spec: str, expected: list[str]) -> None:
    assert parse_shards(spec, ("fast",), 4) == expected


def test_parse_shards_spans_every_class_class_major() -> None:
    assert parse_shards("0-1", ("fast", "slow"), 4) == ["fast.0", "fast.1", "slow.0", "slow.1"]
    assert parse_shards("", ("fast", "slow"), 2) == ["fast.0", "fast.1", "slow.0", "slow.1"]


@pytest.mark.parametrize("spec", ["4", "0-4", "2,9", "100"])
def test_parse_shards_out_of_range(spec: str) -> None:
    with pytest.raises(ValueError, match=r"outside 0-3 \(SAGA_SHARD_COUNT=4\)"):
        parse_shards(spec, ("fast",), 4)


@pytest.mark.parametrize("spec", ["a", "1-b", "-1", "1--2", "1-2-3", "one", "1;2", "0x1", "1.5"])
def test_parse_shards_malformed(spec: str) -> None:
    with pytest.raises(ValueError, match="is not N or N-M") as info:
        parse_shards(spec, ("fast",), 4)
    assert repr(spec) in str(info.value)  # the message quotes the offending part


def test_parse_shards_reversed_range_raises() -> None:
    with pytest.raises(ValueError, match="reversed"):
        parse_shards("3-1", ("fast",), 4)

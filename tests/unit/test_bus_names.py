"""Every AMQP name comes from orchestrator.bus.names, under the namespace; parse_shards turns --shards
options into shard ids."""

from __future__ import annotations

import pytest

from orchestrator.bus.names import (
    ACTION_TASKS,
    BUILTIN_TASK_QUEUES,
    PARALLEL_TASKS,
    SERIAL_TASKS,
    Names,
    dead_letter_queue,
    parse_shards,
    shard_id,
)


def test_fixed_names_carry_the_namespace() -> None:
    for names, ns in ((Names(), "saga"), (Names("demo"), "demo")):
        assert names.runs_exchange == f"{ns}.runs"
        assert names.tasks_exchange == f"{ns}.tasks"
        assert names.events_exchange == f"{ns}.events"
        assert names.dead_letter_exchange == f"{ns}.dlx"
        assert names.rejected_queue == f"{ns}.rejected"
    assert BUILTIN_TASK_QUEUES == ("tasks.serial", "tasks.parallel", "tasks.actions")


def test_builtin_task_queues_match_the_contract_defaults() -> None:
    from orchestrator.contracts import ACTIONS_QUEUE, PARALLEL_QUEUE, SERIAL_QUEUE

    assert (SERIAL_TASKS, PARALLEL_TASKS, ACTION_TASKS) == (SERIAL_QUEUE, PARALLEL_QUEUE, ACTIONS_QUEUE)


def test_derived_names() -> None:
    names = Names("prod")
    assert shard_id("fast", 3) == "fast.3"
    assert names.shard_queue("fast.3") == "prod.shard.fast.3"
    assert names.start_exchange("fast") == "prod.start.fast"
    assert dead_letter_queue("prod.shard.fast.3") == "prod.shard.fast.3.dlq"
    assert names.task_queue("tasks.parallel", "render@2") == "prod.task.tasks.parallel:render@2"
    assert names.task_dead_letters("tasks.parallel") == "prod.task.tasks.parallel.dlq"


def test_contract_queues_of_different_task_queues_never_collide() -> None:
    names = Names()
    # the same dotted text split differently between queue and contract name
    assert names.task_queue("a.b", "c@1") != names.task_queue("a", "b.c@1")


def test_every_name_of_one_namespace_is_apart_from_another_namespace() -> None:
    a, b = Names("a"), Names("b")
    made = [
        lambda n: n.runs_exchange,
        lambda n: n.tasks_exchange,
        lambda n: n.rejected_queue,
        lambda n: n.shard_queue("fast.0"),
        lambda n: n.task_queue("tasks.serial", "x@1"),
        lambda n: n.task_dead_letters("tasks.serial"),
        lambda n: n.start_exchange("fast"),
    ]
    for name_of in made:
        assert a.owns(name_of(a)) and not b.owns(name_of(a))
        assert name_of(a) != name_of(b)


@pytest.mark.parametrize("bad", ["", "Saga", "1abc", "a.b", "a b", "x" * 33])
def test_a_namespace_is_a_plain_name(bad: str) -> None:
    with pytest.raises(ValueError, match=r"namespace .* is not a valid name"):
        Names(bad)


def test_too_long_a_broker_name_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="use a shorter queue or contract name"):
        Names().task_queue("q" * 128, "c" * 128 + "@1")


def test_dead_letter_queues_are_recognised_per_namespace() -> None:
    names = Names("demo")
    assert names.is_dead_letter_queue("demo.rejected")
    assert names.is_dead_letter_queue("demo.task.tasks.parallel.dlq")
    assert not names.is_dead_letter_queue("saga.task.tasks.parallel.dlq")  # another environment's
    assert not names.is_dead_letter_queue("demo.task.tasks.parallel:render@2")  # a live queue


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

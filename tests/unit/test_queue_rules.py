"""The task-queue rule: a stage, compensation or finaliser sends its task only to a task queue (``tasks.*`` or
a queue a registered contract declares), never to a shard, rejected or dead-letter queue. Each refusal is a
problem at the element that names the queue, with its file and line (found in the text, not counted)."""

from __future__ import annotations

import re
from typing import Any

import pytest

from orchestrator.bus import topology
from orchestrator.bus.names import BUILTIN_TASK_QUEUES, DLQ_SUFFIX, Names
from orchestrator.compiler import compile_text
from orchestrator.compiler.queues import (
    BUILTIN_TASK_QUEUES as COMPILER_BUILTINS,
)
from orchestrator.compiler.queues import (
    DEAD_LETTER_SUFFIXES,
    RESERVED_PREFIXES,
    declared_queues,
    refusal,
)
from orchestrator.contracts import Contract, ContractKind, Registry
from orchestrator.errors import DefinitionError, Problem
from tests.conftest import DEFINITIONS, DEMO_REGISTRY, compile_yaml, problems_of

FILE = "queues.yaml"
STAGE = """\
name: queues
version: "1"
entry: render
stages:
  - name: render
    type: worker
    worker: thumbnail.render@3
    queue: {queue}
    input: {{ modelId: "m-1" }}
    on_success: completed
"""
PROBLEM_LINE = re.compile(r"^(?P<file>[^:]+):(?P<line>[1-9][0-9]*): (?P<path>\S+): (?P<message>.+)$")


def line_of(text: str, needle: str) -> int:
    """The 1-based line of the first line of ``text`` that contains ``needle``."""
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


def rejected(text: str, registry: Registry = DEMO_REGISTRY) -> list[Problem]:
    with pytest.raises(DefinitionError) as info:
        compile_text(text, FILE, registry)
    return info.value.problems


@pytest.mark.parametrize(
    ("queue", "why"),
    [
        ("orch.fast.0", "is reserved: names under orch."),  # a shard queue before namespaces
        ("saga.shard.fast.0", "is reserved: names under saga."),
        ("saga.runs", "is reserved: names under saga."),
        ("amq.direct", "is reserved: names under amq."),
        ("tasks.parallel.dlq", "is a dead-letter queue (names ending .dlq"),
        ("saga.task.tasks.parallel.dlq", "is a dead-letter queue"),
        ("saga.rejected", "is a dead-letter queue (names ending .rejected"),
        ("demo.rejected", "is a dead-letter queue"),  # another namespace's
        ("rendering.dlq", "is a dead-letter queue"),
        ("demo.shard.fast.0", "is not a task queue"),
        ("gpu-renderers", "is not a task queue"),
        ("tasks", "is not a task queue"),
        ("tasks.", "is not a task queue"),
    ],
)
def test_a_stage_queue_that_is_not_a_task_queue_is_refused_at_its_line(queue: str, why: str) -> None:
    text = STAGE.format(queue=queue)
    [problem] = rejected(text)
    assert (problem.file, problem.line, problem.path) == (FILE, line_of(text, "queue:"), "stages[0].queue")
    assert f"queue {queue!r} {why}" in problem.message
    assert problem.message.startswith("stage 'render': ")
    # what to do: the allowed queues, the built-in ones and those the demo contracts declare
    assert "name a task queue instead: tasks.actions, tasks.parallel, tasks.serial, any other tasks.*" in (
        problem.message
    )
    assert "(analysis, metadata, rendering)" in problem.message
    shown = PROBLEM_LINE.match(str(problem))
    assert shown and shown["file"] == FILE and int(shown["line"]) == problem.line


@pytest.mark.parametrize(
    "queue",
    [
        "tasks.parallel",
        "tasks.serial",
        "tasks.actions",
        "tasks.custom",
        "tasks.gpu.large",
        "rendering",
        "analysis",
    ],
)
def test_task_queues_compile_and_reach_the_plan(queue: str) -> None:
    plan = compile_yaml(STAGE.format(queue=queue)).plan
    assert plan["stages"]["render"]["queue"] == queue


def test_every_problem_is_listed() -> None:
    text = STAGE.format(queue="orch.fast.0").replace("on_success: completed", "on_success: again") + (
        "  - name: again\n"
        "    type: action\n"
        "    action: cache.lookup@1\n"
        "    queue: tasks.parallel.dlq\n"
        '    input: { modelId: "m-1" }\n'
        "    on_success: completed\n"
    )
    problems = rejected(text)
    assert [(p.path, p.line) for p in problems] == [
        ("stages[0].queue", line_of(text, "orch.fast.0")),
        ("stages[1].queue", line_of(text, "tasks.parallel.dlq")),
    ]


def _contract(
    name: str, kind: ContractKind, queue: str, input_schema: dict[str, Any] | None = None
) -> Contract:
    return Contract(
        name=name,
        version=1,
        kind=kind,
        queue=queue,
        input_schema=input_schema or {"type": "object"},
        output_schema={"type": "object"},
    )


def test_a_contract_declared_queue_is_a_task_queue_of_every_definition() -> None:
    registry = Registry([*DEMO_REGISTRY.contracts(), _contract("gpu.render", ContractKind.WORKER, "gpu")])
    assert "gpu" in declared_queues(registry)
    plan = compile_text(STAGE.format(queue="gpu"), FILE, registry).plan  # a stage of another contract
    assert plan["stages"]["render"]["queue"] == "gpu"


def test_a_contract_whose_default_queue_is_reserved_is_refused_where_it_is_named() -> None:
    registry = Registry(
        [
            *DEMO_REGISTRY.contracts(),
            _contract("odd.work", ContractKind.WORKER, "odd.dlq"),
            _contract("odd.undo", ContractKind.ACTION, "saga.rejected"),
            _contract("odd.audit", ContractKind.ACTION, "orch.fast.1"),
        ]
    )
    text = (
        'name: odd\nversion: "1"\nentry: work\nstages:\n'
        "  - name: work\n    type: worker\n    worker: odd.work@1\n"
        "    compensate: odd.undo@1\n    on_success: completed\n"
        "finalisers: [odd.audit@1]\n"
    )
    by_path = {p.path: p for p in rejected(text, registry)}
    assert by_path["stages[0].worker"].line == line_of(text, "worker: odd.work@1")
    assert "queue 'odd.dlq' (the default queue of odd.work@1) is a dead-letter queue" in (
        by_path["stages[0].worker"].message
    )
    assert "declare a new version of odd.work@1 with a task queue, or name one with queue:" in (
        by_path["stages[0].worker"].message
    )
    assert "'saga.rejected' (the queue of compensation odd.undo@1)" in by_path["stages[0].compensate"].message
    assert (
        "'orch.fast.1' (the queue of finaliser odd.audit@1) is reserved" in by_path["finalisers[0]"].message
    )
    assert "or name one with queue:" not in by_path["finalisers[0]"].message
    # a stage that names a task queue no longer uses the contract's default
    fixed = text.replace("    compensate: odd.undo@1\n", "    queue: tasks.odd\n").replace(
        "finalisers: [odd.audit@1]\n", ""
    )
    assert compile_text(fixed, FILE, registry).plan["stages"]["work"]["queue"] == "tasks.odd"


def test_the_demo_definitions_use_only_task_queues(registry: Registry) -> None:
    for path in sorted(DEFINITIONS.glob("*.yaml")):
        compile_text(path.read_bytes(), str(path), registry)


# ---- the rule agrees with the broker's names (orchestrator/bus), which the pure compiler cannot import ----


def test_the_built_in_task_queues_and_reserved_names_agree_with_the_bus() -> None:
    assert set(COMPILER_BUILTINS) == set(BUILTIN_TASK_QUEUES)
    assert DLQ_SUFFIX in DEAD_LETTER_SUFFIXES
    assert RESERVED_PREFIXES == topology._RESERVED_PREFIXES  # what the topology refuses as a task queue


@pytest.mark.parametrize("namespace", ["saga", "demo"])
def test_no_broker_queue_of_a_namespace_is_a_task_queue(namespace: str) -> None:
    names = Names(namespace)
    broker_queues = [
        names.shard_queue("fast.0"),
        f"{names.shard_queue('fast.0')}{DLQ_SUFFIX}",
        names.rejected_queue,
        names.task_queue("tasks.parallel", "thumbnail.render@3"),
        names.task_dead_letters("tasks.parallel"),
        names.task_dead_letters("rendering"),
    ]
    declared = declared_queues(DEMO_REGISTRY)
    assert [q for q in broker_queues if refusal(q, declared) is None] == []
    assert all(refusal(q, declared) is None for q in BUILTIN_TASK_QUEUES)


def test_problems_of_helper_sees_the_rule() -> None:
    [problem] = problems_of(STAGE.format(queue="saga.shard.fast.0"))
    assert problem.path == "stages[0].queue"

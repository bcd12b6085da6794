"""What a start must satisfy before its run does any work: the definition's context schema, and room in a
message for every task input the context alone determines. Pure. The client checks the same before it
publishes a start (so the caller hears at once), and the shard again when it creates the run (so a start
that skipped the client cannot create a run that waits forever for a task nobody can read).

Inputs that also read stage results are checked when their stage is dispatched, like every task: the
stage fails with the reason if its task cannot be sent.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from orchestrator.dsl.binding import bind
from orchestrator.engine import ids, sizes
from orchestrator.engine.builder import context_problems
from orchestrator.engine.model import RunSnapshot, RunStatus
from orchestrator.engine.step import Step
from orchestrator.errors import BindingError

__all__ = ["context_problems", "input_problems", "start_problems"]

# A context this small cannot make a context-bound input too big without an expression that repeats it
# many times over, so the door does not bind every input of every start; the dispatch check still
# catches such an input at its stage.
MEASURE_ABOVE_SHARE = 16


def start_problems(
    plan: Mapping[str, Any], digest: str, context: Mapping[str, Any], limits: sizes.Limits
) -> list[str]:
    """Every reason a start with ``context`` must be refused (empty: it may start)."""
    problems = context_problems(plan, context)
    if problems:
        return [f"invalid context: {p}" for p in problems]
    return input_problems(plan, digest, context, limits)


def input_problems(
    plan: Mapping[str, Any], digest: str, context: Mapping[str, Any], limits: sizes.Limits
) -> list[str]:
    """The work stages whose task, bound from ``context`` alone, would not fit in a message."""
    if sizes.body_bytes({"context": context}) * MEASURE_ABOVE_SHARE <= limits.max_body_bytes:
        return []
    run = RunSnapshot("door-check", "", digest, RunStatus.PENDING, context)
    step = Step(plan, digest, run, 0, limits=limits)
    problems = []
    for name, stage in plan["stages"].items():
        problem = _stage_problem(step, name, stage)
        if problem is not None:
            problems.append(f"stage {name}: {problem}")
    return problems


def _stage_problem(step: Step, name: str, stage: Mapping[str, Any]) -> str | None:
    fence = ids.stage_fence(1, 1)
    try:
        if stage["type"] in ("action", "worker"):
            task = step.stage_task(name, stage, 1, fence, step.bind_input(name, stage), None)
            problem = sizes.too_big(task.body, step.limits)
            return None if problem is None else f"the task cannot be sent: {problem}"
        if stage["type"] == "map":
            items = bind(stage["items"], step.variables(), None, f"{name}.items")
            if not isinstance(items, list) or not items:
                return None
            inputs = [step.bind_input(name, stage, item=item, index=i) for i, item in enumerate(items)]
            tasks = [step.stage_task(name, stage, 1, fence, payload, i) for i, payload in enumerate(inputs)]
            return step.largest_too_big(tasks, inputs)
    except BindingError:
        return None  # it reads stage results (or fails to bind): its dispatch decides
    return None

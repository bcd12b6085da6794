"""What a start must satisfy before its run does any work: the definition's context schema, and room in a
message for every task the context alone determines. Pure. The client checks the same before it
publishes a start (so the caller hears at once), the shard again when it creates the run (so a start
that skipped the client cannot create a run that waits for ever for a task nobody can read), and a
re-drive before it starts a new epoch.

"The tasks the context alone determines" are those of the work stages a run reaches whatever its
workers answer, as far as the context decides: from the entry, through every work stage's success,
every branch of a fork, every join, and each decision whose branches read only the context (a decision
whose expressions name ``stages`` ends the walk there). Of those, each task whose input binds from the context
alone is built exactly as it will be sent and measured. Every other task is measured when its stage is
dispatched, and fails its stage with the reason if it cannot be sent.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

from orchestrator.dsl.binding import bind, evaluate
from orchestrator.dsl.expressions import references, tokenize
from orchestrator.engine.builder import context_problems
from orchestrator.engine.model import RunSnapshot, RunStatus
from orchestrator.engine.plan import Bag, Fork, Join, Plan, Route, Stage, Work
from orchestrator.engine.step import Step
from orchestrator.errors import BindingError
from orchestrator.wire import ids, sizes

__all__ = ["context_problems", "start_problems"]

STAGE_ROOT = frozenset({"stages"})


def start_problems(
    plan: Plan,
    digest: str,
    context: Mapping[str, Any],
    limits: sizes.Limits,
    identity: RunSnapshot | None = None,
) -> list[str]:
    """Every reason a start with ``context`` must be refused (empty: it may start). ``identity`` is the
    run the tasks will name (its id, shard and tenant are part of their size); a client that does not
    know the shard yet passes the longest its class can have."""
    problems = context_problems(plan, context)
    if problems:
        return [f"invalid context: {p}" for p in problems]
    return _task_problems(plan, digest, context, limits, identity)


def _task_problems(
    plan: Plan,
    digest: str,
    context: Mapping[str, Any],
    limits: sizes.Limits,
    identity: RunSnapshot | None = None,
) -> list[str]:
    """The work stages a run certainly reaches whose task, bound from ``context``, would not fit."""
    run = identity or RunSnapshot("door-check", "", digest, RunStatus.PENDING, context)
    step = Step(plan, digest, run, 0, limits=limits)
    problems = []
    for name in reached(step):
        problem = _stage_problem(step, name, plan.stages[name])
        if problem is not None:
            problems.append(f"stage {name}: {problem}")
    return problems


def reached(step: Step) -> list[str]:
    """The work stages a run reaches whatever its workers answer, as far as its context decides."""
    stages = step.plan.stages
    todo, seen, found = deque([step.plan.entry]), set(), []
    while todo:
        name = todo.popleft()
        if name in seen or name not in stages:
            continue  # a terminal, or met before
        seen.add(name)
        stage = stages[name]
        if isinstance(stage, Work):
            found.append(name)
            todo.append(stage.on_success)
        elif isinstance(stage, Fork):
            todo.extend(stage.branches)
        elif isinstance(stage, Join):
            todo.append(stage.on_success)
        else:
            todo.extend(_taken(step, name, stage))
    return found


def _taken(step: Step, name: str, stage: Route) -> list[str]:
    """The branch a decision takes on the context alone ([] if it reads a stage, or fails). Whether it
    reads a stage is read off its expressions, not off an error: ``has(stages.x)`` is false, not an
    error, before any stage ran."""
    if any(_reads_stages(b.when) for b in stage.branches):
        return []
    variables = step.variables()
    for i, branch in enumerate(stage.branches):
        try:
            taken = evaluate(branch.when, variables, f"{name}.branches[{i}].when")
        except BindingError:
            return []
        if taken is True:
            return [branch.next]
        if taken is not False:
            return []
    return []


@lru_cache(maxsize=4096)
def _reads_stages(src: str) -> bool:
    """Whether an expression reads a stage's result (every start asks this of the same few expressions)."""
    return bool(references(tokenize(src), STAGE_ROOT))


def _stage_problem(step: Step, name: str, stage: Stage) -> str | None:
    fence = ids.stage_fence(1, 1)
    if not isinstance(stage, Work):
        return None
    try:
        if not isinstance(stage, Bag):
            task = step.stage_task(name, stage, 1, fence, step.bind_input(name, stage), None)
            problem = sizes.too_big(task.body, step.limits)
            return None if problem is None else f"the task cannot be sent: {problem}"
        items = bind(stage.items, step.variables(), None, f"{name}.items")
        if not isinstance(items, list) or not items:
            return None
        inputs = [step.bind_input(name, stage, item=item, index=i) for i, item in enumerate(items)]
        tasks = [step.stage_task(name, stage, 1, fence, p, i) for i, p in enumerate(inputs)]
        window = step.limits.bag_window  # a bag sends a window of tasks in one transition
        problems = (step.bag_problem(tasks[i : i + window], i) for i in range(0, len(tasks), window))
        return next((p for p in problems if p is not None), None)
    except BindingError:
        return None  # it reads stage results (or fails to bind): its dispatch decides

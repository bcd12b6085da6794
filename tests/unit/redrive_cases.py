"""Every way a run of an example definition can fail, as cases to re-drive from.

For each shipped definition (and a few inline ones that reach shapes the examples do not: a decision that
cannot be evaluated, fork branches that are decisions, a compensated stage before a fork), a case is one
cause of failure: each work stage failing on every attempt, each finaliser, each compensation (with a later
stage failing so that it runs), a bag item, a stage whose worker never reports (its deadline fires), a
cancellation at several points, a decision that routes to ``failed`` and a context the definition refuses.

A case says whether its cause can be removed (a fault in a worker: after it is fixed, the re-driven run
must end as a fresh run ends) or is in the run's own data (a decision, the context: the re-driven run ends
as it did, or the re-drive is refused).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from orchestrator.compiler import CompiledPlan, compile_text
from orchestrator.engine.model import CancelRun, Redrive
from tests.conftest import DEFINITIONS, DEMO_REGISTRY, compile_yaml
from tests.unit.engine_sim import Delivery, Sim

# Shapes the example definitions do not have, each with a work stage after it to fail.
INLINE = {
    "decision-error": """
        name: decision-error
        version: "1.0.0"
        entry: look
        stages:
          - name: look
            type: action
            action: cache.lookup@1
            input: { modelId: "${context.modelId}" }
            on_success: route
          - name: route
            type: decision
            on_evaluation_error: failed
            branches:
              - when: 'stages["look"].result.hit == true && context.strict == true'
                next: completed
              - when: "true"
                next: publish
          - name: publish
            type: action
            action: catalogue.publish@2
            input: { modelId: "${context.modelId}" }
            on_success: completed
        finalisers: [audit.run-terminal@1]
    """,
    "decision-fork": """
        name: decision-fork
        version: "1.0.0"
        entry: render
        stages:
          - name: render
            type: worker
            queue: rendering
            worker: thumbnail.render@3
            input: { modelId: "${context.modelId}" }
            compensate: thumbnail.discard@1
            on_success: split
          - name: split
            type: fork
            branches: [left, right, work]
          - name: left
            type: decision
            branches:
              - when: "true"
                next: meet
          - name: right
            type: decision
            branches:
              - when: "true"
                next: meet
          - name: work
            type: worker
            queue: metadata
            worker: metadata.extract@2
            input: { modelId: "${context.modelId}" }
            on_success: meet
          - name: meet
            type: join
            required: [left, right, work]
            acceptable_terminal_states: [completed]
            on_success: publish
          - name: publish
            type: action
            action: catalogue.publish@2
            input: { modelId: "${context.modelId}" }
            on_success: completed
        finalisers: [audit.run-terminal@1, audit.run-terminal@1]
    """,
}

INLINE["failure-route"] = """
    name: failure-route
    version: "1.0.0"
    entry: render
    stages:
      - name: render
        type: worker
        queue: rendering
        worker: thumbnail.render@3
        input: { modelId: "${context.modelId}" }
        execution_deadline_ms: 60000
        on_success: publish
        on_failure: notify
      - name: notify
        type: worker
        queue: metadata
        worker: metadata.extract@2
        input: { modelId: "${context.modelId}" }
        queue_deadline_ms: 60000
        on_success: failed
      - name: publish
        type: action
        action: catalogue.publish@2
        input: { modelId: "${context.modelId}" }
        on_success: completed
"""
INLINE["timeout-join"] = """
    name: timeout-join
    version: "1.0.0"
    entry: split
    stages:
      - name: split
        type: fork
        branches: [slow, quick]
      - name: slow
        type: worker
        queue: rendering
        worker: thumbnail.render@3
        input: { modelId: "${context.modelId}" }
        execution_deadline_ms: 1000
        on_success: meet
        on_failure: meet
      - name: quick
        type: action
        action: cache.lookup@1
        input: { modelId: "${context.modelId}" }
        on_success: meet
      - name: meet
        type: join
        required: [slow, quick]
        acceptable_terminal_states: [completed, timed-out]
        on_success: publish
      - name: publish
        type: action
        action: catalogue.publish@2
        input: { modelId: "${context.modelId}" }
        on_success: completed
    finalisers: [audit.run-terminal@1]
"""

CONTEXTS: dict[str, list[dict[str, Any]]] = {
    "model-ingest": [{"modelId": "m-1"}, {"modelId": "cached-1"}],
    "thumbnail-batch": [{"modelIds": ["a", "b", "c", "d"]}],
    "catalogue-reindex": [{"index": "books"}],
    "ingest-triage": [{"sizeMb": 10, "format": "glb"}],
    "decision-error": [{"modelId": "m-3"}],
    "decision-fork": [{"modelId": "m-2"}],
    "failure-route": [{"modelId": "m-4"}],
    "timeout-join": [{"modelId": "m-5"}],
}
# Runs whose own data makes them fail: re-driven, they end as they did (or are refused, for a context).
INHERENT: dict[str, list[dict[str, Any]]] = {
    "ingest-triage": [{"sizeMb": 12000, "format": "glb"}, {"sizeMb": 10, "format": "fbx"}],
    "decision-error": [{"modelId": "cached-3"}],
    "model-ingest": [{"modelId": ""}, {"wrong": 1}],
}
CANCEL_POINTS = (1, 3, 6)
POISON_POINTS = (2, 5)


@functools.cache
def compiled(name: str) -> CompiledPlan:
    if name in INLINE:
        return compile_yaml(INLINE[name])
    path = DEFINITIONS / f"{name}.yaml"
    return compile_text(path.read_text(encoding="utf-8"), str(path), DEMO_REGISTRY)


@dataclass(frozen=True)
class Case:
    definition: str
    context: Mapping[str, Any]
    cause: str  # what fails, for the test id
    fail_stages: frozenset[str] = frozenset()
    fail_items: frozenset[int] = frozenset()
    lost_stages: frozenset[str] = frozenset()
    cancel_after: int | None = None  # deliveries before an operator cancels the run
    poison_after: int | None = None  # deliveries before a poison message fails the run, work in flight
    poison_undoing: bool = False  # poison the run while a compensation is in flight
    inherent: bool = False  # the failure is in the run's data: removing nothing changes it

    @property
    def id(self) -> str:
        return f"{self.definition}[{self.cause}]"

    def sim(self, run_id: str = "run-1") -> Sim:
        plan = compiled(self.definition)
        return Sim(
            plan.plan,
            plan.digest,
            run_id=run_id,
            fail_stages=self.fail_stages,
            fail_items=self.fail_items,
            lost_stages=self.lost_stages,
        )


def _causes(definition: str, context: Mapping[str, Any]) -> list[Case]:
    plan = compiled(definition).plan
    stages = plan["stages"]
    work = [n for n, s in stages.items() if s["type"] in ("action", "worker", "map")]
    found = [Case(definition, context, f"fail {n}", fail_stages=frozenset({n})) for n in work]
    for i, _ in enumerate(plan.get("finalisers") or []):
        label = f"finaliser:{i}"
        found.append(Case(definition, context, f"fail {label}", fail_stages=frozenset({label})))
    for name in (n for n in work if stages[n].get("compensate")):
        for later in (n for n in work if n != name):
            failing = frozenset({later, f"compensate:{name}"})
            found.append(Case(definition, context, f"fail {later} and undo {name}", fail_stages=failing))
    for name in (n for n in work if stages[n]["type"] == "map"):
        found.append(Case(definition, context, f"fail {name} item 1", fail_items=frozenset({1})))
    for name in (n for n in work if stages[n].get("execution_deadline_ms")):
        found.append(Case(definition, context, f"lose {name}", lost_stages=frozenset({name})))
    found += [Case(definition, context, f"cancel at {k}", cancel_after=k) for k in CANCEL_POINTS]
    found += [Case(definition, context, f"poison at {k}", poison_after=k) for k in POISON_POINTS]
    for name in work:  # work of the failing epoch still in flight when a poison message fails the run
        failing = frozenset({name})
        for k in (3, 4):
            cause = f"fail {name}, poison at {k}"
            found.append(Case(definition, context, cause, fail_stages=failing, poison_after=k))
    for name in (n for n in work if stages[n].get("compensate")):
        for later in (n for n in work if n != name):
            failing = frozenset({later})
            cause = f"fail {later}, poison while undoing {name}"
            found.append(Case(definition, context, cause, fail_stages=failing, poison_undoing=True))
    return found


def cases() -> list[Case]:
    """Every case, in a stable order."""
    found: list[Case] = []
    for definition, contexts in CONTEXTS.items():
        for context in contexts:
            found += _causes(definition, context)
    for definition, contexts in INHERENT.items():
        for context in contexts:
            found.append(Case(definition, context, f"data {dict(context)}", inherent=True))
    return found


# (how many choices there are) -> which one; "deliver", "timer" or "duplicate" first, then the index
Chooser = Callable[[list[str], int], tuple[str, int]]


def in_order(options: list[str], pending: int) -> tuple[str, int]:
    return ("deliver", 0) if "deliver" in options else (options[0], 0)


def drive(sim: Sim, choose: Chooser, cancel_after: int | None = None, *, races: bool = True) -> None:
    """Deliver until nothing is pending and no timer is left; cancel the run after ``cancel_after``.
    ``races``: time may jump to the next timer while deliveries are pending (a deadline beats a slow
    worker); without, timers fire only when nothing else can happen (every worker is in time)."""
    for step in range(20_000):
        if cancel_after is not None and step == cancel_after:
            sim.handle(CancelRun("cancel-by-operator", "the operator changed their mind", "ops@host"))
        if not sim.pending and not sim.store.timers:
            return
        timers = sim.store.timers and (races or not sim.pending)
        options = (["deliver"] if sim.pending else []) + (["timer"] if timers else [])
        if sim.delivered:
            options.append("duplicate")
        action, index = choose(options, len(sim.pending))
        if action == "deliver":
            sim.deliver_at(index % len(sim.pending))
        elif action == "timer":
            sim.fire_next_timer()
        else:
            sim.deliver(sim.delivered[index % len(sim.delivered)])
    raise AssertionError("the run did not quiesce")


def fail(sim: Sim, case: Case, choose: Chooser) -> list[Delivery]:
    """Run the case until it fails (or ends): returns what is still in flight when it failed, which a
    poisoned run leaves behind (empty for the others, which are run until nothing is left)."""
    sim.start(case.context)
    if case.poison_after is None and not case.poison_undoing:
        drive(sim, choose, case.cancel_after)
        return []
    for step in range(20_000):
        undoing = any(str(d.stage).startswith("compensate:") for d in sim.pending if d.kind == "task")
        if step == case.poison_after or (case.poison_undoing and undoing):
            sim.poison()
            in_flight = list(sim.pending)
            sim.pending.clear()
            return in_flight
        if not sim.pending and not sim.store.timers:
            return []
        action, index = choose(["deliver"] if sim.pending else ["timer"], len(sim.pending))
        if action == "deliver":
            sim.deliver_at(index % len(sim.pending))
        else:
            sim.fire_next_timer()
    raise AssertionError("the run did not quiesce")


def redriven(case: Case, run_id: str) -> Sim:
    """The case run in order until it fails, its cause removed, re-driven (what was in flight arriving
    after) and run in order to its end again (a run that did not fail is left as it ended; the re-drive
    is then only a refused request)."""
    sim = case.sim(run_id)
    in_flight = settle_undo(sim, fail(sim, case, in_order), in_order)
    sim.fail_stages = sim.fail_items = sim.lost_stages = frozenset()
    sim.handle(Redrive("redrive-1", "fixed", "ops@host"))
    sim.pending += in_flight
    drive(sim, in_order)
    return sim


def settle_undo(sim: Sim, in_flight: list[Delivery], choose: Chooser) -> list[Delivery]:
    """A run poisoned while a compensation was in flight cannot be re-driven until that undo reported:
    the refusal says so; then what was in flight is delivered (the undo reports) and nothing is left."""
    if sim.record.get("phase") != "compensating" or sim.status != "failed":
        return in_flight
    refused = sim.handle(Redrive("redrive-early", "too soon", "ops@host"))
    assert refused.verdict.value == "invalid" and "was in flight" in sim.history[-1]["detail"]["detail"]
    sim.pending += in_flight
    drive(sim, choose)
    assert "phase" not in sim.record, "the undo in flight reported and the run took it"
    return []

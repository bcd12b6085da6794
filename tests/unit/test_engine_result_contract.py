"""Results checked at the door (orchestrator/engine/outputs.py): a successful report whose result does not
fit the output schema of the contract version the plan pins fails its attempt for good, with the schema
errors in history, before the result becomes state. Plain work stages, map items, finalisers and
compensations; a property test over arbitrary JSON results; the validator cache."""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any

import jsonschema
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.engine import advance, dispatched_contract, outputs
from orchestrator.engine.model import CompensationResult, FinaliserResult, StageResult, Verdict
from orchestrator.engine.plan import ContractPlan, Plan
from orchestrator.wire import sizes
from tests.conftest import compile_yaml
from tests.unit.engine_sim import Handled, Sim, typed

RENDER = """
name: render-once
version: "1"
entry: render
context: { type: object, properties: { modelId: { type: string } }, required: [modelId] }
stages:
  - name: render
    type: worker
    worker: thumbnail.render@3
    input: { modelId: "${context.modelId}" }
    retry: { max_attempts: 3, initial_backoff_ms: 100 }
    on_success: completed
    on_failure: ROUTE
finalisers: [audit.run-terminal@1]
terminals: [completed, failed]
"""

RECOVER = """
  - name: recover
    type: action
    action: catalogue.publish@2
    input: { modelId: "${context.modelId}" }
    on_success: failed
    on_failure: failed
"""

BATCH = """
name: batch
version: "1"
entry: render-all
context: { type: object, properties: { ids: { type: array, items: { type: string } } }, required: [ids] }
stages:
  - name: render-all
    type: map
    worker: thumbnail.render@3
    items: "${context.ids}"
    max_items: 10
    input: { modelId: "${item}" }
    retry: { max_attempts: 3, initial_backoff_ms: 100 }
    on_success: completed
    on_failure: failed
terminals: [completed, failed]
"""

UNDO = """
name: undo
version: "1"
entry: render
context: { type: object, properties: { modelId: { type: string } }, required: [modelId] }
stages:
  - name: render
    type: worker
    worker: thumbnail.render@3
    input: { modelId: "${context.modelId}" }
    compensate: thumbnail.discard@1
    on_success: publish
    on_failure: failed
  - name: publish
    type: action
    action: catalogue.publish@2
    input: { modelId: "${context.modelId}" }
    on_success: completed
    on_failure: failed
finalisers: [audit.run-terminal@1]
terminals: [completed, failed]
"""


def sim_of(text: str, context: dict[str, Any], **kwargs: Any) -> Sim:
    plan = compile_yaml(text)
    sim = Sim(plan.plan, plan.digest, **kwargs)
    sim.start(context)
    sim.deliver_at(0)  # the start
    return sim


def render_sim(route: str = "failed") -> Sim:
    text = RENDER.replace("ROUTE", route)
    if route == "recover":
        text = text.replace("finalisers:", RECOVER.lstrip("\n") + "finalisers:")
    return sim_of(text, {"modelId": "m-1"})


def answer(sim: Sim, stage: str, value: Any, item: int | None = None) -> Handled:
    """Run the pending task of ``stage`` (``item``) as a worker that skipped the SDK's output check: its
    report says ok, with ``value`` as the result."""
    index = next(
        i for i, d in enumerate(sim.pending) if d.kind == "task" and d.stage == stage and d.item == item
    )
    task = sim.pending.pop(index).task
    assert task is not None
    report = sim.work(task)
    return sim.handle(dataclasses.replace(report, ok=True, result=value, error=None))


# ---- plain work stages --------------------------------------------------------------------------------


def test_a_result_that_breaks_the_contract_fails_the_attempt_for_good_with_the_error_in_history() -> None:
    sim = render_sim()
    handled = answer(sim, "render", {"thumbnailUri": 5})

    assert handled.took_effect
    (failed,) = sim.entries("stage.failed", "render")
    detail = failed["detail"]
    assert detail["reason"] == "contract" and detail["retryable"] is False
    assert detail["error"] == (
        "the result does not fit the output schema of thumbnail.render@3: "
        "result.thumbnailUri: 5 is not of type 'string'"
    )
    # the stage allows 3 attempts, but no retry mends a handler that breaks its contract
    assert not sim.entries("retry.scheduled")
    assert sim.record["s:render:status"] == "failed"
    assert "s:render:result" not in sim.record  # never became state
    assert sim.record["s:render:error"] == detail["error"]
    sim.run()
    assert sim.status == "failed"
    assert sim.record["reason"].startswith("render: the result does not fit the output schema")
    assert len([t for t in sim.tasks if t.body["stage"] == "render"]) == 1


def test_a_missing_required_field_is_named_with_its_path() -> None:
    sim = render_sim()
    answer(sim, "render", {"thumbnail": "thumbs/m-1.png"})
    (failed,) = sim.entries("stage.failed", "render")
    assert failed["detail"]["error"].endswith("result: 'thumbnailUri' is a required property")


def test_a_result_that_fits_is_accepted_as_it_was_sent() -> None:
    sim = render_sim()
    value = {"thumbnailUri": "thumbs/m-1.png", "extra": [1, 2]}  # the schema allows more fields
    handled = answer(sim, "render", value)

    assert handled.took_effect and handled.verdict is Verdict.APPLIED
    assert sim.snapshot().stages["render"].result == value
    assert not sim.entries("stage.failed")
    sim.run()
    assert sim.status == "completed"


def test_a_breach_takes_the_stages_failure_route() -> None:
    sim = render_sim(route="recover")
    answer(sim, "render", None)
    assert sim.record["s:render:status"] == "failed"
    assert sim.pending_tasks() == ["recover"]  # on_failure was entered, not the failed intent
    assert "intent" not in sim.record


def test_a_reported_failure_keeps_its_own_error_and_retry() -> None:
    """Only successes are checked: a failure's result (none) is not a breach."""
    sim = sim_of(RENDER.replace("ROUTE", "failed"), {"modelId": "m-1"}, fail_stages=frozenset({"render"}))
    sim.deliver_task("render")
    (failed,) = sim.entries("stage.failed", "render")
    assert "reason" not in failed["detail"] and failed["detail"]["retryable"] is True
    assert sim.entries("retry.scheduled", "render")


def test_the_error_is_bounded_however_large_and_wrong_the_result() -> None:
    sim = render_sim()
    answer(sim, "render", {"thumbnailUri": ["x" * 100_000] * 50, **{f"k{i}": i for i in range(1000)}})
    (failed,) = sim.entries("stage.failed", "render")
    error = failed["detail"]["error"]
    assert len(error) <= sizes.MAX_ERROR_CHARS + 100
    assert error.startswith(
        "the result does not fit the output schema of thumbnail.render@3: result.thumbnailUri"
    )


def test_many_errors_show_the_first_few_in_path_order() -> None:
    plan = pinning({"x@1": {"type": "array", "items": {"type": "integer"}}})
    problem = outputs.output_problem(plan, "x@1", ["a", 1, "b", "c", "d", "e"] + ["z"] * 8)
    assert problem is not None
    assert "result[0]: 'a' is not of type 'integer'; result[2]: 'b'" in problem
    assert "result[4]" not in problem and problem.endswith("(and 10 more)")


# ---- map items ----------------------------------------------------------------------------------------


def test_a_map_item_that_breaks_the_contract_fails_the_map_without_a_retry() -> None:
    sim = sim_of(BATCH, {"ids": ["a", "b", "c"]})
    ok = answer(sim, "render-all", {"thumbnailUri": "thumbs/a.png"}, item=0)
    assert ok.took_effect and ok.decision.arrival is not None
    bad = answer(sim, "render-all", {"thumbnailUri": False}, item=1)

    assert bad.took_effect and bad.decision.arrival is None  # the item never arrives at the barrier
    (failed,) = sim.entries("stage.failed", "render-all")
    assert failed["detail"]["item"] == 1 and failed["detail"]["reason"] == "contract"
    assert failed["detail"]["error"].endswith("result.thumbnailUri: False is not of type 'string'")
    assert not sim.entries("retry.scheduled")  # the map allows 3 attempts per item
    assert sim.record["s:render-all:status"] == "failed"
    assert sim.record["s:render-all:error"].startswith("item 1: the result does not fit")
    late = answer(sim, "render-all", {"thumbnailUri": "thumbs/c.png"}, item=2)
    assert late.verdict is Verdict.LATE
    sim.run()
    assert sim.status == "failed"


def test_map_items_that_fit_complete_the_map_in_order() -> None:
    sim = sim_of(BATCH, {"ids": ["a", "b"]})
    answer(sim, "render-all", {"thumbnailUri": "b", "size": 2}, item=1)
    answer(sim, "render-all", {"thumbnailUri": "a"}, item=0)
    sim.run()
    assert sim.status == "completed"
    assert sim.snapshot().stages["render-all"].result == [
        {"thumbnailUri": "a"},
        {"thumbnailUri": "b", "size": 2},
    ]


# ---- finalisers and compensations ---------------------------------------------------------------------


def test_a_finaliser_result_that_breaks_its_contract_is_a_failed_finaliser() -> None:
    sim = render_sim()
    answer(sim, "render", {"thumbnailUri": "thumbs/m-1.png"})
    handled = answer(sim, "finaliser:0", {"recorded": "yes"})

    assert isinstance(handled.event, FinaliserResult) and handled.took_effect
    (failed,) = sim.entries("finaliser.failed")
    assert failed["detail"]["reason"] == "contract"
    assert (
        "audit.run-terminal@1: result.recorded: 'yes' is not of type 'boolean'" in failed["detail"]["error"]
    )
    assert sim.status == "failed"  # a completed intent, but a finaliser failed


def test_a_compensation_result_that_breaks_its_contract_is_a_failed_compensation() -> None:
    sim = sim_of(UNDO, {"modelId": "m-1"}, fail_stages=frozenset({"publish"}))
    sim.deliver_task("render")
    sim.deliver_task("publish")  # fails: the run undoes render
    handled = answer(sim, "compensate:render", {})

    assert isinstance(handled.event, CompensationResult) and handled.took_effect
    (failed,) = sim.entries("compensation.failed")
    assert failed["detail"]["reason"] == "contract"
    assert failed["detail"]["error"].endswith("thumbnail.discard@1: result: 'undone' is a required property")
    assert sim.record["compensation_failed"] == "1"
    assert sim.record["s:render:status"] == "completed"  # not marked undone: its effect may remain
    sim.run()
    assert sim.status == "failed"


def test_a_compensation_result_that_fits_marks_the_stage_undone() -> None:
    sim = sim_of(UNDO, {"modelId": "m-1"}, fail_stages=frozenset({"publish"}))
    sim.run()
    assert sim.record["s:render:status"] == "compensated"
    assert not sim.entries("compensation.failed")


# ---- determinism, over arbitrary results --------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(["thumbnailUri", "x"]), inner)
    ),
    max_leaves=8,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=JSON)
def test_any_result_either_fits_and_becomes_state_or_fails_the_attempt_the_same_way_every_time(
    value: Any,
) -> None:
    sim = render_sim()
    task = next(d.task for d in sim.pending if d.kind == "task")
    assert task is not None
    report = dataclasses.replace(sim.work(task), result=value)
    assert isinstance(report, StageResult)
    snapshot = sim.snapshot()
    first = advance(typed(sim.plan), sim.digest, snapshot, report, 5)
    again = advance(typed(copy.deepcopy(sim.plan)), sim.digest, snapshot, report, 5)

    assert first == again  # pure: the same event on the same state, whichever plan object it came from
    assert first.verdict is Verdict.APPLIED
    schema = sim.plan["contracts"]["thumbnail.render@3"]["output_schema"]
    fits = jsonschema.Draft202012Validator(schema).is_valid(value)
    kinds = [h.kind for h in first.history]
    if fits:
        assert "stage.completed" in kinds
        assert json.loads(_stage_field(first, "render", "result")) == value
    else:
        (failed,) = [h for h in first.history if h.kind == "stage.failed"]
        assert failed.detail["reason"] == "contract" and failed.detail["retryable"] is False
        assert _stage_field(first, "render", "result") is None
        assert "retry.scheduled" not in kinds


def _stage_field(decision: Any, stage: str, name: str) -> str | None:
    for write in decision.writes:
        if write.key.kind == "stage" and write.key.name == stage and name in write.fields:
            return str(write.fields[name])
    return None


# ---- the validator cache ------------------------------------------------------------------------------


def test_validators_are_compiled_once_per_schema() -> None:
    schema = {"type": "object", "required": ["a"]}
    first = outputs.output_validator(schema)
    assert outputs.output_validator(schema) is first  # by identity
    assert outputs.output_validator(copy.deepcopy(schema)) is first  # a plan loaded again: by its text


def test_a_schema_that_cannot_check_anything_fails_the_result_and_never_raises() -> None:
    broken = pinning({"x@1": {"type": "no-such-type"}})
    problem = outputs.output_problem(broken, "x@1", {})
    assert problem is not None and problem.startswith("the output schema of x@1 cannot check results")
    dangling = pinning({"y@1": {"$ref": "#/$defs/missing"}})
    problem = outputs.output_problem(dangling, "y@1", {})
    assert problem is not None and "cannot check results" in problem


def test_a_plan_without_an_output_schema_for_the_contract_checks_nothing() -> None:
    assert outputs.output_problem(pinning({}), "x@1", {"any": "thing"}) is None
    assert outputs.output_problem(pinning({"x@1": None}), "x@1", 5) is None


def pinning(schemas: dict[str, Any]) -> Plan:
    """A plan that pins these output schemas (None: the contract has none) and nothing else."""
    contracts = {ref: ContractPlan(queue="q", output_schema=schema) for ref, schema in schemas.items()}
    return Plan(name="p", version="1", entry="s", stages={}, contracts=contracts)


# ---- reports bound to the contract of their task ------------------------------------------------------


def test_a_report_naming_another_contract_than_its_tasks_is_refused_and_changes_nothing() -> None:
    """A worker key signs only for its pool's contracts: a report it signs must be on a task of one."""
    for sim, stage, item in (
        (render_sim(), "render", None),
        (sim_of(BATCH, {"ids": ["a", "b"]}), "render-all", 0),
    ):
        index = next(
            i for i, d in enumerate(sim.pending) if d.kind == "task" and d.stage == stage and d.item == item
        )
        task = sim.pending[index].task
        assert task is not None
        report = sim.work(task)
        before = dict(sim.record)
        lying = sim.handle(dataclasses.replace(report, contract="semantic.analyse@4"))
        assert not lying.took_effect and lying.verdict is Verdict.INVALID
        assert "names contract semantic.analyse@4, but its task was for thumbnail.render@3" in str(
            lying.decision.history
        )
        assert {k: v for k, v in sim.record.items() if k != "rev"} == {
            k: v for k, v in before.items() if k != "rev"
        }
        honest = sim.handle(dataclasses.replace(report, contract="thumbnail.render@3"))
        assert honest.took_effect


def test_the_contract_a_report_must_name_is_its_tasks() -> None:
    plan = typed(compile_yaml(UNDO).plan)
    assert dispatched_contract(plan, StageResult("r", "render", 1, "1.1", True)) == "thumbnail.render@3"
    assert (
        dispatched_contract(plan, CompensationResult("c", "render", 0, "1.c0", True)) == "thumbnail.discard@1"
    )
    assert dispatched_contract(plan, FinaliserResult("f", 0, "1.f0", True)) == "audit.run-terminal@1"
    assert dispatched_contract(plan, FinaliserResult("f", 5, "1.f5", True)) is None
    assert dispatched_contract(plan, StageResult("r", "nope", 1, "1.1", True)) is None

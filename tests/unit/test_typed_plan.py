"""The typed plan the engine reads: every compiled plan converts, and says what its mapping says."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from hypothesis import given

from orchestrator.compiler import compile_text
from orchestrator.engine.plan import (
    ATTEMPT_CLOCK_FIELDS,
    Bag,
    Fork,
    Join,
    PlanShapeError,
    Route,
    Work,
    typed_plan,
)
from tests.conftest import DEMO_REGISTRY
from tests.unit.test_compiler_properties import SETTINGS, valid_definitions
from tests.unit.test_engine import compiled


def agrees(raw: dict[str, Any]) -> None:
    """Each typed stage carries its mapping's fields; what is derived (joins, barriers) matches."""
    plan = typed_plan(raw)
    assert (plan.name, plan.version, plan.entry) == (raw["name"], raw["version"], raw["entry"])
    assert plan.finalisers == tuple(raw["finalisers"])
    assert set(plan.stages) == set(raw["stages"])
    for name, spec in raw["stages"].items():
        stage = plan.stages[name]
        assert stage.type == spec["type"] and stage.name == name
        if isinstance(stage, Work):
            assert stage.contract == (spec.get("action") or spec["worker"])
            assert (stage.queue, stage.on_success, stage.on_failure) == (
                spec["queue"],
                spec["on_success"],
                spec["on_failure"],
            )
            assert stage.retry.max_attempts == spec["retry"]["max_attempts"]
            assert stage.compensate == spec["compensate"]
            clocks = set(stage.clocks)
            assert clocks == {c for c, f in ATTEMPT_CLOCK_FIELDS.items() if spec.get(f)}
            assert all(stage.deadline_ms(c) == spec[ATTEMPT_CLOCK_FIELDS[c]] for c in clocks)
            assert isinstance(stage, Bag) == (spec["type"] == "map")
            assert stage.needs_acceptance == (spec["type"] != "map" and bool(clocks))
        elif isinstance(stage, Route):
            assert [(b.when, b.next) for b in stage.branches] == [
                (b["when"], b["next"]) for b in spec["branches"]
            ]
        elif isinstance(stage, Fork):
            assert stage.branches == tuple(spec["branches"])
            join = plan.stages[stage.join]
            assert isinstance(join, Join) and join.fork == name
        else:
            assert isinstance(stage, Join)
            assert stage.required == tuple(spec["required"])
            assert stage.acceptable_terminal_states == frozenset(spec["acceptable_terminal_states"])
        if "arrives_at" in spec:
            assert stage.arrives_at is not None and stage.arrives_at.join == spec["arrives_at"]["join"]
    assert plan.barriers == tuple(sorted(n for n, s in raw["stages"].items() if s["type"] in ("join", "map")))
    assert plan.bags == tuple(b for b in plan.barriers if raw["stages"][b]["type"] == "map")
    for ref, contract in raw["contracts"].items():
        assert plan.contracts[ref].queue == contract["queue"]
        assert plan.contracts[ref].output_schema == contract["output_schema"]


@pytest.mark.parametrize("name", ["model-ingest", "thumbnail-batch", "catalogue-reindex", "ingest-triage"])
def test_each_shipped_definition_types_as_its_plan_says(name: str) -> None:
    plan = compiled(name)
    agrees(plan.plan)
    assert plan.typed is plan.typed  # built once per compiled plan


@SETTINGS
@given(valid_definitions())
def test_every_generated_definition_types_as_its_plan_says(defn: dict[str, Any]) -> None:
    agrees(compile_text(yaml.safe_dump(defn, sort_keys=False), "a.yaml", DEMO_REGISTRY).plan)


def test_a_stage_of_an_unknown_type_is_refused_naming_it() -> None:
    raw = compiled("model-ingest").plan
    broken = {**raw, "stages": {**raw["stages"], "cache-lookup": {"type": "teleport"}}}
    with pytest.raises(PlanShapeError, match="stage 'cache-lookup' is of type 'teleport'"):
        typed_plan(broken)


def test_a_plan_missing_a_field_is_refused_naming_the_plan() -> None:
    raw = compiled("model-ingest").plan
    with pytest.raises(PlanShapeError, match="plan 'model-ingest' has a field missing or malformed"):
        typed_plan({k: v for k, v in raw.items() if k != "entry"})

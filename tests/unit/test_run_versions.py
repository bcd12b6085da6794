"""Invariant 8, versions: a run pins, at creation, the tool versions stored beside its plan and the version
of the engine that created it; ``saga status`` shows them. None of them is in the plan's digest."""

from __future__ import annotations

import json
import tomllib

from orchestrator import views
from orchestrator.client import status_document
from orchestrator.engine import advance
from orchestrator.engine.model import StartRun
from orchestrator.store.spec import pinned_versions
from orchestrator.versions import COMPILER_VERSION, DSL_VERSION, ENGINE_VERSION
from tests.conftest import ROOT, compile_yaml
from tests.unit.engine_sim import SHARD, Sim

DEFINITION = """
name: pinned
version: "4.0.0"
entry: render
context: { type: object, properties: { modelId: { type: string } }, required: [modelId] }
stages:
  - name: render
    type: worker
    worker: thumbnail.render@3
    input: { modelId: "${context.modelId}" }
    on_success: completed
    on_failure: failed
finalisers: [audit.run-terminal@1]
terminals: [completed, failed]
"""


def test_the_engine_has_a_real_version_and_the_compiler_follows_the_package() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert project["version"] == COMPILER_VERSION
    assert ENGINE_VERSION == "1" and DSL_VERSION == "1"


def test_a_run_pins_its_plans_versions_and_the_engine_that_created_it() -> None:
    compiled = compile_yaml(DEFINITION)
    stored = {"dsl": "1", "compiler": "0.0.9", "engine": "0"}  # an older release compiled the plan
    start = StartRun("start-1", "run-1", SHARD, {"modelId": "m-1"}, versions=stored)
    decision = advance(compiled.typed, compiled.digest, None, start, 1_000)

    (run,) = [w.fields for w in decision.writes if w.key.kind == "run" and "engine_version" in w.fields]
    assert run["engine_version"] == ENGINE_VERSION
    assert json.loads(run["plan_versions"]) == stored
    # versions sit beside the plan: the digest and the plan are what they were
    assert compiled.versions == {"dsl": DSL_VERSION, "compiler": COMPILER_VERSION, "engine": ENGINE_VERSION}
    assert "versions" not in compiled.plan


def test_the_pinned_versions_outlive_the_run_and_a_start_without_them_pins_the_engine_only() -> None:
    compiled = compile_yaml(DEFINITION)
    sim = Sim(compiled.plan, compiled.digest)
    sim.start({"modelId": "m-1"})
    sim.run()
    assert sim.status == "completed"
    assert pinned_versions(sim.record) == {"plan": None, "engine": ENGINE_VERSION}


def test_pinned_versions_of_a_record_from_before_versions_were_pinned() -> None:
    assert pinned_versions({}) == {"plan": None, "engine": None}
    assert pinned_versions({"plan_versions": "not json"}) == {"plan": None, "engine": None}


def _record(**fields: str) -> dict[str, str]:
    return {
        "run_id": "r-1",
        "shard": "fast.0",
        "digest": "sha256:abc",
        "status": "running",
        "definition": "pinned",
        "version": "4.0.0",
        "context": "{}",
        "created_at": "0",
        **fields,
    }


def test_status_json_shows_the_pinned_versions_and_contracts() -> None:
    plan = compile_yaml(DEFINITION).plan
    stored = json.dumps({"compiler": "0.0.9", "dsl": "1", "engine": "0"})
    record = _record(plan_versions=stored, engine_version="1")
    view = views.enrich(status_document(record), record, plan)

    assert view["versions"] == {
        "plan": {"compiler": "0.0.9", "dsl": "1", "engine": "0"},
        "engine": "1",
        "contracts": ["audit.run-terminal@1", "thumbnail.render@3"],
    }
    assert views.status_lines(view)[1] == "created 1970-01-01T00:00:00.000Z"  # the text is unchanged


def test_status_json_of_a_run_that_pinned_no_versions_says_so() -> None:
    plan = compile_yaml(DEFINITION).plan
    record = _record()
    view = views.enrich(status_document(record), record, plan)
    assert view["versions"]["plan"] is None and view["versions"]["engine"] is None

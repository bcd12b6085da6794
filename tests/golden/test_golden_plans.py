"""Golden compiled plans: every ``definitions/*.yaml`` compiles to exactly the plan stored beside it.

``tests/golden/plans/<definition-name>.json`` holds ``CompiledPlan.to_json_dict()`` for the definition of
that file name, compiled against the demo registry (``workers.demo``): the canonical plan, its ``digest``
and the tool ``versions``, pretty-printed with sorted keys. A change to a golden file is a change to what
runs pin, so it must be reviewed like code.

When a change to the compiler or a definition is intended, regenerate the files and review the diff::

    SAGA_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/golden -q
    git diff tests/golden/plans

With ``SAGA_UPDATE_GOLDEN=1`` the tests write (and, for definitions that no longer exist, delete) the golden
files instead of comparing, and pass.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest

from orchestrator.compiler import CompiledPlan, canonical_json, compile_text
from orchestrator.versions import COMPILER_VERSION, DSL_VERSION, ENGINE_VERSION
from tests.conftest import DEFINITIONS, DEMO_REGISTRY, ROOT

PLANS = Path(__file__).resolve().parent / "plans"
DEFINITION_FILES = sorted(DEFINITIONS.glob("*.yaml"))
UPDATE = os.environ.get("SAGA_UPDATE_GOLDEN") == "1"


def golden_path(definition: Path) -> Path:
    return PLANS / f"{definition.stem}.json"


def compile_definition(definition: Path) -> CompiledPlan:
    return compile_text(definition.read_bytes(), str(definition.relative_to(ROOT)), DEMO_REGISTRY)


def render(value: dict[str, Any]) -> str:
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def test_there_are_definitions() -> None:
    assert len(DEFINITION_FILES) >= 4


@pytest.mark.parametrize("definition", DEFINITION_FILES, ids=lambda p: p.stem)
def test_plan_matches_golden(definition: Path) -> None:
    plan = compile_definition(definition)
    assert plan.name == definition.stem, "a definition's file is named after the definition"
    expected_text = render(plan.to_json_dict())
    golden = golden_path(definition)
    if UPDATE:
        PLANS.mkdir(exist_ok=True)
        golden.write_text(expected_text, encoding="utf-8")
        return
    assert golden.is_file(), f"no golden plan for {definition.name}; run with SAGA_UPDATE_GOLDEN=1"
    text = golden.read_text(encoding="utf-8")
    assert json.loads(text) == plan.to_json_dict()
    assert text == expected_text, "golden file is not pretty-printed canonically (indent 2, sorted keys)"


def test_every_golden_file_has_a_definition() -> None:
    expected = {golden_path(d).name for d in DEFINITION_FILES}
    stale = sorted(p for p in PLANS.glob("*.json") if p.name not in expected)
    if UPDATE:
        for path in stale:
            path.unlink()
        return
    assert stale == [], f"golden plans without a definition: {[p.name for p in stale]}"
    assert sorted(p.name for p in PLANS.glob("*.json")) == sorted(expected)


@pytest.mark.parametrize("definition", DEFINITION_FILES, ids=lambda p: p.stem)
def test_golden_digest_is_sha256_of_the_canonical_plan(definition: Path) -> None:
    if UPDATE:
        pytest.skip("golden files are being regenerated")
    data = json.loads(golden_path(definition).read_text(encoding="utf-8"))
    digest = data.pop("digest")
    versions = data.pop("versions")
    assert digest == "sha256:" + hashlib.sha256(canonical_json(data)).hexdigest()
    assert versions == {"dsl": DSL_VERSION, "compiler": COMPILER_VERSION, "engine": ENGINE_VERSION}
    # the digest covers the plan only: tool versions sit beside it
    assert "digest" not in data and "versions" not in data


@pytest.mark.parametrize("definition", DEFINITION_FILES, ids=lambda p: p.stem)
def test_digest_does_not_depend_on_the_file_name(definition: Path) -> None:
    text = definition.read_bytes()
    a = compile_text(text, "a.yaml", DEMO_REGISTRY)
    b = compile_text(text, str(definition), DEMO_REGISTRY)
    assert a == b
    assert a.canonical_bytes() == canonical_json(a.plan)

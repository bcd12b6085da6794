"""``diff_plans`` (``orchestrator/governance/diff.py``): what changed between two compiled plans, by stage.

The plans are compiled, with the demo registry, from ``definitions/model-ingest.yaml`` and edited copies."""

from __future__ import annotations

import functools
import json
from typing import Any

import pytest

from orchestrator.compiler import compile_text
from orchestrator.governance.diff import FieldChange, PlanDiff, diff_plans
from tests.conftest import DEFINITIONS, DEMO_REGISTRY

SOURCE = (DEFINITIONS / "model-ingest.yaml").read_text(encoding="utf-8")

REINDEX_STAGE = """\
  - name: reindex
    type: action
    action: index.rebuild@1
    input: { index: "models" }
    on_success: completed
    on_failure: failed
"""


def edited(*replacements: tuple[str, str]) -> str:
    text = SOURCE
    for old, new in replacements:
        assert text.count(old) == 1, f"{old!r} is not in model-ingest.yaml exactly once"
        text = text.replace(old, new)
    return text


@functools.cache
def plan(text: str = SOURCE) -> dict[str, Any]:
    return compile_text(text, "model-ingest.yaml", DEMO_REGISTRY).plan


def with_reindex() -> str:
    """model-ingest with a ``reindex`` stage after ``publish`` (a contract the base plan does not use)."""
    last = "    on_failure: failed\nterminal_policy:"
    return edited(
        ("    on_success: completed\n" + last, "    on_success: reindex\n" + last),
        ("terminal_policy:", REINDEX_STAGE + "terminal_policy:"),
    )


def test_identical_plans_have_an_empty_diff() -> None:
    diff = diff_plans(plan(), plan())
    assert diff.empty
    assert diff == PlanDiff()
    assert diff.lines() == ["no change in meaning"]
    assert diff.to_json() == {
        "stages_added": [],
        "stages_removed": [],
        "stages_changed": {},
        "definition_changed": [],
        "contracts_added": [],
        "contracts_removed": [],
        "contracts_changed": {},
    }


def test_compiling_the_same_file_twice_gives_an_empty_diff() -> None:
    again = compile_text(SOURCE, "other-path.yaml", DEMO_REGISTRY).plan
    assert diff_plans(plan(), again).empty


def test_a_new_version_number_and_comments_are_no_change_in_meaning() -> None:
    text = edited(('version: "2.3.0"', 'version: "2.4.0"'), ("# required fallback", "# the fallback"))
    after = plan(text)
    assert after["version"] == "2.4.0"
    assert diff_plans(plan(), after).empty


def test_a_changed_execution_deadline_is_reported_on_its_stage() -> None:
    after = plan(edited(("execution_deadline_ms: 300000", "execution_deadline_ms: 600000")))
    diff = diff_plans(plan(), after)
    assert not diff.empty
    assert diff.changed == {"render-thumbnail": [FieldChange("execution_deadline_ms", 300000, 600000)]}
    assert (diff.added, diff.removed, diff.definition) == ([], [], [])
    assert (diff.contracts_added, diff.contracts_removed) == ([], [])
    assert diff.lines() == ["~ stage render-thumbnail", "    execution_deadline_ms: 300000 -> 600000"]
    assert diff.to_json()["stages_changed"] == {
        "render-thumbnail": [{"path": "execution_deadline_ms", "before": 300000, "after": 600000}]
    }


def test_a_deadline_set_where_there_was_none() -> None:
    text = edited(
        ("    worker: semantic.analyse@4\n", "    worker: semantic.analyse@4\n    queue_deadline_ms: 5000\n")
    )
    diff = diff_plans(plan(), plan(text))
    assert diff.changed == {"semantic-analysis": [FieldChange("queue_deadline_ms", None, 5000)]}


def test_an_added_stage_and_its_contract() -> None:
    after = plan(with_reindex())
    diff = diff_plans(plan(), after)
    assert diff.added == ["reindex"]
    assert diff.removed == []
    assert diff.changed == {"publish": [FieldChange("on_success", "completed", "reindex")]}
    assert diff.contracts_added == ["index.rebuild@1"]
    assert diff.contracts_removed == []
    assert diff.definition == []
    assert diff.lines() == [
        "+ stage reindex",
        "~ stage publish",
        '    on_success: "completed" -> "reindex"',
        "+ contract index.rebuild@1",
    ]


def test_a_removed_stage_and_its_contract() -> None:
    diff = diff_plans(plan(with_reindex()), plan())
    assert diff.added == [] and diff.removed == ["reindex"]
    assert diff.changed == {"publish": [FieldChange("on_success", "reindex", "completed")]}
    assert diff.contracts_added == [] and diff.contracts_removed == ["index.rebuild@1"]
    assert diff.lines()[:2] == ["- stage reindex", "~ stage publish"]
    assert diff.lines()[-1] == "- contract index.rebuild@1"
    assert diff.to_json()["stages_removed"] == ["reindex"]
    assert diff.to_json()["contracts_removed"] == ["index.rebuild@1"]


def test_a_removed_compensation_drops_its_contract() -> None:
    compensate = (
        "    compensate: thumbnail.discard@1 # the run failed after rendering: delete the thumbnail again\n"
    )
    text = edited((compensate, ""))
    diff = diff_plans(plan(), plan(text))
    assert diff.changed == {"render-thumbnail": [FieldChange("compensate", "thumbnail.discard@1", None)]}
    assert diff.contracts_removed == ["thumbnail.discard@1"]
    assert diff.added == diff.removed == diff.contracts_added == []


def test_nested_fields_are_reported_by_path() -> None:
    text = edited(
        (
            "    execution_deadline_ms: 300000\n",
            "    execution_deadline_ms: 300000\n    retry: { max_attempts: 3 }\n",
        )
    )
    diff = diff_plans(plan(), plan(text))
    assert diff.changed == {"render-thumbnail": [FieldChange("retry.max_attempts", 1, 3)]}
    assert diff.lines() == ["~ stage render-thumbnail", "    retry.max_attempts: 1 -> 3"]


def test_several_changes_in_one_stage_are_each_reported_in_path_order() -> None:
    text = edited(
        (
            "    execution_deadline_ms: 300000\n",
            "    execution_deadline_ms: 1000\n    retry: { max_attempts: 2 }\n",
        ),
        ("    queue: rendering\n", "    queue: tasks.gpu\n"),
    )
    diff = diff_plans(plan(), plan(text))
    assert diff.changed == {
        "render-thumbnail": [
            FieldChange("execution_deadline_ms", 300000, 1000),
            FieldChange("queue", "rendering", "tasks.gpu"),
            FieldChange("retry.max_attempts", 1, 2),
        ]
    }


def test_changes_in_several_stages_are_reported_by_stage_name() -> None:
    text = edited(
        ("execution_deadline_ms: 300000", "execution_deadline_ms: 600000"),
        (
            '    input: { modelId: "${context.modelId}" }\n    on_success: completed',
            '    input: { modelId: "m-${context.modelId}" }\n    on_success: completed',
        ),
    )
    diff = diff_plans(plan(), plan(text))
    assert list(diff.changed) == ["publish", "render-thumbnail"]  # sorted
    assert diff.changed["publish"] == [
        FieldChange("input.modelId", "${context.modelId}", "m-${context.modelId}"),
    ]


def test_a_list_field_is_compared_whole() -> None:
    join = "    required: [semantic-analysis, technical-metadata]\n    acceptable_terminal_states: "
    text = edited((join + "[completed]", join + "[completed, skipped]"))
    diff = diff_plans(plan(), plan(text))
    assert diff.changed == {
        "derive-join": [FieldChange("acceptable_terminal_states", ["completed"], ["completed", "skipped"])]
    }


def test_a_changed_decision_branch_is_reported_as_the_branch_list() -> None:
    text = edited(("hit == true'", "hit == false'"))
    diff = diff_plans(plan(), plan(text))
    (change,) = diff.changed["cache-route"]
    assert change.path == "branches"
    assert change.before[0]["when"].endswith("hit == true")
    assert change.after[0]["when"].endswith("hit == false")


@pytest.mark.parametrize(
    ("old", "new", "path"),
    [
        ("class: fast", "class: slow", "class"),
        ("minLength: 1 }\n  required: [modelId]", "minLength: 2 }\n  required: [modelId]", "context"),
        (
            '  modelId: "${context.modelId}"\n  catalogueId',
            '  model: "${context.modelId}"\n  catalogueId',
            "output",
        ),
    ],
)
def test_definition_level_changes_are_reported_whole(old: str, new: str, path: str) -> None:
    after = plan(edited((old, new)))
    diff = diff_plans(plan(), after)
    assert [c.path for c in diff.definition] == [path]
    (change,) = diff.definition
    assert (change.before, change.after) == (plan()[path], after[path])
    assert f"~ {path}: " in "\n".join(diff.lines())


def test_a_run_deadline_is_a_definition_change() -> None:
    after = plan(edited(("entry: cache-lookup\n", "entry: cache-lookup\nrun_deadline_ms: 3600000\n")))
    diff = diff_plans(plan(), after)
    assert diff.definition == [FieldChange("run_deadline_ms", None, 3600000)]
    assert diff.changed == {} and diff.added == diff.removed == []
    assert diff.lines() == ["~ run_deadline_ms: null -> 3600000"]
    assert diff.to_json()["definition_changed"] == [
        {"path": "run_deadline_ms", "before": None, "after": 3600000}
    ]


def test_finalisers_changes_are_a_definition_change_and_a_contract_change() -> None:
    after = plan(edited(("finalisers: [audit.run-terminal@1]", "finalisers: []")))
    diff = diff_plans(plan(), after)
    assert diff.definition == [FieldChange("finalisers", ["audit.run-terminal@1"], [])]
    assert diff.contracts_removed == ["audit.run-terminal@1"]


def test_long_values_are_shortened_in_lines_but_whole_in_json() -> None:
    after = plan(edited(("minLength: 1 }\n  required: [modelId]", "minLength: 2 }\n  required: [modelId]")))
    diff = diff_plans(plan(), after)
    (line,) = diff.lines()
    assert line.startswith("~ context: ")
    before_text, after_text = line.removeprefix("~ context: ").split(" -> ")
    assert len(before_text) == len(after_text) == 80 and after_text.endswith("...")
    assert diff.to_json()["definition_changed"][0]["after"] == after["context"]
    json.dumps(diff.to_json())  # a JSON document as is


def test_stages_and_contracts_missing_from_a_plan_count_as_none() -> None:
    diff = diff_plans({}, plan())
    assert diff.added == sorted(plan()["stages"])
    assert diff.contracts_added == sorted(plan()["contracts"])
    assert diff_plans({}, {}).empty


def test_the_diff_is_the_reverse_of_the_reverse_diff() -> None:
    before, after = plan(), plan(with_reindex())
    forward, backward = diff_plans(before, after), diff_plans(after, before)
    assert (forward.added, forward.removed) == (backward.removed, backward.added)
    assert (forward.contracts_added, forward.contracts_removed) == (
        backward.contracts_removed,
        backward.contracts_added,
    )
    assert {s: [(c.path, c.after, c.before) for c in cs] for s, cs in forward.changed.items()} == {
        s: [(c.path, c.before, c.after) for c in cs] for s, cs in backward.changed.items()
    }


def test_a_contract_redeclared_under_the_same_version_is_a_change() -> None:
    before = compile_text((DEFINITIONS / "model-ingest.yaml").read_text(), "m.yaml", DEMO_REGISTRY).plan
    after = json.loads(json.dumps(before))
    after["contracts"]["cache.lookup@1"]["queue"] = "tasks.elsewhere"
    after["plan_format"] = 2
    diff = diff_plans(before, after)
    assert not diff.empty
    assert [c.path for c in diff.contracts_changed["cache.lookup@1"]] == ["queue"]
    assert [c.path for c in diff.definition] == ["plan_format"]
    assert "~ contract cache.lookup@1 (the same version, another declaration)" in diff.lines()

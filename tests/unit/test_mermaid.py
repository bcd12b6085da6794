"""Rendering compiled plans as Mermaid flowcharts (``saga graph``)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from orchestrator.compiler import compile_text
from orchestrator.compiler.mermaid import render_mermaid
from tests.conftest import DEFINITIONS, DEMO_REGISTRY, compile_yaml

DEFINITION_FILES = sorted(DEFINITIONS.glob("*.yaml"))

# a node definition: two spaces, an id, then one of the shapes with a quoted label
NODE = re.compile(
    r'^  (?P<id>S_\w+)(?P<left>\[\[|\[/|\[|\{\{|\{)"(?P<label>[^"]*)"(?P<right>\]\]|/\]|\]|\}\}|\})$'
)
SOLID_EDGE = re.compile(r'^  (?P<src>\w+) -->(?:\|"(?P<label>[^"]*)"\|)? (?P<dst>\w+)$')
DOTTED_EDGE = re.compile(r'^  (?P<src>\w+) -\. "(?P<label>[^"]*)" \.-> (?P<dst>\w+)$')
SHAPES = {
    "action": ("[", "]"),
    "worker": ("[[", "]]"),
    "map": ("[/", "/]"),
    "decision": ("{", "}"),
    "fork": ("{{", "}}"),
    "join": ("{{", "}}"),
}


def plan_of(definition: Path) -> dict[str, Any]:
    return compile_text(definition.read_bytes(), definition.name, DEMO_REGISTRY).plan


def nodes(text: str) -> dict[str, re.Match[str]]:
    """Stage nodes by the stage name their label starts with."""
    found: dict[str, re.Match[str]] = {}
    for line in text.splitlines():
        match = NODE.match(line)
        if match:
            name = match["label"].split("<br/>")[0]
            assert name not in found, f"stage {name} drawn twice"
            found[name] = match
    return found


def ids_by_stage(text: str) -> dict[str, str]:
    return {name: m["id"] for name, m in nodes(text).items()}


def solid_edges(text: str) -> list[tuple[str, str | None, str]]:
    return [
        (m["src"], m["label"], m["dst"]) for m in map(SOLID_EDGE.match, text.splitlines()) if m is not None
    ]


def dotted_edges(text: str) -> list[tuple[str, str, str]]:
    return [
        (m["src"], m["label"], m["dst"]) for m in map(DOTTED_EDGE.match, text.splitlines()) if m is not None
    ]


def target_id(target: str, ids: dict[str, str]) -> str:
    return f"T_{target}" if target in ("completed", "failed") else ids[target]


@pytest.fixture(params=DEFINITION_FILES, ids=lambda p: p.stem)
def rendered(request: pytest.FixtureRequest) -> tuple[dict[str, Any], str]:
    plan = plan_of(request.param)
    return plan, render_mermaid(plan)


# ---- every definition -------------------------------------------------------------------------------


def test_starts_with_a_flowchart_and_the_entry(rendered: tuple[dict[str, Any], str]) -> None:
    plan, text = rendered
    lines = text.splitlines()
    assert text.endswith("\n")
    assert lines[0] == "flowchart LR"
    ids = ids_by_stage(text)
    assert lines[1] == f'  start(("entry")) --> {ids[plan["entry"]]}'


def test_one_node_per_stage_with_its_shape(rendered: tuple[dict[str, Any], str]) -> None:
    plan, text = rendered
    found = nodes(text)
    assert set(found) == set(plan["stages"])
    assert len({m["id"] for m in found.values()}) == len(found), "node ids must be distinct"
    for name, stage in plan["stages"].items():
        match = found[name]
        assert (match["left"], match["right"]) == SHAPES[stage["type"]], name
        if stage["type"] == "action":
            assert match["label"] == f"{name}<br/>{stage['action']}"
        elif stage["type"] == "worker":
            assert match["label"] == f"{name}<br/>{stage['worker']} on {stage['queue']}"


def test_success_and_failure_edges_of_work_stages_and_joins(rendered: tuple[dict[str, Any], str]) -> None:
    plan, text = rendered
    ids = ids_by_stage(text)
    solid, dotted = solid_edges(text), dotted_edges(text)
    for name, stage in plan["stages"].items():
        if stage["type"] in ("action", "worker", "map", "join"):
            assert (ids[name], "success", target_id(stage["on_success"], ids)) in solid
            # failure routes are dotted, never solid
            assert (ids[name], "failure", target_id(stage["on_failure"], ids)) in dotted
            assert not any(src == ids[name] and label == "failure" for src, label, _ in solid)


def test_decision_routes_are_labelled_with_their_expression(rendered: tuple[dict[str, Any], str]) -> None:
    plan, text = rendered
    ids = ids_by_stage(text)
    solid, dotted = solid_edges(text), dotted_edges(text)
    for name, stage in plan["stages"].items():
        if stage["type"] != "decision":
            continue
        labelled = [(label, dst) for src, label, dst in solid if src == ids[name]]
        expected = [
            (
                "fallback" if b["when"].strip() == "true" else b["when"].replace('"', "#quot;"),
                target_id(b["next"], ids),
            )
            for b in stage["branches"]
        ]
        assert labelled == expected  # in branch order
        assert (ids[name], "evaluation error", target_id(stage["on_evaluation_error"], ids)) in dotted


def test_fork_branches_are_unlabelled_edges(rendered: tuple[dict[str, Any], str]) -> None:
    plan, text = rendered
    ids = ids_by_stage(text)
    solid = solid_edges(text)
    for name, stage in plan["stages"].items():
        if stage["type"] == "fork":
            assert [(label, dst) for src, label, dst in solid if src == ids[name]] == [
                (None, ids[b]) for b in stage["branches"]
            ]


def test_terminal_intents_lead_to_the_finaliser(rendered: tuple[dict[str, Any], str]) -> None:
    plan, text = rendered
    lines = text.splitlines()
    finalisers = plan["finalisers"]
    label = "finalise in declared order: " + ", ".join(finalisers) if finalisers else "no finalisers"
    assert f'  Z["{label}"]' in lines
    for terminal in plan["terminals"]:
        assert f'  T_{terminal}(["{terminal} intent"]) --> Z' in lines
    assert lines[-2:] == [
        '  Z -->|"completed intent and every finaliser succeeded"| C(["completed"])',
        '  Z -->|"failed intent or a finaliser failed"| X(["failed"])',
    ]


def test_every_edge_joins_drawn_nodes(rendered: tuple[dict[str, Any], str]) -> None:
    _, text = rendered
    drawn = set(ids_by_stage(text).values()) | {"T_completed", "T_failed", "Z"}
    edges = solid_edges(text) + dotted_edges(text)
    assert edges
    for src, _, dst in edges:
        assert src in drawn, src
        assert dst in drawn, dst


def test_rendering_is_deterministic(rendered: tuple[dict[str, Any], str]) -> None:
    plan, text = rendered
    assert render_mermaid(plan) == text


# ---- particular shapes and labels -------------------------------------------------------------------


def test_model_ingest_quotes_in_expressions_are_escaped() -> None:
    text = render_mermaid(plan_of(DEFINITIONS / "model-ingest.yaml"))
    lines = text.splitlines()
    assert '  S_cache_route -->|"stages[#quot;cache-lookup#quot;].result.hit == true"| S_publish' in lines
    assert '  S_cache_route -->|"fallback"| S_render_thumbnail' in lines
    assert '  S_cache_route -. "evaluation error" .-> T_failed' in lines
    assert '  S_cache_route{"cache-route"}' in lines
    assert '  S_derive_fork{{"derive-fork<br/>fork"}}' in lines
    assert '  S_derive_join{{"derive-join<br/>join: all completed"}}' in lines


def test_ingest_triage_fallbacks_and_list_literals() -> None:
    lines = render_mermaid(plan_of(DEFINITIONS / "ingest-triage.yaml")).splitlines()
    assert '  S_size_gate -->|"context.sizeMb > 2048.0"| T_failed' in lines
    assert '  S_size_gate -->|"fallback"| S_format_gate' in lines
    assert (
        '  S_format_gate -->|"context.format in [#quot;glb#quot;, #quot;gltf#quot;, #quot;obj#quot;, '
        '#quot;stl#quot;]"| T_completed'
    ) in lines
    assert '  S_format_gate -->|"fallback"| T_failed' in lines
    assert '  Z["no finalisers"]' in lines


def test_map_stage_shape() -> None:
    lines = render_mermaid(plan_of(DEFINITIONS / "thumbnail-batch.yaml")).splitlines()
    assert '  S_render_all[/"render-all<br/>thumbnail.render@3 per item, max 10000"/]' in lines
    assert '  S_render_all -->|"success"| T_completed' in lines
    assert '  S_render_all -. "failure" .-> T_failed' in lines


def test_long_expressions_are_shortened() -> None:
    when = 'context.format == "a-very-long-format-name-that-goes-on-and-on"'
    plan = compile_yaml(
        f"""\
        name: long-labels
        version: "1"
        entry: gate
        context:
          type: object
          properties: {{ format: {{ type: string }} }}
        stages:
          - name: gate
            type: decision
            branches:
              - when: '{when}'
                next: completed
              - when: " true "
                next: failed
        """
    ).plan
    lines = render_mermaid(plan).splitlines()
    label = (when[:47] + "…").replace('"', "#quot;")
    assert f'  S_gate -->|"{label}"| T_completed' in lines
    assert '  S_gate -->|"fallback"| T_failed' in lines


def test_stage_names_that_differ_only_in_dash_and_underscore_get_distinct_nodes() -> None:
    plan = compile_yaml(
        """\
        name: lookalikes
        version: "1"
        entry: step-one
        stages:
          - name: step-one
            type: action
            action: cache.lookup@1
            input: { modelId: "m-1" }
            on_success: step_one
          - name: step_one
            type: action
            action: cache.lookup@1
            input: { modelId: "m-1" }
            on_success: completed
        """
    ).plan
    text = render_mermaid(plan)
    ids = ids_by_stage(text)
    assert set(ids) == {"step-one", "step_one"}
    assert ids["step-one"] != ids["step_one"]
    assert (ids["step-one"], "success", ids["step_one"]) in solid_edges(text)
    assert not any(src == dst for src, _, dst in solid_edges(text) + dotted_edges(text)), "no self-loops"

"""The console's plan graph (``orchestrator.console.graph``): every stage and route of every definition is
drawn once with its data attributes, the SVG is standalone and the same bytes for the same plan, user text
is escaped, and no plan makes the layout overlap two nodes or raise."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.compiler import compile_text
from orchestrator.console.graph import Box, Layout, layout, plan_svg, safe_id
from tests.conftest import DEFINITIONS, DEMO_REGISTRY, ROOT, compile_yaml
from tests.unit.test_compiler_properties import valid_definitions

SVG = "{http://www.w3.org/2000/svg}"
DEFINITION_FILES = sorted(DEFINITIONS.glob("*.yaml"))
STAGE_TYPES = ("action", "worker", "map", "decision", "fork", "join")
PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def plan_of(definition: Path) -> dict[str, Any]:
    return compile_text(definition.read_bytes(), definition.name, DEMO_REGISTRY).plan


def parse(svg: str) -> ET.Element:
    root = ET.fromstring(svg)
    assert root.tag == f"{SVG}svg"
    return root


def stage_groups(root: ET.Element) -> list[ET.Element]:
    return [g for g in root.iter(f"{SVG}g") if g.get("class") == "stage"]


def terminal_groups(root: ET.Element) -> list[ET.Element]:
    return [g for g in root.iter(f"{SVG}g") if g.get("class") == "terminal"]


def edge_paths(root: ET.Element) -> list[ET.Element]:
    return [p for p in root.iter(f"{SVG}path") if "edge" in (p.get("class") or "").split()]


def child(element: ET.Element, tag: str, cls: str) -> list[ET.Element]:
    return [c for c in element if c.tag == f"{SVG}{tag}" and c.get("class") == cls]


def expected_edges(plan: dict[str, Any]) -> Counter[tuple[str, str, str, str | None]]:
    """The routes of a plan as (from, to, kind, title), read from the plan independently of the module."""
    found: Counter[tuple[str, str, str, str | None]] = Counter()
    for name, stage in plan["stages"].items():
        if stage["type"] == "fork":
            found.update((name, b, "branch", None) for b in stage["branches"])
        elif stage["type"] == "decision":
            found.update((name, b["next"], "branch", b["when"]) for b in stage["branches"])
            found[(name, stage["on_evaluation_error"], "failure", "on evaluation error")] += 1
        else:
            found[(name, stage["on_success"], "success", None)] += 1
            found[(name, stage["on_failure"], "failure", None)] += 1
    return found


def drawn_edges(root: ET.Element) -> Counter[tuple[str, str, str, str | None]]:
    found: Counter[tuple[str, str, str, str | None]] = Counter()
    for path in edge_paths(root):
        classes = path.get("class", "").split()
        (kind,) = [c.removeprefix("edge-") for c in classes if c.startswith("edge-")]
        titles = [c for c in path if c.tag == f"{SVG}title"]
        title = titles[0].text if titles else None
        found[(path.get("data-from", ""), path.get("data-to", ""), kind, title)] += 1
    return found


def assert_standalone(svg: str, root: ET.Element) -> None:
    assert root.get("viewBox") and root.get("width") and root.get("height")
    assert svg.startswith('<svg xmlns="http://www.w3.org/2000/svg"')
    for element in root.iter():
        assert element.tag.startswith(SVG), element.tag  # no foreign namespaces, no <foreignObject> content
        assert element.tag not in (f"{SVG}script", f"{SVG}foreignObject", f"{SVG}image", f"{SVG}use")
        for attr, value in element.attrib.items():
            assert not attr.startswith("on"), attr
            assert "href" not in attr, attr
            if "url(" in value:
                assert value.startswith("url(#"), value


def overlapping(a: Box, b: Box) -> bool:
    return a.left < b.right and b.left < a.right and a.top < b.bottom and b.top < a.bottom


def assert_sound(placed: Layout) -> None:
    boxes = [*placed.stages.values(), *placed.terminals.values()]
    for i, a in enumerate(boxes):
        assert a.left >= 0 and a.top >= 0 and a.right <= placed.width and a.bottom <= placed.height, a
        for b in boxes[i + 1 :]:
            assert not overlapping(a, b), (a, b)
    for route in placed.routes:
        assert len(route.points) >= 2
        assert all(0 <= x <= placed.width and 0 <= y <= placed.height for x, y in route.points), route


# ---- the definitions in definitions/ ----------------------------------------------------------------


@pytest.mark.parametrize("definition", DEFINITION_FILES, ids=lambda p: p.stem)
def test_every_stage_is_drawn_once_with_its_data_attributes(definition: Path) -> None:
    plan = plan_of(definition)
    svg = plan_svg(plan)
    root = parse(svg)
    assert_standalone(svg, root)
    groups = stage_groups(root)
    assert sorted(g.get("data-stage", "") for g in groups) == sorted(plan["stages"])
    for g in groups:
        name = g.get("data-stage", "")
        stage = plan["stages"][name]
        assert g.get("data-type") == stage["type"]
        assert g.get("data-state") == ""
        assert g.get("id") == f"stage-{safe_id(name)}"
        assert len(child(g, "rect", "shape") + child(g, "polygon", "shape")) == 1
        assert [t.text for t in child(g, "text", "label")] == [name]
        contract = stage.get("action") or stage.get("worker") or stage["type"]
        assert [t.text for t in child(g, "text", "detail")] == [contract]
        progress = child(g, "text", "progress")
        if stage["type"] == "map":
            assert [(p.get("data-stage"), p.text) for p in progress] == [(name, None)]
        else:
            assert progress == []
    assert len({g.get("id") for g in groups + terminal_groups(root)}) == len(groups) + len(
        terminal_groups(root)
    )


@pytest.mark.parametrize("definition", DEFINITION_FILES, ids=lambda p: p.stem)
def test_every_route_is_drawn_between_nodes_that_exist(definition: Path) -> None:
    plan = plan_of(definition)
    root = parse(plan_svg(plan))
    assert drawn_edges(root) == expected_edges(plan)
    terminals = {(t.get("data-source"), t.get("data-terminal")) for t in terminal_groups(root)}
    for path in edge_paths(root):
        source, target = path.get("data-from"), path.get("data-to")
        assert source in plan["stages"]
        assert target in plan["stages"] or (source, target) in terminals
        assert path.get("marker-end", "").startswith("url(#plan-arrow-")
        assert path.get("d", "").startswith("M")
    # and every terminal node is the end of some route
    assert terminals == {
        (p.get("data-from"), p.get("data-to"))
        for p in edge_paths(root)
        if p.get("data-to") not in plan["stages"]
    }
    assert {t for _, t in terminals} <= set(plan["terminals"])


@pytest.mark.parametrize("definition", DEFINITION_FILES, ids=lambda p: p.stem)
def test_layout_of_each_definition_is_sound(definition: Path) -> None:
    placed = layout(plan_of(definition))
    assert_sound(placed)
    # top to bottom: a route's target sits below its source unless the route closes a cycle
    for route in placed.routes:
        source = placed.stages[route.edge.source]
        target = (
            placed.stages.get(route.edge.target) or placed.terminals[(route.edge.source, route.edge.target)]
        )
        assert target.y > source.y, route.edge


def test_the_model_ingest_drawing_shows_its_contracts_and_conditions() -> None:
    plan = plan_of(DEFINITIONS / "model-ingest.yaml")
    root = parse(plan_svg(plan))
    render = next(g for g in stage_groups(root) if g.get("data-stage") == "render-thumbnail")
    assert [t.text for t in child(render, "text", "detail")] == ["thumbnail.render@3"]
    titles = {
        (p.get("data-to"), p[0].text)
        for p in edge_paths(root)
        if p.get("data-from") == "cache-route" and len(p)
    }
    assert ("publish", 'stages["cache-lookup"].result.hit == true') in titles
    assert ("render-thumbnail", "true") in titles
    assert [
        len(child(g, "polygon", "shape")) for g in stage_groups(root) if g.get("data-type") == "decision"
    ] == [1]


# ---- determinism --------------------------------------------------------------------------------


@pytest.mark.parametrize("definition", DEFINITION_FILES, ids=lambda p: p.stem)
def test_the_same_plan_gives_the_same_bytes(definition: Path) -> None:
    plan = plan_of(definition)
    first = plan_svg(plan)
    assert plan_svg(copy.deepcopy(plan)) == first
    # as stored: canonical JSON, keys sorted, so stages come back in another order
    assert plan_svg(json.loads(json.dumps(plan, sort_keys=True))) == first
    reordered = {**plan, "stages": dict(reversed(list(plan["stages"].items())))}
    assert plan_svg(reordered) == first


def test_the_bytes_do_not_depend_on_the_process() -> None:
    """grandalf keeps some things in sets of objects hashed by address; another process (another hash
    seed, other addresses) must draw the same bytes."""
    script = textwrap.dedent(
        """
        import sys
        from orchestrator.compiler import compile_text
        from orchestrator.console.graph import plan_svg
        from tests.conftest import DEFINITIONS, DEMO_REGISTRY
        path = DEFINITIONS / "model-ingest.yaml"
        sys.stdout.write(plan_svg(compile_text(path.read_bytes(), path.name, DEMO_REGISTRY).plan))
        """
    )
    outputs = set()
    for seed in ("0", "1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run(
            [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, check=True
        )
        outputs.add(done.stdout)
    assert outputs == {plan_svg(plan_of(DEFINITIONS / "model-ingest.yaml"))}


# ---- hostile text -------------------------------------------------------------------------------

HOSTILE_WHEN = """context.modelId == "</title><script>alert('x')</script> & \\"q\\" ]]>" """.strip()


def test_conditions_from_the_definition_are_escaped() -> None:
    plan = compile_yaml(
        f"""
        name: hostile
        version: "1"
        entry: gate
        context: {{type: object, required: [modelId], properties: {{modelId: {{type: string}}}}}}
        stages:
          - name: gate
            type: decision
            branches:
              - when: {json.dumps(HOSTILE_WHEN)}
                next: failed
              - when: "true"
                next: completed
        """
    ).plan
    svg = plan_svg(plan)
    root = parse(svg)
    assert_standalone(svg, root)
    assert "<script" not in svg
    titles = [p[0].text for p in edge_paths(root) if len(p)]
    assert HOSTILE_WHEN in titles


def rename(plan: dict[str, Any], old: str, new: str) -> dict[str, Any]:
    """The plan with stage ``old`` called ``new`` and every route to it changed to match."""
    text = json.dumps(plan["stages"])
    stages = json.loads(text.replace(json.dumps(old), json.dumps(new)))
    out = {**plan, "stages": {new if k == old else k: v for k, v in stages.items()}}
    if out["entry"] == old:
        out["entry"] = new
    return out


HOSTILE_NAMES = [
    '<script>alert("x")</script>',
    "a\" onload='alert(1)' b=\"",
    "]]></svg><svg onload=alert(1)>",
    "&amp; &lt;x&gt; & < > ' \"",
    "tab\tnew\nline",
    "ünïcødé 名前 🚀",
]


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_stage_names_are_escaped_in_text_and_attributes(name: str) -> None:
    plan = rename(plan_of(DEFINITIONS / "model-ingest.yaml"), "render-thumbnail", name)
    plan = rename(plan, "publish", name + "2")
    svg = plan_svg(plan)
    root = parse(svg)
    assert_standalone(svg, root)
    assert "<script" not in svg
    (group,) = [g for g in stage_groups(root) if g.get("data-stage") == name]
    assert [t.text for t in child(group, "text", "label")] == [name]
    assert drawn_edges(root) == expected_edges(plan)
    ids = [e.attrib["id"] for e in root.iter() if "id" in e.attrib]
    assert len(ids) == len(set(ids))
    assert all(re.fullmatch(r"[a-z][a-z0-9_-]*", i) for i in ids), ids


def test_characters_xml_cannot_carry_are_replaced_not_emitted() -> None:
    plan = rename(plan_of(DEFINITIONS / "catalogue-reindex.yaml"), "rebuild", "nul\x00bell\x07")
    root = parse(plan_svg(plan))
    assert "nul\ufffdbell\ufffd" in {g.get("data-stage") for g in stage_groups(root)}


def test_safe_ids_keep_distinct_names_distinct() -> None:
    names = ["a_b", "a-b", "a__b", "a_x5f_b", "A", "a", "_x41_", "a_to_b", "a b", ""]
    assert len({safe_id(n) for n in names}) == len(names)


# ---- properties ----------------------------------------------------------------------------------


@PROPERTY
@given(valid_definitions())
def test_no_compiled_plan_overlaps_two_nodes(defn: dict[str, Any]) -> None:
    plan = compile_text(yaml.safe_dump(defn, sort_keys=False), "prop.yaml", DEMO_REGISTRY).plan
    placed = layout(plan)
    assert_sound(placed)
    assert set(placed.stages) == set(plan["stages"])
    root = parse(plan_svg(plan))
    assert len(stage_groups(root)) == len(plan["stages"])
    assert drawn_edges(root) == expected_edges(plan)


NAMES = st.text(min_size=1, max_size=10)


@st.composite
def raw_plans(draw: st.DrawFn) -> dict[str, Any]:
    """Plan dicts the compiler would refuse: cycles, self loops, unknown targets, parts out of reach of
    the entry, any text as a name. The drawing must still come out."""
    names = draw(st.lists(NAMES, min_size=1, max_size=8, unique=True))
    target = st.sampled_from([*names, "completed", "failed", "elsewhere"])
    stages: dict[str, Any] = {}
    for name in names:
        kind = draw(st.sampled_from(STAGE_TYPES))
        stage: dict[str, Any] = {"type": kind}
        if kind == "decision":
            whens = st.lists(st.tuples(st.text(max_size=20), target), min_size=1, max_size=3)
            stage["branches"] = [{"when": w, "next": n} for w, n in draw(whens)]
            stage["on_evaluation_error"] = draw(target)
        elif kind == "fork":
            stage["branches"] = draw(st.lists(st.sampled_from(names), min_size=1, max_size=3))
        else:
            stage.update(on_success=draw(target), on_failure=draw(target))
            if kind != "join":
                stage["action" if kind == "action" else "worker"] = draw(st.text(max_size=30))
        stages[name] = stage
    return {
        "name": draw(NAMES),
        "version": "1",
        "entry": draw(st.sampled_from([*names, "nowhere"])),
        "stages": stages,
        "terminals": ["completed", "failed"],
        "finalisers": draw(st.lists(st.text(max_size=10), max_size=2)),
    }


@PROPERTY
@given(raw_plans())
def test_no_plan_dict_makes_the_layout_raise_or_overlap(plan: dict[str, Any]) -> None:
    placed = layout(plan)
    assert_sound(placed)
    svg = plan_svg(plan)
    root = parse(svg)
    assert_standalone(svg, root)
    assert len(stage_groups(root)) == len(plan["stages"])
    assert sum(drawn_edges(root).values()) == sum(expected_edges(plan).values())
    assert plan_svg(plan) == svg

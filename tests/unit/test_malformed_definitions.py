"""The malformed-definition suite: one rejected definition per check the compiler makes.

Each test asserts that the definition is rejected, that the message names the offending element and that
the problem's ``path`` and ``line`` point at it (the line is found independently of the compiler, never
counted by hand). Variants edit the data of one small valid definition, ``BASE``, and dump it again.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import pytest
import yaml

from orchestrator.compiler import AdmissionLimits, compile_text
from orchestrator.contracts import Registry
from orchestrator.dsl.expressions import ExpressionLimits
from orchestrator.dsl.yaml_source import YamlLimits
from orchestrator.errors import DefinitionError, Problem
from tests.conftest import DEMO_REGISTRY, compile_yaml, problems_of

FILE = "test.yaml"
BASE = """\
name: model-ingest
version: "2.3.0"
entry: cache-lookup
context:
  type: object
  properties:
    modelId: {type: string, minLength: 1}
    count: {type: integer}
    ids: {type: array, items: {type: string}}
  required: [modelId]
stages:
  - name: cache-lookup
    type: action
    action: cache.lookup@1
    input: {modelId: "${context.modelId}"}
    on_success: cache-route
  - name: cache-route
    type: decision
    branches:
      - {when: 'stages["cache-lookup"].result.hit', next: publish}
      - {when: "true", next: render}
  - name: render
    type: worker
    worker: thumbnail.render@3
    input: {modelId: "${context.modelId}"}
    on_success: derive
  - name: derive
    type: fork
    branches: [semantic, metadata]
  - name: semantic
    type: worker
    worker: semantic.analyse@4
    input: {modelId: "${context.modelId}"}
    on_success: derive-join
  - name: metadata
    type: worker
    worker: metadata.extract@2
    input: {modelId: "${context.modelId}"}
    on_success: derive-join
  - name: derive-join
    type: join
    required: [semantic, metadata]
    on_success: publish
  - name: publish
    type: action
    action: catalogue.publish@2
    input: {modelId: "${context.modelId}"}
    on_success: completed
finalisers: [audit.run-terminal@1]
"""
# A worker with an integer input, for type checks the demo contracts (all strings) cannot exercise.
STATS_INPUT = {"type": "object", "properties": {"modelId": {"type": "string"}, "count": {"type": "integer"}}}
STATS = DEMO_REGISTRY.require("metadata.extract@2").model_copy(update={"name": "stats.count"})
STATS = STATS.model_copy(update={"version": 1, "input_schema": STATS_INPUT})
STATS_REGISTRY = Registry([*DEMO_REGISTRY.contracts(), STATS])

Limits = AdmissionLimits
INPUT = {"modelId": "${context.modelId}"}
CASE = ("edit", "path", "fragments")
Edit = Callable[[dict[str, Any]], object]
At = int | str  # a line, or a needle whose first occurrence is on it


# ---- helpers ----------------------------------------------------------------------------------------


def stage(data: dict[str, Any], name: str) -> dict[str, Any]:
    return next(s for s in data["stages"] if s["name"] == name)


def variant(*edits: Edit) -> str:
    """BASE with ``edits`` applied to its data, dumped back to YAML (block style)."""
    data = yaml.safe_load(BASE)
    for edit in edits:
        edit(data)
    return yaml.safe_dump(data, sort_keys=False)


def seq(*edits: Edit) -> Edit:
    return lambda data: [edit(data) for edit in edits]


def top(**fields: Any) -> Edit:
    return lambda data: data.update(fields)


def on(name: str, /, **fields: Any) -> Edit:
    return lambda data: stage(data, name).update(fields)


def drop(key: str, name: str | None = None) -> Edit:
    return lambda data: (stage(data, name) if name else data).pop(key)


def bind(name: str, value: Any, key: str = "modelId") -> Edit:
    return lambda data: stage(data, name)["input"].update({key: value})


def branch(i: int, **fields: Any) -> Edit:
    return lambda data: stage(data, "cache-route")["branches"][i].update(fields)


def append(*stages: dict[str, Any]) -> Edit:
    return lambda data: data["stages"].extend(stages)


def worker(name: str, then: str) -> dict[str, Any]:
    return dict(name=name, type="worker", worker="metadata.extract@2", input=INPUT, on_success=then)


def as_map(**fields: Any) -> Edit:
    """Make ``render`` (stages[2]) a map over ``context.ids``."""
    new = {"name": "render", "type": "map", "worker": "thumbnail.render@3", "items": "${context.ids}"}
    new |= {"max_items": 500, "input": {"modelId": "${item}"}, "on_success": "derive"}
    return lambda data: data["stages"].__setitem__(2, new | fields)


def second_fork(data: dict[str, Any]) -> None:
    """After derive-join: fork-2 -> left, right -> join-2 -> publish (stages[8..11])."""
    stage(data, "derive-join")["on_success"] = "fork-2"
    fork = {"name": "fork-2", "type": "fork", "branches": ["left", "right"]}
    join = {"name": "join-2", "type": "join", "required": ["left", "right"], "on_success": "publish"}
    data["stages"].extend([fork, worker("left", "join-2"), worker("right", "join-2"), join])


def rejected(text: str, limits: Limits | None = None, registry: Registry | None = None) -> list[Problem]:
    if registry is None:
        return problems_of(text, limits)  # fails the test if the definition compiles
    with pytest.raises(DefinitionError) as caught:
        compile_text(text, FILE, registry, limits)
    return caught.value.problems


def line_at(text: str, path: str = "", needle: str = "") -> int:
    """The line of the first occurrence of ``needle``, or where ``path`` (as problems render it) is written,
    found with PyYAML's composer independently of the compiler's source map: a mapping entry's key line, a
    list item's first line or, for a field never written, the line of its nearest written ancestor."""
    if needle:
        return text[: text.index(needle)].count("\n") + 1
    node = yaml.compose(text)
    line = node.start_mark.line + 1
    for part in re.findall(r"[^.\[\]]+", "" if path == "definition" else path):
        if isinstance(node, yaml.MappingNode):
            entry = next(((k, v) for k, v in node.value if k.value == part), None)
            if entry is None:
                break
            line, node = entry[0].start_mark.line + 1, entry[1]
        elif isinstance(node, yaml.SequenceNode) and part.isdigit() and int(part) < len(node.value):
            node = node.value[int(part)]
            line = node.start_mark.line + 1
        else:
            break
    return line


def expect(text: str, path: str, *fragments: str, at: At | None = None, **options: Any) -> list[Problem]:
    """Assert a problem at ``path``, on ``at`` (default: where ``path`` is written), naming every fragment."""
    problems = rejected(text, **options)
    shown = "\n".join(str(p) for p in problems)
    hits = [p for p in problems if p.path == path and all(f in p.message for f in fragments)]
    assert hits, f"no problem at {path} mentioning {fragments}; got:\n{shown}"
    line = line_at(text, path) if at is None else at if isinstance(at, int) else line_at(text, needle=at)
    assert hits[0].line == line, f"expected line {line} for {hits[0]}; got:\n{shown}"
    assert hits[0].file == FILE
    return problems


def test_base_definition_compiles() -> None:
    assert compile_yaml(BASE).digest == compile_yaml(variant()).digest


# ---- YAML layer -------------------------------------------------------------------------------------

BOMB = 'a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]\n' + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(9)
)
ENTRY = "entry: cache-lookup\n"
WHEN = "stages[1].branches[0].when"
TAGGED = "input: !!python/object/apply:os.system [ls]\n    on_success: cache-route"
# fmt: off
YAML_CASES = {
    "syntax": (BASE.replace(ENTRY, "entry: cache-lookup: x\n"), "definition", "entry:",
        ["invalid YAML: mapping values are not allowed here"]),
    "syntax-indentation": (BASE.replace("derive\n", "derive\n   misindented: x\n", 1), "definition",
        "misindented", ["invalid YAML: expected <block end>"]),
    "two-documents": (BASE + "---\nname: other\n", "definition", "---", ["single document"]),
    "duplicate-key": (BASE.replace(ENTRY, ENTRY + "entry: render\n"), "entry", "entry: render",
        ["duplicate key 'entry' (first written on line 3)"]),
    "non-string-key": (BASE.replace("worker\n", "worker\n    42: x\n", 1), "stages[2]", "42: x",
        ["key 42 must be a string"]),
    "python-tag": (re.sub(r"input: .*\n    on_success: cache-route", TAGGED, BASE), "stages[0].input",
        "os.system", ["'tag:yaml.org,2002:python/object/apply:os.system' is not allowed"]),
    "python-scalar-tag": (BASE.replace("name: model-ingest", "name: !!python/name:os.system x"), "name", 1,
        ["python/name:os.system"]),
    "custom-tag": (BASE.replace(ENTRY, "entry: !stage cache-lookup\n"), "entry", "entry:", ["'!stage'"]),
    "too-deep": (BASE.replace(ENTRY, f"entry: {'[' * 70}{']' * 70}\n"), "definition", "entry:",
        ["nesting deeper than 64 levels"]),
    "empty-file": ("", "definition", 1, ["file is empty"]),
    "top-level-list": ("- name: x\n- version: '1'\n", "definition", 1, ["a mapping of fields", "not a list"]),
}
# fmt: on


class TestYamlLayer:
    @pytest.mark.parametrize(("text", "path", "at", "fragments"), YAML_CASES.values(), ids=YAML_CASES.keys())
    def test_rejected_while_loading(self, text: str, path: str, at: At, fragments: list[str]) -> None:
        expect(text, path, *fragments, at=at)

    def test_billion_laughs_fails_fast(self) -> None:
        started = time.perf_counter()
        problems = expect(BOMB, "definition", "more than 100 alias expansions", "billion laughs", at=2)
        assert time.perf_counter() - started < 1.0
        assert len(problems) == 1

    def test_node_count_limit(self) -> None:
        limits = Limits(yaml=YamlLimits(max_nodes=20))
        expect(BASE, "definition", "more than 20 values", at="count:", limits=limits)

    def test_file_over_size_limit(self) -> None:
        limits = Limits(yaml=YamlLimits(max_bytes=512))
        expect(BASE, "definition", f"file is {len(BASE)} bytes, over the 512 limit", at=1, limits=limits)


# ---- shape ------------------------------------------------------------------------------------------

# fmt: off
SHAPE_CASES = {
    **{f"missing-{key}": (drop(key), "definition", [f"missing required field {key!r}"])
       for key in ("name", "version", "entry", "stages")},
    "missing-on-success": (drop("on_success", "render"), "stages[2]",
        ["stage 'render'", "missing required field 'on_success'"]),
    "missing-type": (drop("type", "render"), "stages[2]", ["'render'", "no 'type'; expected one of"]),
    "unknown-top-field": (top(retries=3), "retries", ["unknown field 'retries' (allowed: class"]),
    "unknown-stage-field": (on("render", timeout_ms=5), "stages[2].timeout_ms",
        ["'render'", "unknown field 'timeout_ms'", "execution_deadline_ms"]),
    "unknown-retry-field": (on("render", retry={"max_attempt": 3}), "stages[2].retry.max_attempt",
        ["unknown field 'max_attempt'", "initial_backoff_ms, jitter"]),
    "unknown-branch-field": (branch(0, then="x"), "stages[1].branches[0].then",
        ["unknown field 'then' (allowed: next, when)"]),
    "unknown-stage-type": (on("render", type="lambda"), "stages[2].type",
        ["unknown stage type 'lambda'", "action, worker, map, decision, fork, join"]),
    "uppercase-stage-name": (on("render", name="Render"), "stages[2].name", ["'Render' is not valid"]),
    "long-name": (top(name="a" * 65), "name", ["'aaaa", "at most 64 characters"]),
    "ref-without-version": (on("cache-lookup", action="cache.lookup"), "stages[0].action",
        ["'cache.lookup' is not valid", "name@version"]),
    "bad-compensate-ref": (on("publish", compensate="undo"), "stages[7].compensate",
        ["'undo' is not valid", "name@version"]),
    "bad-finaliser-ref": (top(finalisers=["audit"]), "finalisers[0]", ["'audit' is not valid"]),
    "bad-class": (top(**{"class": "Fast"}), "class", ["'Fast' is not valid", "shard class"]),
    "bad-terminal": (top(terminals=["completed", "aborted"]), "terminals[1]", ["'failed' (got 'aborted')"]),
    "no-terminals": (top(terminals=[]), "terminals", ["at least 1 item"]),
    "bad-terminal-policy": (top(terminal_policy={"late_callbacks": "accept"}),
        "terminal_policy.late_callbacks", ["(got 'accept')"]),
    "fork-1-branch": (on("derive", branches=["semantic"]), "stages[3].branches", ["'derive'", "at least 2"]),
    "bad-join-state": (on("derive-join", acceptable_terminal_states=["exploded"]),
        "stages[6].acceptable_terminal_states[0]", ["'timed-out'", "'exploded'"]),
    "negative-deadline": (on("render", execution_deadline_ms=-5), "stages[2].execution_deadline_ms",
        ["'render'", "greater than or equal to 1 (got -5)"]),
    "zero-deadline": (on("render", queue_deadline_ms=0), "stages[2].queue_deadline_ms",
        ["greater than or equal to 1 (got 0)"]),
    "negative-run-deadline": (top(run_deadline_ms=-1), "run_deadline_ms", ["(got -1)"]),
    "retry-zero-attempts": (on("render", retry={"max_attempts": 0}), "stages[2].retry.max_attempts",
        ["greater than or equal to 1 (got 0)"]),
    "retry-multiplier": (on("render", retry={"backoff_multiplier": 11.0}),
        "stages[2].retry.backoff_multiplier", ["less than or equal to 10"]),
    "jitter": (on("render", retry={"jitter": 1.5}), "stages[2].retry.jitter", ["less than or equal to 1"]),
    "map-packs-none": (as_map(items_per_message=0), "stages[2].items_per_message",
        ["greater than or equal to 1 (got 0)"]),
    "map-packs-too-many": (as_map(items_per_message=101), "stages[2].items_per_message",
        ["less than or equal to 100"]),
    "retry-negative-backoff": (on("render", retry={"initial_backoff_ms": -1}),
        "stages[2].retry.initial_backoff_ms", ["(got -1)"]),
    "retry-string-attempts": (on("render", retry={"max_attempts": "3"}), "stages[2].retry.max_attempts",
        ["valid integer (got '3')"]),
    "input-not-mapping": (on("render", input=["modelId"]), "stages[2].input", ["valid dictionary"]),
    "map-without-items": (on("render", type="map"), "stages[2]", ["missing required field 'items'"]),
    "integer-version": (top(version=2), "version", ["must be a string, got 2", "quote it"]),
}
# fmt: on


class TestShape:
    @pytest.mark.parametrize(CASE, SHAPE_CASES.values(), ids=SHAPE_CASES.keys())
    def test_shape_problem(self, edit: Edit, path: str, fragments: list[str]) -> None:
        expect(variant(edit), path, *fragments)

    def test_unquoted_float_version(self) -> None:
        text = BASE.replace('version: "2.3.0"', "version: 2.3")
        expect(text, "version", "must be a string, got 2.3", "quote it in YAML", at="version:")

    def test_shape_problems_stop_before_later_layers(self) -> None:
        text = variant(top(entry="nowhere"), on("render", timeout_ms=5))
        assert [p.path for p in rejected(text)] == ["stages[2].timeout_ms"]


# ---- admission --------------------------------------------------------------------------------------

DEADLINES = Limits(max_stage_deadline_ms=5000)
# fmt: off
ADMISSION_CASES = {
    "stages": (Limits(max_stages=5), seq(), "stages", ["8 stages", "limit of 5"]),
    "fork-branches": (Limits(max_fork_branches=1), seq(), "stages[3].branches",
        ["'derive'", "2 fork branches", "limit of 1"]),
    "map-items": (Limits(max_map_items=100), as_map(), "stages[2].max_items",
        ["'render'", "500 max_items", "limit of 100"]),
    "max-attempts": (Limits(max_attempts=5), on("render", retry={"max_attempts": 7}),
        "stages[2].retry.max_attempts", ["'render'", "7 max_attempts", "limit of 5"]),
    "max-backoff": (None, on("render", retry={"max_backoff_ms": 90_000_000}),
        "stages[2].retry.max_backoff_ms", ["90000000 max_backoff_ms", "limit of 86400000"]),
    "initial-over-max-backoff": (None, on("render", retry={"initial_backoff_ms": 900, "max_backoff_ms": 500}),
        "stages[2].retry.initial_backoff_ms", ["initial_backoff_ms (900) exceeds max_backoff_ms (500)"]),
    "execution-deadline": (DEADLINES, on("render", execution_deadline_ms=7000),
        "stages[2].execution_deadline_ms", ["7000 execution_deadline"]),
    "queue-deadline": (DEADLINES, on("render", queue_deadline_ms=7000), "stages[2].queue_deadline_ms",
        ["7000 queue_deadline_ms", "limit of 5000"]),
    "heartbeat": (DEADLINES, on("render", heartbeat_timeout_ms=7000), "stages[2].heartbeat_timeout_ms",
        ["7000 heartbeat_timeout_ms", "limit of 5000"]),
    "heartbeat-over-execution": (None, on("render", heartbeat_timeout_ms=7000, execution_deadline_ms=5000),
        "stages[2].heartbeat_timeout_ms", ["'render'", "heartbeat_timeout_ms exceeds execution_deadline_ms"]),
    "input-bytes": (Limits(max_input_bytes=64), bind("render", "x" * 100), "stages[2].input",
        ["'render'", "114 input bytes", "limit of 64"]),
    "shard-class": (None, top(**{"class": "gpu"}), "class",
        ["shard class 'gpu' is not configured (configured: fast, slow)"]),
    "finalisers": (Limits(max_finalisers=2), top(finalisers=["audit.run-terminal@1"] * 3), "finalisers",
        ["3 finalisers", "limit of 2"]),
    "run-deadline": (Limits(max_run_deadline_ms=5000), top(run_deadline_ms=7000), "run_deadline_ms",
        ["7000 run_deadline_ms", "limit of 5000"]),
}
# fmt: on


class TestAdmission:
    @pytest.mark.parametrize(("limits", *CASE), ADMISSION_CASES.values(), ids=ADMISSION_CASES.keys())
    def test_over_limit(self, limits: Limits, edit: Edit, path: str, fragments: list[str]) -> None:
        expect(variant(edit), path, *fragments, limits=limits)


# ---- graph ------------------------------------------------------------------------------------------

JOIN_B = {"name": "join-b", "type": "join", "required": ["metadata"], "on_success": "publish"}
FORK_B = {"name": "fork-b", "type": "fork", "branches": ["metadata", "semantic"]}
# fmt: off
GRAPH_CASES = {
    "duplicate-stage": (append(worker("render", "publish")), "stages[8].name",
        ["duplicate stage name 'render' (first declared as stages[2])"]),
    "entry-not-a-stage": (top(entry="cache-lookupp"), "entry",
        ["entry 'cache-lookupp' is not a stage", "(did you mean 'cache-lookup'?)"]),
    "on-success-target": (on("render", on_success="derivve"), "stages[2].on_success",
        ["'render'", "on_success target 'derivve'", "(did you mean 'derive'?)"]),
    "on-failure-target": (on("render", on_failure="falied"), "stages[2].on_failure",
        ["on_failure target 'falied'", "(did you mean 'failed'?)"]),
    "decision-next": (branch(0, next="pubilsh"), "stages[1].branches[0].next",
        ["'cache-route'", "branch target 'pubilsh'", "(did you mean 'publish'?)"]),
    "evaluation-error-target": (on("cache-route", on_evaluation_error="retryy"),
        "stages[1].on_evaluation_error", ["target 'retryy'"]),
    "undeclared-terminal": (top(terminals=["completed"]), "stages[0].on_failure",
        ["routes to terminal 'failed'", "not declared in terminals (completed)"]),
    "unreachable": (append(worker("orphan", "completed")), "stages[8].name",
        ["'orphan'", "unreachable from entry 'cache-lookup'"]),
    "direct-cycle": (on("publish", on_failure="publish"), "stages[7].name", ["cycle: publish -> publish"]),
    "indirect-cycle": (on("publish", on_failure="cache-lookup"), "stages[0].name",
        ["cycle: cache-lookup -> cache-route -> publish -> cache-lookup"]),
    "no-fallback": (branch(1, when="false"), "stages[1].branches",
        ["'cache-route'", "decision has no fallback", 'when: "true"']),
    "fallback-not-last": (lambda d: stage(d, "cache-route")["branches"].reverse(), WHEN,
        ["must be the last branch", "1 branch(es) after it"]),
    "stage-in-two-forks": (seq(branch(0, next="fork-b"), append(FORK_B)), "stages[8].branches[0]",
        ["'metadata' is already a branch of fork 'derive'"]),
    "fork-without-join": (seq(on("semantic", on_success="publish"), on("metadata", on_success="publish"),
        lambda d: d["stages"].remove(stage(d, "derive-join"))),
        "stages[3].branches", ["fork 'derive' has no join", "semantic, metadata"]),
    "fork-with-two-joins": (seq(on("metadata", on_success="join-b"), append(JOIN_B),
        on("derive-join", required=["semantic"])),
        "stages[3].branches", ["several joins (derive-join, join-b)"]),
    "required-not-a-branch": (on("derive-join", required=["semantic", "metadata", "metadta"]),
        "stages[6].required[2]", ["required 'metadta' is not a fork branch", "(did you mean 'metadata'?)"]),
    "join-mixes-forks": (seq(second_fork, lambda d: stage(d, "join-2")["required"].append("semantic")),
        "stages[11].required", ["required mixes branches of forks derive, fork-2"]),
    "branch-never-joins": (on("metadata", on_success="publish"), "stages[3].branches[1]",
        ["'metadata' of fork 'derive' never routes to its join"]),
    "branches-share-stage": (seq(on("semantic", on_success="shared"), on("metadata", on_success="shared"),
        append(worker("shared", "derive-join"))),
        "stages[8].name", ["reachable from both branch 'semantic' and branch 'metadata'"]),
    "required-missing-branch": (on("derive-join", required=["semantic"]), "stages[6].required",
        ["branch 'metadata'", "missing from required"]),
    "branch-escapes-past-its-join": (on("metadata", on_failure="publish"), "stages[7].name",
        ["'publish'", "reachable from branch 'metadata' of fork 'derive' without passing its join",
         "could run twice"]),
}
# fmt: on


class TestGraph:
    @pytest.mark.parametrize(CASE, GRAPH_CASES.values(), ids=GRAPH_CASES.keys())
    def test_graph_problem(self, edit: Edit, path: str, fragments: list[str]) -> None:
        expect(variant(edit), path, *fragments)

    def test_stage_named_like_a_terminal(self) -> None:
        routes = (branch(0, next="completed"), on("derive-join", on_success="completed"))
        text = variant(on("publish", name="completed"), *routes)
        problems = expect(text, "stages[7].name", "'completed' is a terminal intent", at="name: completed")
        assert not [p for p in problems if "cycle" in p.message], "routing to the terminal is no cycle"

    @pytest.mark.parametrize(("name", "kind"), [("completed", "terminal"), ("semantik", "unknown stage")])
    def test_fork_branch_must_be_a_stage(self, name: str, kind: str) -> None:
        text = variant(on("derive", branches=["semantic", "metadata", name]))
        problems = expect(text, "stages[3].branches[2]", f"{name!r} must be a stage ({kind})", at=f"- {name}")
        assert len(problems) == 1, "a branch that is no stage is not also one that never reaches the join"

    def test_fork_branch_that_is_a_join(self) -> None:
        text = variant(on("derive", branches=["semantic", "metadata", "derive-join"]))
        problems = expect(text, "stages[3].branches[2]", "branch 'derive-join' is a join", at="- derive-join")
        assert len(problems) == 1, "a join listed as a branch is not also a branch missing from required"

    def test_required_listing_a_branch_twice(self) -> None:
        text = variant(on("derive-join", required=["semantic", "metadata", "metadata"]))
        expect(text, "stages[6].required[2]", "'metadata'", "more than once")  # the second 'metadata'

    def test_duplicate_stage_is_located_at_its_own_position(self) -> None:
        text = variant(append(worker("publish", "nowhere")))
        problems = expect(text, "stages[8].name", "duplicate stage name 'publish'")
        expect(text, "stages[8].on_success", "'nowhere'", at="on_success: nowhere")
        assert "stages[7].on_success" not in [p.path for p in problems], "blamed on the first 'publish'"

    def test_non_branch_stage_routing_into_a_join(self) -> None:
        text = variant(on("render", on_failure="derive-join"))
        expect(text, "stages[2].on_failure", "'derive-join'", at="on_failure: derive-join")


# ---- contracts and types ----------------------------------------------------------------------------

RENDER_INPUT = "stages[2].input.modelId"
HIT = 'stages["cache-lookup"].result.hitt'
# fmt: off
CONTRACT_CASES = {
    "unregistered-version": (on("render", worker="thumbnail.render@9"), "stages[2].worker",
        ["'thumbnail.render@9' is not registered", "(registered versions: thumbnail.render@3)"]),
    "unregistered-name": (on("render", worker="nothing.here@1"), "stages[2].worker",
        ["contract 'nothing.here@1' is not registered"]),
    "action-uses-worker": (on("cache-lookup", action="thumbnail.render@3"), "stages[0].action",
        ["thumbnail.render@3 is a worker contract", "an action"]),
    "worker-uses-action": (on("render", worker="cache.lookup@1"), "stages[2].worker",
        ["'render'", "cache.lookup@1 is an action contract", "needs a worker"]),
    "missing-input": (on("render", input={}), "stages[2].input",
        ["missing input 'modelId' required by thumbnail.render@3"]),
    "input-not-in-schema": (bind("render", "x", key="modelid"), "stages[2].input.modelid",
        ["input 'modelid' is not a field of thumbnail.render@3 (fields: modelId)"]),
    "literal-wrong-type": (bind("render", 42), RENDER_INPUT, ["value 42", "not of type 'string'"]),
    "syntax-error": (bind("render", "${context.modelId +}"), RENDER_INPUT,
        ["invalid CEL expression 'context.modelId +'", "Syntax error"]),
    "unterminated-string": (branch(0, when='"abc'), WHEN, ["unterminated string literal"]),
    "import-call": (bind("render", '${__import__("os").system("ls")}'), RENDER_INPUT,
        ["'render'", "function '__import__' is not available"]),
    "system-method": (bind("render", '${context.modelId.system("ls")}'), RENDER_INPUT,
        ["'render'", "function 'system' is not available"]),
    "import-in-when": (branch(0, when='__import__("os").system("ls")'), WHEN,
        ["'cache-route'", "function '__import__' is not available"]),
    "unknown-variable": (bind("render", "${os.environ}"), RENDER_INPUT,
        ["unknown variable 'os' (available: context, stages)"]),
    "empty-expression": (bind("render", "${ }"), RENDER_INPUT, ["expression is empty"]),
    "unclosed-binding": (bind("render", "${context.modelId"), RENDER_INPUT, ["no closing '}'"]),
    "unknown-stage": (bind("render", '${stages["cache-lokup"].result.modelId}'), RENDER_INPUT,
        ['stages["cache-lokup"].result.modelId names no stage']),
    "decision-result": (bind("render", '${stages["cache-route"].result}'), RENDER_INPUT,
        ["stage 'cache-route' is a decision and produces no result"]),
    "stage-attribute": (bind("render", '${stages["cache-lookup"].foo}'), RENDER_INPUT,
        ["a stage exposes result, state, attempt, not 'foo'"]),
    "stage-by-index": (bind("render", "${stages[0].result}"), RENDER_INPUT, ['stages["name"].result']),
    "output-field": (branch(0, when=HIT), WHEN, ["no field 'hitt' (fields: modelId, hit)"]),
    "output-field-in-output": (top(output={"id": '${stages["publish"].result.catalogId}'}), "output.id",
        ["no field 'catalogId'", "catalogueId"]),
    "map-result-not-indexed": (seq(as_map(max_items=5), bind("semantic", '${stages["render"].result.x}')),
        "stages[4].input.modelId", ["a map's result is a list", "index it"]),
    "context-field": (bind("render", "${context.modelID}"), RENDER_INPUT,
        ["context schema has no field 'modelID' (fields: modelId, count, ids)"]),
    "type-mismatch": (bind("render", "${context.count}"), RENDER_INPUT,
        ["${context.count} is integer, but string is expected"]),
    "attempt-into-string": (bind("render", '${stages["cache-lookup"].attempt}'), RENDER_INPUT,
        ["is integer, but string is expected"]),
    "when-not-boolean": (branch(0, when="context.modelId"), WHEN, ["is string, but boolean is expected"]),
    "fork-sibling-result": (bind("semantic", '${stages["metadata"].result.faces}'), "stages[4].input.modelId",
        ["result of stage 'metadata'", "'semantic' runs", "has(...)"]),
    "skipped-on-decision-path": (bind("publish", '${stages["render"].result.thumbnailUri}'),
        "stages[7].input.modelId", ["stage 'render'", "'publish' runs"]),
    "skipped-before-completion": (top(output={"uri": '${stages["render"].result.thumbnailUri}'}),
        "output.uri", ["stage 'render'", "the run completes"]),
    "invalid-context-schema": (top(context={"type": "objekt"}), "context", ["valid JSON Schema: 'objekt'"]),
    "context-not-object": (top(context={"type": "array"}), "context", ["describe an object"]),
    "finaliser-is-worker": (top(finalisers=["thumbnail.render@3"]), "finalisers[0]",
        ["thumbnail.render@3 is a worker contract"]),
    "finaliser-unregistered": (top(finalisers=["audit.run-terminal@2"]), "finalisers[0]",
        ["'audit.run-terminal@2' is not registered", "versions: audit.run-terminal@1"]),
    "finaliser-needs-input": (top(finalisers=["cache.lookup@1"]), "finalisers[0]",
        ["finaliser cache.lookup@1 requires input 'modelId'", "receives run_id"]),
    "compensation-needs-input": (on("publish", compensate="cache.lookup@1"), "stages[7].compensate",
        ["'publish'", "compensation cache.lookup@1 requires input"]),
    "compensation-is-worker": (on("publish", compensate="thumbnail.render@3"), "stages[7].compensate",
        ["thumbnail.render@3 is a worker contract"]),
    "map-items-template": (as_map(items="ids: ${context.ids}"), "stages[2].items",
        ["'render'", "items must be one binding"]),
    "map-items-not-binding": (as_map(items="context.ids"), "stages[2].items", ["must be one binding"]),
    "map-packed-serial": (as_map(items_per_message=10, queue="tasks.serial"), "stages[2].items_per_message",
        ["items_per_message 10 on tasks.serial", "one at a time"]),
    "map-items-not-array": (as_map(items="${context.modelId}"), "stages[2].items",
        ["${context.modelId} is string, but array is expected"]),
    "map-item-field": (as_map(input={"modelId": "${item.uri}"}), RENDER_INPUT,
        ["item.uri: the map's item has no field 'uri'"]),
}
EXPRESSION_LIMITS = Limits(expressions=ExpressionLimits(max_chars=70, max_depth=4, max_macros=1))
EXPRESSION_LIMIT_CASES = {
    "length": ("${" + " + ".join(["context.modelId"] * 5) + "}", "87 characters, over the 70 limit"),
    "depth": ("${((((((context.modelId))))))}", "nests 6 levels deep, over the 4 limit"),
    "macros": ('${context.ids.all(x, x != "") || context.ids.exists(x, x == "")}', "2 comprehension macros"),
}
INTO_INTEGER = {
    "template": ("n=${context.count}", "text around ${...} makes a string, but the target expects integer"),
    "string": ("${context.modelId}", "${context.modelId} is string, but integer is expected"),
}
GUARDED = {
    "fork-sibling": ("semantic", '${has(stages["metadata"].result.faces) ? "a" : "b"}'),
    "decision-path": ("publish", '${has(stages["render"].result.thumbnailUri) ? "a" : "b"}'),
}
UNGUARDED = '${has(context.modelId) ? stages["render"].result.thumbnailUri : ""}'
# fmt: on


class TestContracts:
    @pytest.mark.parametrize(CASE, CONTRACT_CASES.values(), ids=CONTRACT_CASES.keys())
    def test_contract_problem(self, edit: Edit, path: str, fragments: list[str]) -> None:
        expect(variant(edit), path, *fragments)

    @pytest.mark.parametrize(
        ("value", "fragment"), EXPRESSION_LIMIT_CASES.values(), ids=EXPRESSION_LIMIT_CASES
    )
    def test_expression_bounds(self, value: str, fragment: str) -> None:
        expect(variant(bind("render", value)), RENDER_INPUT, fragment, limits=EXPRESSION_LIMITS)

    @pytest.mark.parametrize(("value", "fragment"), INTO_INTEGER.values(), ids=INTO_INTEGER.keys())
    def test_binding_into_integer_field(self, value: str, fragment: str) -> None:
        text = variant(on("metadata", worker="stats.count@1"), bind("metadata", value, key="count"))
        expect(text, "stages[5].input.count", fragment, registry=STATS_REGISTRY)

    @pytest.mark.parametrize(("reader", "value"), GUARDED.values(), ids=GUARDED.keys())
    def test_has_guard_accepts_optional_results(self, reader: str, value: str) -> None:
        assert compile_yaml(variant(bind(reader, value))).digest

    def test_has_on_another_value_does_not_guard_a_result(self) -> None:
        text = variant(bind("publish", UNGUARDED))
        expect(text, "stages[7].input.modelId", "result of stage 'render'", "has(...)", at="thumbnailUri")

    def test_index_has_no_fields(self) -> None:
        text = variant(as_map(input={"modelId": "${index.x}"}))
        problems = expect(text, RENDER_INPUT, "index is the item's position", "no fields")
        assert len(problems) == 1, "index.x should not also be reported as being an integer"

    def test_stage_order_does_not_matter_for_output_checks(self) -> None:
        def lookup_last(data: dict[str, Any]) -> None:
            data["stages"].append(data["stages"].pop(0))  # "order carries no meaning" (docs/dsl.md)

        text = variant(lookup_last, branch(0, when=HIT))
        expect(text, "stages[0].branches[0].when", "cache.lookup@1 has no field 'hitt'", at="result.hitt")


# ---- reporting --------------------------------------------------------------------------------------


class TestReporting:
    def test_every_problem_is_reported_at_once_sorted_by_line(self) -> None:
        text = variant(
            bind("cache-lookup", "x", key="modelid"),  # contract layer, first in the file
            branch(1, when="false"),  # graph layer
            on("render", on_failure="falied"),  # graph layer
            bind("metadata", "${context.modelID}"),  # contract layer
            on("publish", action="catalogue.publish@9"),  # contract layer
        )
        problems = rejected(text)
        paths = [
            "stages[0].input.modelid",
            "stages[1].branches",
            "stages[2].on_failure",
            "stages[5].input.modelId",
        ]
        assert [p.path for p in problems] == [*paths, "stages[7].action"], "\n".join(map(str, problems))
        assert [p.line for p in problems] == sorted({p.line for p in problems})

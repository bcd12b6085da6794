"""Property tests over the compiler: random valid definitions compile, one broken rule is reported at the
element that breaks it, the digest ignores formatting and documentation but not meaning, and no input makes
``compile_text`` raise anything but :class:`DefinitionError`."""

from __future__ import annotations

import copy
import hashlib
import json
import random
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from orchestrator.compiler import compile_text
from orchestrator.compiler.limits import DAY_MS
from orchestrator.compiler.plan import CompiledPlan
from orchestrator.errors import DefinitionError, Problem
from tests.conftest import DEFINITIONS, DEMO_REGISTRY

SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FEW = settings(SETTINGS, max_examples=40)
TERMINALS = ("completed", "failed")
OUTCOMES = ("completed", "failed", "timed-out", "cancelled", "skipped")
ACTIONS = ("cache.lookup@1", "catalogue.publish@2")
WORKERS = ("thumbnail.render@3", "semantic.analyse@4", "metadata.extract@2")
CONTEXT = {"type": "object", "required": ["modelId"], "properties": {
    "modelId": {"type": "string", "minLength": 1}, "flag": {"type": "boolean"},
    "modelIds": {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 10_000},
}}  # fmt: skip
MODEL_ID_INPUTS = ("${context.modelId}", "m-${context.modelId}", "fixed-id")
ITEM_INPUTS = ("${item}", "${context.modelId}", "x-${item}-${index}")
FIXED_CONDITIONS = ("context.flag", "context.flag == true", 'context.modelId == "m-1"',
                    'context.modelId.startsWith("m")', 'context.modelId in ["a", "b"]',
                    'has(context.modelIds) && context.modelIds.exists(m, m == "x")')  # fmt: skip
# 12 characters at most, so the longer names the mutations invent can never collide with a generated one
NAME = st.from_regex(r"[a-z][a-z0-9_-]{0,11}", fullmatch=True).filter(lambda n: n not in TERMINALS)
PROSE = st.text(alphabet="abcdefghij XYZ.,", max_size=30)


def compile_data(data: Any, file: str = "prop.yaml") -> CompiledPlan:
    return compile_text(yaml.safe_dump(data, sort_keys=False), file, DEMO_REGISTRY)


def problems_for(data: Any) -> list[Problem]:
    with pytest.raises(DefinitionError) as info:
        compile_data(data)
    assert info.value.problems, "a DefinitionError must carry at least one problem"
    return info.value.problems


# ---- a generator of valid definitions ------------------------------------------------------------


@st.composite
def _retry(draw: st.DrawFn) -> dict[str, Any]:
    top = draw(st.integers(0, DAY_MS))
    multiplier, jitter = draw(st.sampled_from([1.0, 1.5, 2, 10])), draw(st.sampled_from([0, 0.1, 1.0]))
    attempts, initial = draw(st.integers(1, 10)), draw(st.integers(0, top))
    return {"max_attempts": attempts, "initial_backoff_ms": initial, "max_backoff_ms": top,
            "backoff_multiplier": multiplier, "jitter": jitter}  # fmt: skip


WORK_OPTIONS = st.fixed_dictionaries({}, optional={
    "retry": _retry(), "queue_deadline_ms": st.integers(1, DAY_MS), "description": PROSE,
    "queue": st.sampled_from(["rendering", "tasks.parallel", "tasks.custom-q"]),
    "compensate": st.just("catalogue.unpublish@1")})  # fmt: skip
DEADLINES = st.integers(1, DAY_MS).flatmap(
    lambda run: st.fixed_dictionaries(
        {"execution_deadline_ms": st.just(run)}, optional={"heartbeat_timeout_ms": st.integers(1, run)}
    )
)


def _work_stage(draw: st.DrawFn, name: str, on_success: str, on_failure: str) -> dict[str, Any]:
    kind = draw(st.sampled_from(["action", "worker", "map"]))
    contract = draw(st.sampled_from(ACTIONS if kind == "action" else WORKERS))
    stage: dict[str, Any] = {"name": name, "type": kind, "action" if kind == "action" else "worker": contract}
    if kind == "map":
        stage.update(items="${context.modelIds}", max_items=draw(st.integers(1, 10_000)))
    stage["input"] = {"modelId": draw(st.sampled_from(ITEM_INPUTS if kind == "map" else MODEL_ID_INPUTS))}
    stage["on_success"] = on_success
    if on_failure != "failed" or draw(st.booleans()):  # "failed" is the default; sometimes left out
        stage["on_failure"] = on_failure
    stage.update(draw(WORK_OPTIONS))
    if draw(st.booleans()):
        stage.update(draw(DEADLINES))
    return stage


def _condition(draw: st.DrawFn, lookups: list[str]) -> str:
    options = [
        st.sampled_from(FIXED_CONDITIONS),
        st.integers(0, 64).map(lambda n: f"size(context.modelId) > {n}"),
    ]
    if lookups:  # guarded by has(), so the result need not be available on every path
        options.append(
            st.sampled_from(lookups).map(lambda n: f'has(stages["{n}"].result) && stages["{n}"].result.hit')
        )
    return draw(st.one_of(options))


def _decision(draw: st.DrawFn, name: str, primary: str, other: Any, lookups: list[str]) -> dict[str, Any]:
    branches = [
        {"when": _condition(draw, lookups), "next": draw(other)} for _ in range(draw(st.integers(1, 3)))
    ]
    stage = {"name": name, "type": "decision", "branches": [*branches, {"when": "true", "next": primary}]}
    if draw(st.booleans()):
        stage["on_evaluation_error"] = draw(other)
    return stage


def _fork(draw: st.DrawFn, names: Any, shape: list[int], primary: str, other: Any) -> list[dict[str, Any]]:
    fork, join = next(names), next(names)
    heads, stages = [], []
    for length in shape:
        chain = [next(names) for _ in range(length)]
        heads.append(chain[0])
        for j, name in enumerate(chain):
            after = chain[j + 1] if j + 1 < length else join
            stages.append(_work_stage(draw, name, after, draw(st.sampled_from(["failed", join]))))
    end = {"name": join, "type": "join", "required": list(draw(st.permutations(heads)))}
    end.update(on_success=primary, on_failure=draw(other))
    if draw(st.booleans()):
        states = st.lists(st.sampled_from(OUTCOMES), min_size=1, max_size=5, unique=True)
        end["acceptable_terminal_states"] = draw(states)
    return [{"name": fork, "type": "fork", "branches": heads}, *stages, end]


OPTIONAL_TOP_LEVEL = {"class": st.sampled_from(["fast", "slow"]), "description": PROSE,
                      "output": st.just({"modelId": "${context.modelId}"}),
                      "run_deadline_ms": st.integers(1, 30 * DAY_MS),
                      "finalisers": st.just(["audit.run-terminal@1"])}  # fmt: skip


@st.composite
def valid_definitions(draw: st.DrawFn, require: tuple[str, ...] = ()) -> dict[str, Any]:
    """A main line of segments (a work stage, a decision, or fork + branches + join). Segment i routes to
    segment i + 1 along one edge, so all are reachable; its other edges go to a later segment or a
    terminal, so the graph is a DAG with skip edges. Branch stages route only along their own branch."""
    kinds = draw(st.lists(st.sampled_from(["work", "work", "decision", "fork"]), min_size=1, max_size=6))
    for kind in set(require) - set(kinds):
        kinds.insert(draw(st.integers(0, len(kinds))), kind)
    shapes = [draw(st.lists(st.integers(1, 2), min_size=2, max_size=3)) if k == "fork" else [] for k in kinds]
    count = sum(2 + sum(shape) if kind == "fork" else 1 for kind, shape in zip(kinds, shapes, strict=True))
    names = iter(draw(st.lists(NAME, min_size=count, max_size=count, unique=True)))
    segments: list[list[dict[str, Any]]] = [[] for _ in kinds]
    lookups: list[str] = []  # cache.lookup stages, whose result.hit a decision may read (guarded)
    for i in reversed(range(len(kinds))):
        primary = segments[i + 1][0]["name"] if i + 1 < len(kinds) else "completed"
        other = st.sampled_from([*(s[0]["name"] for s in segments[i + 1 :]), *TERMINALS])
        if kinds[i] == "fork":
            segments[i] = _fork(draw, names, shapes[i], primary, other)
        elif kinds[i] == "decision":
            segments[i] = [_decision(draw, next(names), primary, other, lookups)]
        else:
            pair = (primary, draw(other)) if draw(st.booleans()) else (draw(other), primary)
            segments[i] = [_work_stage(draw, next(names), *pair)]
            if segments[i][0].get("action") == "cache.lookup@1":
                lookups.append(segments[i][0]["name"])
    defn: dict[str, Any] = {
        "name": draw(NAME),
        "version": draw(st.from_regex(r"[0-9]{1,2}(\.[0-9]{1,2}){0,2}", fullmatch=True)),
        "entry": segments[0][0]["name"],
        "context": CONTEXT,
        "stages": [stage for segment in segments for stage in segment],
    }
    for key, strategy in OPTIONAL_TOP_LEVEL.items():
        if draw(st.booleans()):
            defn[key] = draw(strategy)
    return defn


def _index(defn: dict[str, Any], predicate: Any) -> list[int]:
    return [i for i, stage in enumerate(defn["stages"]) if predicate(stage)]


def _pick(defn: dict[str, Any], draw: Any, predicate: Any) -> int:
    """The index of a random stage matching ``predicate`` (the example is discarded if there is none)."""
    candidates = _index(defn, predicate)
    assume(candidates)
    return int(draw(st.sampled_from(candidates)))


def _work(stage: dict[str, Any]) -> bool:
    return stage["type"] in ("action", "worker", "map")


@SETTINGS
@given(valid_definitions())
def test_every_generated_definition_compiles_deterministically(defn: dict[str, Any]) -> None:
    text = yaml.safe_dump(defn, sort_keys=False)
    plan = compile_text(text, "a.yaml", DEMO_REGISTRY)
    again = compile_text(text, "b.yaml", DEMO_REGISTRY)
    assert again.canonical_bytes() == plan.canonical_bytes()
    assert again.digest == plan.digest == "sha256:" + hashlib.sha256(plan.canonical_bytes()).hexdigest()
    stages = plan.plan["stages"]
    assert set(stages) == {s["name"] for s in defn["stages"]}
    for name, stage in stages.items():
        if stage["type"] == "join":  # required is normalised to the fork's branch order
            assert stage["required"] == stages[stage["fork"]]["branches"], name


# ---- one broken rule at a time -------------------------------------------------------------------


def _unknown_on_success(defn: dict[str, Any], draw: Any) -> Any:
    i = _pick(defn, draw, lambda s: "on_success" in s)
    defn["stages"][i]["on_success"] = "no-such-stage-anywhere"
    return lambda p: p.path == f"stages[{i}].on_success" and "'no-such-stage-anywhere'" in p.message


def _no_fallback(defn: dict[str, Any], draw: Any) -> Any:
    i = _pick(defn, draw, lambda s: s["type"] == "decision")
    defn["stages"][i]["branches"].pop()
    return lambda p: p.path == f"stages[{i}].branches" and "no fallback" in p.message


def _cycle(defn: dict[str, Any], draw: Any) -> Any:
    """An edge back to the entry: every cycle then runs through it, so both ends are in the one reported."""
    i = _pick(defn, draw, lambda s: "on_success" in s)
    source, entry = defn["stages"][i]["name"], defn["entry"]
    defn["stages"][i]["on_failure"] = entry

    def members(message: str) -> list[str]:
        return message.split("cycle: ", 1)[1].split(";", 1)[0].split(" -> ") if "cycle: " in message else []

    return lambda p: source in members(p.message) and entry in members(p.message)


def _drop_required(defn: dict[str, Any], draw: Any) -> Any:
    j = _pick(defn, draw, lambda s: s["type"] == "join")
    required = defn["stages"][j]["required"]
    dropped = required.pop(draw(st.integers(0, len(required) - 1)))
    return lambda p: (
        p.path == f"stages[{j}].required"
        and f"branch {dropped!r}" in p.message
        and "missing from required" in p.message
    )


def _duplicate_name(defn: dict[str, Any], draw: Any) -> Any:
    stages = defn["stages"]
    copied = copy.deepcopy(draw(st.sampled_from(stages)))
    stages.insert(draw(st.integers(0, len(stages))), copied)
    second = [i for i, s in enumerate(stages) if s["name"] == copied["name"]][1]
    return lambda p: (
        p.path == f"stages[{second}].name" and f"duplicate stage name {copied['name']!r}" in p.message
    )


def _unreachable(defn: dict[str, Any], draw: Any) -> Any:
    at = draw(st.integers(0, len(defn["stages"])))
    orphan = {"name": "orphan-stage-xyz", "type": "action", "action": "cache.lookup@1", "input": {}}
    defn["stages"].insert(at, {**orphan, "on_success": "completed"})
    return lambda p: p.path == f"stages[{at}].name" and "unreachable" in p.message


def _unregistered_version(defn: dict[str, Any], draw: Any) -> Any:
    i = _pick(defn, draw, _work)
    field = "action" if defn["stages"][i]["type"] == "action" else "worker"
    registered = defn["stages"][i][field]
    missing = f"{registered.split('@')[0]}@{draw(st.integers(5, 999_999))}"
    defn["stages"][i][field] = missing
    return lambda p: (
        p.path == f"stages[{i}].{field}"
        and f"contract {missing!r} is not registered" in p.message
        and registered in p.message  # the hint lists the registered versions
    )


MUTATIONS = [_unknown_on_success, _no_fallback, _cycle, _drop_required, _duplicate_name, _unreachable,
             _unregistered_version]  # fmt: skip


@pytest.mark.parametrize("mutate", MUTATIONS, ids=lambda m: m.__name__.strip("_"))
@FEW
@given(defn=valid_definitions(require=("fork", "decision")), data=st.data())
def test_one_broken_rule_is_reported_at_the_mutated_element(
    mutate: Any, defn: dict[str, Any], data: st.DataObject
) -> None:
    mentions_it = mutate(defn, data.draw)
    problems = problems_for(defn)
    assert any(mentions_it(p) for p in problems), problems


# ---- the digest: formatting and documentation never matter, meaning always does -------------------


def _shuffle_keys(value: Any, rnd: random.Random) -> Any:
    if isinstance(value, dict):
        keys = list(value)
        rnd.shuffle(keys)
        return {k: _shuffle_keys(value[k], rnd) for k in keys}
    if isinstance(value, list):
        return [_shuffle_keys(v, rnd) for v in value]
    return value


def _with_comments(text: str, rnd: random.Random) -> str:
    out = ["# a header comment", "---"]
    for line in text.splitlines():
        if rnd.random() < 0.3:
            out.append(" " * rnd.randint(0, 6) + "# a comment line: with ${braces} and 'quotes'")
        out.append(line + ("  # trailing" if rnd.random() < 0.3 else ""))
    return "\n".join(out) + "\n"


STYLES = ("block", "flow", "mixed", "double-quoted", "single-quoted", "comments", "json", "json-indented")


def reformat(defn: dict[str, Any], style: str, rnd: random.Random) -> str:
    """The same definition written differently: keys shuffled, stages reordered, another YAML style."""
    data = _shuffle_keys(defn, rnd)
    rnd.shuffle(data["stages"])
    for stage in data["stages"]:  # required is a set (normalised to the fork's order), and so are these
        for key in ("required", "acceptable_terminal_states"):
            if key in stage:
                rnd.shuffle(stage[key])
    if style.startswith("json"):
        return json.dumps(data, indent=2 if style == "json-indented" else None)
    options: dict[str, Any] = {"sort_keys": False, "width": float("inf")}
    if style in ("flow", "mixed"):
        options["default_flow_style"] = True if style == "flow" else None
    elif style not in {"block", "comments"}:
        options["default_style"] = '"' if style == "double-quoted" else "'"
    text = yaml.safe_dump(data, **options)
    return _with_comments(text, rnd) if style == "comments" else text


@SETTINGS
@given(valid_definitions(), st.sampled_from(STYLES), st.randoms(use_true_random=False))
def test_digest_ignores_formatting(defn: dict[str, Any], style: str, rnd: random.Random) -> None:
    original = compile_data(defn)
    rewritten = compile_text(reformat(defn, style, rnd), "other.yaml", DEMO_REGISTRY)
    assert rewritten.digest == original.digest
    assert rewritten.canonical_bytes() == original.canonical_bytes()


@FEW
@given(valid_definitions(), st.data())
def test_descriptions_do_not_change_the_digest(defn: dict[str, Any], data: st.DataObject) -> None:
    before = compile_data(defn).digest
    text = st.text(max_size=60)
    defn["description"] = data.draw(text)
    for stage in defn["stages"]:
        if data.draw(st.booleans()):
            stage["description"] = data.draw(text)
    assert compile_data(defn).digest == before


def _flip_terminal_on_failure(defn: dict[str, Any], data: st.DataObject) -> None:
    stage = defn["stages"][
        _pick(defn, data.draw, lambda s: "on_success" in s and s.get("on_failure", "failed") in TERMINALS)
    ]
    stage["on_failure"] = "completed" if stage.get("on_failure", "failed") == "failed" else "failed"


def _change_deadline(defn: dict[str, Any], data: st.DataObject) -> None:
    if data.draw(st.booleans()):
        old = defn.get("run_deadline_ms")
        defn["run_deadline_ms"] = data.draw(st.integers(1, 30 * DAY_MS).filter(lambda v: v != old))
        return
    stage = defn["stages"][_pick(defn, data.draw, _work)]
    old = stage.get("queue_deadline_ms")
    stage["queue_deadline_ms"] = data.draw(st.integers(1, DAY_MS).filter(lambda v: v != old))


def _change_condition(defn: dict[str, Any], data: st.DataObject) -> None:
    branch = defn["stages"][_pick(defn, data.draw, lambda s: s["type"] == "decision")]["branches"][0]
    branch["when"] = data.draw(
        st.integers(0, 99).map(lambda n: f"size(context.modelId) > {n}").filter(lambda w: w != branch["when"])
    )


@SETTINGS
@given(
    valid_definitions(require=("decision",)),
    st.sampled_from([_flip_terminal_on_failure, _change_deadline, _change_condition]),
    st.data(),
)
def test_a_semantic_change_changes_the_digest(defn: dict[str, Any], change: Any, data: st.DataObject) -> None:
    before = compile_data(defn).digest
    change(defn, data)
    assert compile_data(defn).digest != before


@pytest.mark.parametrize("path", sorted(DEFINITIONS.glob("*.yaml")), ids=lambda p: p.stem)
@pytest.mark.parametrize("style", STYLES)
def test_shipped_definitions_keep_their_digest_when_reformatted(path: Any, style: str) -> None:
    text = path.read_text()
    original = compile_text(text, path.name, DEMO_REGISTRY)
    rewritten = reformat(yaml.safe_load(text), style, random.Random(7))
    assert compile_text(rewritten, path.name, DEMO_REGISTRY).digest == original.digest


def test_explicit_defaults_do_not_change_the_digest() -> None:
    """Defaults are filled in before hashing, so writing one out changes nothing."""
    defn = yaml.safe_load((DEFINITIONS / "catalogue-reindex.yaml").read_text())
    before = compile_data(defn).digest
    defn["terminals"] = ["completed", "failed"]
    for stage in defn["stages"]:
        stage.setdefault("on_failure", "failed")
        stage.setdefault("retry", {}).setdefault("jitter", 0.1)
    assert compile_data(defn).digest == before


# ---- fuzzing: whatever is built, compile either succeeds or reports problems ----------------------

POOL = ("a", "b", "fetch", "route", "split", "left", "right", "merge")
TARGETS = st.sampled_from([*POOL, *TERMINALS, "nowhere", "Bad Name", ""])
CONTRACTS = st.sampled_from(
    [*ACTIONS, *WORKERS, "catalogue.unpublish@1", "cache.lookup@9", "no.such@1", "Not A Ref", "x@0"]
)
EXPRESSIONS = st.sampled_from(
    [*FIXED_CONDITIONS, "true", 'stages["a"].result.hit', 'stages["split"].result', "stages", "stages[0]",
     "now()", "1 +", "'open", "context.nope", "item", "x.all(y, y)", "1 / 0", "", "${context.flag}",
     'stages["fetch"].state == "completed"', 'stages["a"].result.nothing', "(" * 20 + "true" + ")" * 20]
)  # fmt: skip
INPUTS = st.sampled_from(
    [{"modelId": "${context.modelId}"}, {"modelId": "${item}"}, {"modelId": "${"}, {"modelId": 5}, {},
     {"modelId": "x", "extra": 1}, {"modelId": '${stages["a"].result.modelId}'}, {"modelId": "$${x}"},
     {"modelId": "a ${context.modelId} b"}, {"modelId": "${index}"}, {"modelId": "${context.modelIds}"},
     {"modelId": '${stages["left"].result[0].tags}'}, {"modelId": "${index.x}"}, {"modelId": None}]
)  # fmt: skip
TEMPLATES = st.sampled_from(["${context.modelId}", 'x ${stages["a"].result.hit}', "${", "${now()}", "$${"])
JSONISH = st.recursive(  # non-finite floats are left out on purpose: see test_non_finite_float_* below
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | TEMPLATES,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from("abc"), inner, max_size=3),
    max_leaves=6,
)
CONTEXTS = st.sampled_from(
    [CONTEXT, None, {"type": "object"}, {"type": "string"}, {"type": "object", "properties": "bad"},
     {"type": "object", "properties": {"modelId": {"type": "integer"}}}, {"$ref": "#/$defs/missing"},
     {"type": "object", "additionalProperties": {"type": "string"}}]
)  # fmt: skip
TOP_LEVEL = st.sampled_from(
    [("class", "slow"), ("class", "huge"), ("run_deadline_ms", 0), ("run_deadline_ms", 31 * DAY_MS),
     ("terminals", ["completed"]), ("terminals", []), ("terminals", ["failed", "completed"]),
     ("finalisers", ["audit.run-terminal@1"]), ("finalisers", ["thumbnail.render@3"]), ("version", 2.3),
     ("unknown_field", 1)]
)  # fmt: skip
FIELDS = st.tuples(st.just("entry"), TARGETS) | st.tuples(st.just("output"), JSONISH) | TOP_LEVEL
FIELDS |= st.tuples(st.just("context"), CONTEXTS)
WORK = st.fixed_dictionaries(
    {"name": st.sampled_from(POOL), "type": st.sampled_from(["action", "worker", "map"]), "input": INPUTS},
    optional={"on_success": TARGETS, "on_failure": TARGETS, "compensate": CONTRACTS},
)


def _valid_work(name: str, contract: str, to: str) -> dict[str, Any]:
    kind = "action" if contract in ACTIONS else "worker"
    return {
        "name": name,
        "type": kind,
        kind: contract,
        "input": {"modelId": "${context.modelId}"},
        "on_success": to,
    }


class DefinitionMachine(RuleBasedStateMachine):
    """Grows a definition that stays valid (new stages in front of the entry) and breaks it at random
    (stages from a small pool of names, so duplicates, cycles, dangling targets and broken forks all
    happen); after every step compile succeeds or raises DefinitionError, never anything else."""

    def __init__(self) -> None:
        super().__init__()
        first = _valid_work("a", "cache.lookup@1", "completed")
        self.defn: dict[str, Any] = {"name": "fuzzed", "version": "1", "entry": "a", "context": CONTEXT}
        self.defn["stages"] = [first]
        self.fresh = 0

    def _name(self) -> str:
        self.fresh += 1
        return f"n{self.fresh}"

    @rule(shape=st.sampled_from(["work", "decision", "fork"]), contract=st.sampled_from(ACTIONS + WORKERS),
          whens=st.lists(st.sampled_from(FIXED_CONDITIONS), max_size=2), width=st.integers(2, 3))  # fmt: skip
    def prepend_valid_stage(self, shape: str, contract: str, whens: list[str], width: int) -> None:
        entry, new = self.defn["entry"], self._name()
        if shape == "work":
            added = [_valid_work(new, contract, entry)]
        elif shape == "decision":
            branches = [{"when": when, "next": entry} for when in [*whens, "true"]]
            added = [{"name": new, "type": "decision", "branches": branches}]
        else:
            join, heads = self._name(), [self._name() for _ in range(width)]
            added = [{"name": new, "type": "fork", "branches": heads}]
            added += [_valid_work(head, contract, join) for head in heads]
            added.append({"name": join, "type": "join", "required": heads, "on_success": entry})
        self.defn["stages"][:0] = added
        self.defn["entry"] = new

    @rule(stage=WORK, contract=CONTRACTS)
    def add_work_stage(self, stage: dict[str, Any], contract: str) -> None:
        stage["action" if stage["type"] == "action" else "worker"] = contract
        if stage["type"] == "map":
            stage.update(items="${context.modelIds}", max_items=5)
        self.defn["stages"].append(stage)

    @rule(name=st.sampled_from(POOL), whens=st.lists(EXPRESSIONS, max_size=4), to=TARGETS)
    def add_decision(self, name: str, whens: list[str], to: str) -> None:
        branches = [{"when": when, "next": to} for when in whens]
        self.defn["stages"].append({"name": name, "type": "decision", "branches": branches})

    @rule(name=st.sampled_from(POOL), names=st.lists(TARGETS, max_size=3), to=st.none() | TARGETS)
    def add_fork_or_join(self, name: str, names: list[str], to: str | None) -> None:
        fork = {"name": name, "type": "fork", "branches": names}
        join = {"name": name, "type": "join", "required": names, "on_success": to}
        self.defn["stages"].append(fork if to is None else join)

    @precondition(lambda self: bool(self.defn["stages"]))
    @rule(data=st.data(), field=st.sampled_from(["on_success", "on_failure", "name"]), to=TARGETS)
    def retarget(self, data: st.DataObject, field: str, to: str) -> None:
        data.draw(st.sampled_from(self.defn["stages"]))[field] = to

    @rule(item=FIELDS)
    def set_field(self, item: tuple[str, Any]) -> None:
        self.defn[item[0]] = item[1]

    @invariant()
    def compiles_or_reports_problems(self) -> None:
        text = yaml.safe_dump(self.defn, sort_keys=False)
        try:
            plan = compile_text(text, "machine.yaml", DEMO_REGISTRY)
        except DefinitionError as exc:
            assert exc.problems
            for problem in exc.problems:
                assert problem.file == "machine.yaml"
                assert 1 <= problem.line <= len(text.splitlines())
                assert problem.path and problem.message
            event("rejected")
            return
        event("compiled")
        assert compile_text(text, "again.yaml", DEMO_REGISTRY).canonical_bytes() == plan.canonical_bytes()


DefinitionMachine.TestCase.settings = settings(SETTINGS, max_examples=60, stateful_step_count=12)
TestDefinitionMachine = DefinitionMachine.TestCase


# ---- counterexamples found while writing these properties, kept as regular tests -----------------

INGEST = (DEFINITIONS / "model-ingest.yaml").read_text()
OUTPUT_LINE = '  modelId: "${context.modelId}"\n'
CONTEXT_LINE = "    modelId: { type: string, minLength: 1 }\n"


def _ingest_with(old: str, new: str) -> str:
    text = INGEST.replace(old, new, 1)
    assert text != INGEST
    return text


@pytest.mark.parametrize(
    ("old", "new", "where"),
    [
        (OUTPUT_LINE, OUTPUT_LINE + "  ratio: .nan\n", "output"),
        (OUTPUT_LINE, OUTPUT_LINE + "  ratio: .inf\n", "output"),
        (OUTPUT_LINE, OUTPUT_LINE + "  ratio: -.inf\n", "output"),
        (CONTEXT_LINE, CONTEXT_LINE + "    size: { type: number, maximum: .inf }\n", "context"),
    ],
    ids=["output-nan", "output-inf", "output-minus-inf", "context-inf"],
)
def test_non_finite_float_is_a_definition_error(old: str, new: str, where: str) -> None:
    """JSON has no NaN or infinity; the canonical plan refuses them, so the compiler must report them."""
    with pytest.raises(DefinitionError) as info:
        compile_text(_ingest_with(old, new), "nan.yaml", DEMO_REGISTRY)
    assert any(p.path.startswith(where) for p in info.value.problems), info.value.problems


def test_boolean_subschema_in_context_compiles() -> None:
    """``true`` is a valid JSON Schema (it accepts anything); reading such a field must not crash."""
    text = _ingest_with(CONTEXT_LINE, "    modelId: true\n")
    assert compile_text(text, "bool.yaml", DEMO_REGISTRY).digest.startswith("sha256:")


def test_false_subschema_in_context_is_reported_not_crashed() -> None:
    with pytest.raises(DefinitionError):  # false accepts nothing: no start context could satisfy it
        compile_text(_ingest_with(CONTEXT_LINE, "    modelId: false\n"), "false.yaml", DEMO_REGISTRY)


def test_terminal_order_does_not_change_the_digest() -> None:
    """``terminals`` is a set of intents, like acceptable_terminal_states (which the plan sorts)."""
    swapped = _ingest_with("terminals: [completed, failed]", "terminals: [failed, completed]")
    digests = {compile_text(text, "t.yaml", DEMO_REGISTRY).digest for text in (INGEST, swapped)}
    assert len(digests) == 1

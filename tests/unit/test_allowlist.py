"""Per-namespace allowlists: the file format and its errors, pattern matching, the longest-prefix rule, and
the compiler reporting every contract and queue a definition's entry does not allow, at its file and line."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from orchestrator.allowlists import load_allowlist
from orchestrator.compiler import compile_text
from orchestrator.compiler.allowlist import (
    Allowlist,
    AllowlistError,
    Rules,
    parse_allowlist,
)
from orchestrator.errors import DefinitionError, Problem
from tests.conftest import DEMO_REGISTRY

ALLOW_FILE = "allow.yaml"
ALLOWLIST = """\
# definition-name prefix -> what its definitions may use
namespaces:
  "media-":
    contracts: ["thumbnail.render@4", "cache.*", "audit.run-terminal@*"]
    queues: ["tasks.*"]
  "media-render-":
    contracts: ["thumbnail.render@3", "thumbnail.discard@1", "audit.*"]
  "locked-":
    contracts: []
    queues: []
"""
DEFINITION = """\
name: {name}
version: "1"
entry: render
stages:
  - name: render
    type: worker
    worker: thumbnail.render@3
    {queue}
    input: {{ modelId: "m-1" }}
    compensate: thumbnail.discard@1
    on_success: completed
finalisers: [audit.run-terminal@1]
"""


def allowlist(text: str = ALLOWLIST) -> Allowlist:
    return parse_allowlist(textwrap.dedent(text), ALLOW_FILE)


def definition(name: str, queue: str = "") -> str:
    return DEFINITION.format(name=name, queue=f"queue: {queue}" if queue else "")


def line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


def problems(text: str, rules: Allowlist) -> list[Problem]:
    with pytest.raises(DefinitionError) as info:
        compile_text(text, "def.yaml", DEMO_REGISTRY, allowlist=rules)
    return info.value.problems


def parse_error(text: str) -> AllowlistError:
    with pytest.raises(AllowlistError) as info:
        parse_allowlist(textwrap.dedent(text), ALLOW_FILE)
    return info.value


# ---- matching ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pattern", "ref", "allowed"),
    [
        ("thumbnail.render@3", "thumbnail.render@3", True),
        ("thumbnail.render@3", "thumbnail.render@4", False),
        ("thumbnail.render@*", "thumbnail.render@4", True),
        ("thumbnail.render", "thumbnail.render@12", True),  # a name alone: any version
        ("thumbnail.render", "thumbnail.renderer@1", False),  # the whole name, not a prefix of it
        ("cache.*", "cache.lookup@1", True),
        ("cache.*", "cache.deep.lookup@7", True),  # * matches dots too
        ("cache.*", "catalogue.publish@2", False),
        ("cache.*@2", "cache.lookup@1", False),
        ("*.render@3", "thumbnail.render@3", True),
        ("*", "anything.at-all@999", True),
    ],
)
def test_contract_patterns(pattern: str, ref: str, allowed: bool) -> None:
    assert Rules(contracts=[pattern]).allows_contract(ref) is allowed


@pytest.mark.parametrize(
    ("pattern", "queue", "allowed"),
    [
        ("rendering", "rendering", True),
        ("rendering", "rendering2", False),
        ("tasks.*", "tasks.parallel", True),
        ("tasks.*", "rendering", False),
        ("*-pool", "gpu-pool", True),
    ],
)
def test_queue_patterns(pattern: str, queue: str, allowed: bool) -> None:
    assert Rules(queues=[pattern]).allows_queue(queue) is allowed


def test_a_list_left_out_does_not_restrict_and_an_empty_one_allows_nothing() -> None:
    assert Rules().allows_contract("x@1") and Rules().allows_queue("anything")
    assert not Rules(contracts=[]).allows_contract("x@1")
    assert not Rules(queues=[]).allows_queue("tasks.parallel")


def test_the_longest_matching_prefix_applies() -> None:
    rules = allowlist()
    found = rules.rules_for("media-render-batch")
    assert found is not None and found[0] == "media-render-"
    found = rules.rules_for("media-ingest")
    assert found is not None and found[0] == "media-"
    assert rules.rules_for("model-ingest") is None  # no catch-all: unrestricted
    with_catch_all = allowlist(ALLOWLIST + '  "":\n    contracts: ["cache.*"]\n')
    found = with_catch_all.rules_for("model-ingest")
    assert found is not None and found[0] == ""


# ---- the compiler ------------------------------------------------------------------------------------


def test_a_definition_no_entry_matches_is_unrestricted() -> None:
    text = definition("model-ingest", "rendering")
    assert compile_text(text, "def.yaml", DEMO_REGISTRY, allowlist=allowlist()).name == "model-ingest"


def test_allowed_contracts_and_queues_compile_to_the_same_plan() -> None:
    text = definition("media-render-one")
    with_allowlist = compile_text(text, "def.yaml", DEMO_REGISTRY, allowlist=allowlist())
    assert with_allowlist.digest == compile_text(text, "def.yaml", DEMO_REGISTRY).digest


def test_every_contract_and_queue_the_entry_does_not_allow_is_reported_at_its_line() -> None:
    text = definition("media-ingest", "rendering")
    found = problems(text, allowlist())
    scope = f"for definitions named 'media-*' by allowlist {ALLOW_FILE}"
    assert [(p.path, p.line) for p in found] == [  # in line order
        ("stages[0].worker", line_of(text, "worker:")),
        ("stages[0].queue", line_of(text, "queue:")),
        ("stages[0].compensate", line_of(text, "compensate:")),  # its queue, tasks.actions, is allowed
    ]
    messages = {(p.path, p.message) for p in found}
    allowed = "(allowed: thumbnail.render@4, cache.*, audit.run-terminal@*)"
    assert (
        "stages[0].worker",
        f"stage 'render': contract 'thumbnail.render@3' is not allowed {scope} {allowed}; "
        "use an allowed contract, or have it added to the allowlist's 'media-' entry",
    ) in messages
    assert (
        "stages[0].queue",
        f"stage 'render': queue 'rendering' is not allowed {scope} (allowed: tasks.*); "
        "name an allowed queue, or have it added to the allowlist's 'media-' entry",
    ) in messages
    assert any(
        "'thumbnail.discard@1' is not allowed" in m and "an allowed compensation" in m for _, m in messages
    )
    # the finaliser's contract is allowed (audit.run-terminal@*), but it is on tasks.actions: no problem
    assert not any("audit.run-terminal@1" in m for _, m in messages)
    assert all(str(p).startswith(f"def.yaml:{p.line}: {p.path}: ") for p in found)


def test_the_default_queue_of_a_stage_contract_is_checked() -> None:
    text = definition("media-ingest")  # thumbnail.render@3 defaults to rendering
    queue_problems = [p for p in problems(text, allowlist()) if p.message.startswith("stage 'render': queue")]
    assert [p.path for p in queue_problems] == ["stages[0].worker"]
    message = queue_problems[0].message
    assert "queue 'rendering' (the default queue of thumbnail.render@3) is not allowed" in message
    assert "name an allowed queue with queue:" in message
    ok = definition("media-render-one")  # the longer prefix restricts contracts only
    plan = compile_text(ok, "def.yaml", DEMO_REGISTRY, allowlist=allowlist()).plan
    assert plan["stages"]["render"]["queue"] == "rendering"


def test_an_empty_list_allows_nothing_and_a_catch_all_covers_other_names() -> None:
    locked = problems(definition("locked-one", "tasks.parallel"), allowlist())
    assert len(locked) == 6  # three contracts, three queues
    catch_all = allowlist(ALLOWLIST + '  "":\n    contracts: ["thumbnail.*"]\n')
    [problem] = problems(definition("model-ingest", "rendering"), catch_all)
    assert problem.path == "finalisers[0]"
    assert "for definitions no other prefix matches (the '' entry)" in problem.message
    assert "(allowed: thumbnail.*)" in problem.message


def test_queue_rule_and_allowlist_problems_are_listed_together() -> None:
    text = definition("media-ingest", "orch.fast.0")
    messages = [p.message for p in problems(text, allowlist()) if p.path == "stages[0].queue"]
    assert any("is reserved" in m for m in messages)
    assert any("is not allowed for definitions named 'media-*'" in m for m in messages)


# ---- the file ----------------------------------------------------------------------------------------


def test_a_valid_file_loads(tmp_path: Path) -> None:
    path = tmp_path / "allow.yaml"
    path.write_text(ALLOWLIST, encoding="utf-8")
    loaded = load_allowlist(str(path))
    assert loaded is not None and loaded.file == str(path)
    assert set(loaded.namespaces) == {"media-", "media-render-", "locked-"}
    assert loaded.namespaces["media-render-"].queues is None


@pytest.mark.parametrize("unset", [None, ""])
def test_no_file_is_no_allowlist(unset: str | None) -> None:
    assert load_allowlist(unset) is None


def test_a_missing_file_says_which_and_what_to_do(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.yaml")
    with pytest.raises(AllowlistError) as info:
        load_allowlist(missing)
    message = str(info.value)
    assert f"allowlist {missing} (SAGA_ALLOWLIST_FILE) cannot be read: No such file or directory" in message
    assert "point SAGA_ALLOWLIST_FILE at a readable allowlist file, or unset it" in message
    assert info.value.ids == {"file": missing}
    assert (info.value.code, info.value.exit_code) == ("allowlist_invalid", 2)


@pytest.mark.parametrize(
    ("text", "line", "path", "fragment"),
    [
        ("", 1, None, "is empty; it needs a namespaces: mapping"),
        ("namespaces: [a\n", 2, "allowlist", "invalid YAML"),
        ("- media-\n", 1, "allowlist", "an allowlist is a mapping with one key, namespaces:"),
        ("spaces: {}\n", 1, "allowlist", "missing 'namespaces'"),
        ("namespaces: {}\nextra: 1\n", 2, "extra", "unknown field 'extra' (allowed: namespaces)"),
        (
            'namespaces:\n  "media-":\n    contract: []\n',
            3,
            "namespaces.media-.contract",
            "(allowed: contracts, queues)",
        ),
        (
            'namespaces:\n  "media-":\n    contracts: ["cache.lookup@1", "Bad Ref"]\n',
            3,
            "namespaces.media-.contracts[1]",
            "'Bad Ref' is not a pattern: write name@version, name@* or a name with *",
        ),
        (
            'namespaces:\n  "media-":\n    queues: ["tasks.*", "a b"]\n',
            3,
            "namespaces.media-.queues[1]",
            "'a b' is not a pattern: write a queue name",
        ),
        (
            'namespaces:\n  "media-":\n    queues: tasks.*\n',
            3,
            "namespaces.media-.queues",
            "must be a list of patterns",
        ),
        (
            'namespaces:\n  "media-":\n',
            2,
            "namespaces.media-",
            "an entry is a mapping with contracts: and/or queues:",
        ),
        (
            'namespaces:\n  "media.":\n    contracts: []\n',
            2,
            "namespaces.media.",
            "prefix 'media.' can match no definition: definition names have no '.'; end it with '-' or '_' "
            "instead, e.g. 'media-'",
        ),
        (
            'namespaces:\n  "Media":\n    queues: []\n',
            2,
            "namespaces.Media",
            "is not the start of a definition name",
        ),
        (
            'namespaces:\n  "a-":\n    queues: []\n  "a-":\n    queues: []\n',
            4,
            "namespaces.a-",
            "duplicate key",
        ),
        (
            'namespaces:\n  "a-":\n    queues: [1]\n',
            3,
            "namespaces.a-.queues[0]",
            "must be a pattern (a string), got 1",
        ),
        ("namespaces:\n", 1, "namespaces", "must map definition-name prefixes to entries"),
    ],
)
def test_a_malformed_file_says_where_and_what_is_wrong(
    text: str, line: int, path: str | None, fragment: str
) -> None:
    error = parse_error(text)
    message = str(error)
    assert message.startswith(f"allowlist {ALLOW_FILE} (SAGA_ALLOWLIST_FILE) ")
    assert "fix it (the format is in docs/allowlists.md) or unset SAGA_ALLOWLIST_FILE" in message
    assert fragment in message
    if path is None:
        assert error.problems == []
        return
    assert any(p.line == line and p.path == path and p.file == ALLOW_FILE for p in error.problems), (
        error.problems
    )
    assert f"\n{ALLOW_FILE}:{line}: {path}: " in message


def test_every_problem_in_a_file_is_listed() -> None:
    error = parse_error('namespaces:\n  "media.":\n    contracts: ["X"]\n    queues: 3\n')
    assert [p.path for p in error.problems] == [
        "namespaces.media.",
        "namespaces.media..contracts[0]",
        "namespaces.media..queues",
    ]

"""The ``saga`` CLI, run as a real subprocess (``python -m orchestrator``) from the repository root.

Each test starts as few processes as it can (about 0.4 s each); the expected results are computed
in-process with the same compiler and the demo registry, so the tests check the CLI's plumbing, exit codes
and output formats rather than restating the compiler's answers.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from orchestrator.compiler import compile_text, digest_of
from orchestrator.compiler.mermaid import render_mermaid
from orchestrator.errors import DefinitionError
from orchestrator.versions import COMPILER_VERSION, DSL_VERSION, ENGINE_VERSION
from tests.conftest import DEFINITIONS, DEMO_REGISTRY, ROOT

DEFINITION_FILES = sorted(str(p.relative_to(ROOT)) for p in DEFINITIONS.glob("*.yaml"))
MODEL_INGEST = "definitions/model-ingest.yaml"

# FILE:LINE: path: message
PROBLEM_LINE = re.compile(r"^(?P<file>.+?):(?P<line>[1-9][0-9]*): (?P<path>[^\s:]+): (?P<message>\S.*)$")
DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")

# A small invalid definition: an unregistered contract and a dangling route.
BAD_CONTRACT = """\
name: bad
version: "1.0.0"
entry: a
stages:
  - name: a
    type: action
    action: nope.nope@1
    on_success: b
"""
# Shape errors only: the later layers never run.
BAD_SHAPE = """\
name: Bad Name
version: 2.3
entry: a
stages: []
bogus: 1
"""


def saga(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the CLI in a fresh interpreter with no SAGA_* settings but the ones given."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SAGA_")}
    environ.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=environ,
        timeout=60,
        check=False,
    )


def write(directory: Path, name: str, text: str | bytes) -> str:
    path = directory / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return str(path)


def assert_no_traceback(result: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in result.stderr, result.stderr


def lines(text: str) -> list[str]:
    return text.splitlines()


# ---- validate ---------------------------------------------------------------------------------------


def test_validate_every_definition_succeeds() -> None:
    result = saga("validate", *DEFINITION_FILES)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout == ""
    n = len(DEFINITION_FILES)
    assert result.stderr.strip() == f"{n} of {n} definitions valid"


def test_validate_malformed_file_prints_file_line_path_message(tmp_path: Path) -> None:
    bad = write(tmp_path, "bad.yaml", BAD_CONTRACT)
    result = saga("validate", bad)
    assert result.returncode == 1
    assert_no_traceback(result)
    assert lines(result.stdout) == [
        f"{bad}:7: stages[0].action: stage 'a': contract 'nope.nope@1' is not registered; "
        "declare it with @action in a module passed with --contracts",
        f"{bad}:8: stages[0].on_success: stage 'a': on_success target 'b' is neither a stage "
        "nor a declared terminal",
    ]
    for line in lines(result.stdout):
        match = PROBLEM_LINE.match(line)
        assert match, line
        assert match["file"] == bad
    assert result.stderr.strip() == "0 of 1 definitions valid; 2 problems"


def test_validate_several_files_reports_each_invalid_one_in_order(tmp_path: Path) -> None:
    bad_contract = write(tmp_path, "bad-contract.yaml", BAD_CONTRACT)
    bad_shape = write(tmp_path, "bad-shape.yaml", BAD_SHAPE)
    files = [MODEL_INGEST, bad_shape, "definitions/ingest-triage.yaml", bad_contract]
    result = saga("validate", *files)
    assert result.returncode == 1
    assert_no_traceback(result)
    out = lines(result.stdout)
    assert out, "invalid files must be reported"
    parsed = [PROBLEM_LINE.match(line) for line in out]
    assert all(parsed), out
    # the valid files print nothing; the invalid ones print in the order given, each sorted by line
    assert [m["file"] for m in parsed if m] == [bad_shape] * 4 + [bad_contract] * 2
    assert out[:4] == [
        f"{bad_shape}:1: name: 'Bad Name' is not valid here: names are lowercase letters, digits, '-' "
        "or '_', starting with a letter, at most 64 characters",
        f"{bad_shape}:2: version: must be a string, got 2.3; quote it in YAML",
        f"{bad_shape}:4: stages: List should have at least 1 item after validation, not 0 (got [])",
        f"{bad_shape}:5: bogus: unknown field 'bogus' (allowed: class, context, description, entry, "
        "finalisers, name, output, run_deadline_ms, stages, terminal_policy, terminals, version)",
    ]
    assert [int(m["line"]) for m in parsed[4:] if m] == [7, 8]
    assert result.stderr.strip() == "2 of 4 definitions valid; 6 problems"


def test_validate_json_report_shape(tmp_path: Path) -> None:
    bad = write(tmp_path, "bad.yaml", BAD_CONTRACT)
    result = saga("validate", "--json", MODEL_INGEST, bad)
    assert result.returncode == 1
    assert result.stderr == ""
    report = json.loads(result.stdout)
    assert set(report) == {"valid", "files"}
    assert report["valid"] is False
    good, invalid = report["files"]
    assert good == {
        "file": MODEL_INGEST,
        "valid": True,
        "digest": compile_text(Path(ROOT, MODEL_INGEST).read_bytes(), MODEL_INGEST, DEMO_REGISTRY).digest,
        "problems": [],
    }
    assert DIGEST.match(good["digest"])
    assert set(invalid) == {"file", "valid", "problems"}
    assert invalid["file"] == bad
    assert invalid["valid"] is False
    assert [set(p) for p in invalid["problems"]] == [{"file", "line", "path", "message"}] * 2
    assert [(p["file"], p["line"], p["path"]) for p in invalid["problems"]] == [
        (bad, 7, "stages[0].action"),
        (bad, 8, "stages[0].on_success"),
    ]


def test_validate_binary_file_is_reported_not_a_crash(tmp_path: Path) -> None:
    # a NUL byte (or any character YAML forbids) is an invalid definition, reported like any other
    binary = write(tmp_path, "binary.yaml", b'name: x\nversion: "1"\n\x00\xff\n')
    result = saga("validate", binary, MODEL_INGEST)
    assert_no_traceback(result)
    assert result.returncode == 1
    out = lines(result.stdout)
    assert len(out) >= 1
    for line in out:
        match = PROBLEM_LINE.match(line)
        assert match, line
        assert (match["file"], match["path"]) == (binary, "definition")
    assert result.stderr.strip().startswith("1 of 2 definitions valid;")


# ---- compile ----------------------------------------------------------------------------------------


def test_compile_json_prints_the_plan_with_digest_and_versions() -> None:
    as_json = saga("compile", "--json", MODEL_INGEST)
    as_text = saga("compile", MODEL_INGEST)
    assert as_json.returncode == 0, as_json.stderr
    assert as_text.returncode == 0, as_text.stderr

    data: dict[str, Any] = json.loads(as_json.stdout)
    digest = data.pop("digest")
    versions = data.pop("versions")
    assert digest.startswith("sha256:")
    assert DIGEST.match(digest)
    assert versions == {"dsl": DSL_VERSION, "compiler": COMPILER_VERSION, "engine": ENGINE_VERSION}
    assert digest == digest_of(data)
    expected = compile_text(Path(ROOT, MODEL_INGEST).read_bytes(), MODEL_INGEST, DEMO_REGISTRY)
    assert data == expected.plan
    assert digest == expected.digest

    text = lines(as_text.stdout)
    assert text[0] == "model-ingest 2.3.0"
    assert text[1] == f"digest   {digest}"
    assert text[2] == f"versions compiler {COMPILER_VERSION}, dsl {DSL_VERSION}, engine {ENGINE_VERSION}"
    assert "class    fast" in text
    assert "entry    cache-lookup" in text
    stage_lines = text[text.index("stages") + 1 :]
    assert [line.split()[0] for line in stage_lines] == list(expected.plan["stages"])
    rows = [line.split() for line in stage_lines]
    assert ["render-thumbnail", "worker", "thumbnail.render@3", "on", "rendering"] in rows
    assert ["cache-route", "decision"] in rows


def test_compile_invalid_definition_exits_1_with_problems_on_stderr(tmp_path: Path) -> None:
    bad = write(tmp_path, "bad.yaml", BAD_CONTRACT)
    result = saga("compile", bad)  # with --json: the error document on stdout (tests/cli/test_errors.py)
    assert result.returncode == 1
    assert result.stdout == ""
    assert_no_traceback(result)
    problems = lines(result.stderr)
    assert len(problems) == 2
    assert all(PROBLEM_LINE.match(line) for line in problems), problems


# ---- graph ------------------------------------------------------------------------------------------


def test_graph_prints_a_mermaid_flowchart_of_model_ingest() -> None:
    result = saga("graph", MODEL_INGEST)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith("flowchart LR\n")
    plan = compile_text(Path(ROOT, MODEL_INGEST).read_bytes(), MODEL_INGEST, DEMO_REGISTRY).plan
    assert out == render_mermaid(plan)
    for name in plan["stages"]:
        assert f'"{name}' in out, name  # every node label starts with the stage name
    text = lines(out)
    assert '  start(("entry")) --> S_cache_lookup' in text
    # success and failure edges
    assert '  S_cache_lookup -->|"success"| S_cache_route' in text
    assert '  S_publish -->|"success"| T_completed' in text
    assert '  S_cache_lookup -. "failure" .-> T_failed' in text
    assert '  S_cache_route -. "evaluation error" .-> T_failed' in text
    assert '  S_cache_route -->|"fallback"| S_render_thumbnail' in text
    # the fork's branches and the join
    assert "  S_derive_fork --> S_semantic_analysis" in text
    assert "  S_derive_fork --> S_technical_metadata" in text
    assert '  S_derive_join -->|"success"| S_publish' in text
    # both terminal intents lead to the finaliser
    assert '  Z["finalise in declared order: audit.run-terminal@1"]' in text
    assert '  T_completed(["completed intent"]) --> Z' in text
    assert '  T_failed(["failed intent"]) --> Z' in text


# ---- usage errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["frobnicate"], "No such command 'frobnicate'"),
        (["validate", "definitions/no-such-definition.yaml"], "does not exist"),
        (["validate", "--bogus", MODEL_INGEST], "No such option '--bogus'"),
        (["validate", "--contracts", "no.such.module", MODEL_INGEST], "'no.such.module'"),
    ],
    ids=["unknown-command", "missing-file", "unknown-option", "unknown-contracts-module"],
)
def test_usage_errors_exit_2(args: list[str], fragment: str) -> None:
    result = saga(*args)
    assert result.returncode == 2, result.stdout + result.stderr
    assert fragment in result.stderr
    assert result.stdout == ""
    assert_no_traceback(result)


def test_invalid_setting_is_a_configuration_error() -> None:
    result = saga("validate", MODEL_INGEST, env={"SAGA_MAX_STAGES": "many"})
    assert_no_traceback(result)
    assert result.returncode == 2, result.stderr
    assert "max_stages" in result.stderr.lower()


@pytest.mark.parametrize(
    "command",
    [[], ["validate"], ["compile"], ["graph"], ["contracts"], ["contracts", "list"], ["contracts", "export"]],
    ids=lambda c: " ".join(c) or "saga",
)
def test_help(command: list[str]) -> None:
    result = saga(*command, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Usage: ")
    assert_no_traceback(result)
    if command == []:
        for name in ("validate", "compile", "graph", "contracts"):
            assert re.search(rf"^  {name}\s", result.stdout, re.MULTILINE), name
    elif command == ["contracts"]:
        for name in ("list", "export"):
            assert re.search(rf"^  {name}\s", result.stdout, re.MULTILINE), name
    else:
        assert "--contracts MODULE" in result.stdout
        assert "--registry FILE" in result.stdout


# ---- contracts --------------------------------------------------------------------------------------


def test_contracts_list_shows_every_demo_contract() -> None:
    result = saga("contracts", "list")
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in lines(result.stdout)]
    assert rows == [[c.ref, c.kind.value, c.queue] for c in DEMO_REGISTRY.contracts()]
    assert len(rows) == 11


def test_exported_registry_validates_definitions_the_same_way(tmp_path: Path) -> None:
    export = saga("contracts", "export")
    assert export.returncode == 0, export.stderr
    registry_file = write(tmp_path, "registry.json", export.stdout)
    assert [c["name"] + "@" + str(c["version"]) for c in json.loads(export.stdout)["contracts"]] == (
        DEMO_REGISTRY.refs()
    )

    bad = write(tmp_path, "bad.yaml", BAD_CONTRACT)
    files = [*DEFINITION_FILES, bad]
    result = saga("validate", "--json", "--registry", registry_file, *files)
    assert result.returncode == 1
    report = json.loads(result.stdout)
    for path, entry in zip(files, report["files"], strict=True):
        assert entry["file"] == path
        try:
            plan = compile_text(Path(ROOT, path).read_bytes(), path, DEMO_REGISTRY)
        except DefinitionError as exc:
            assert entry["valid"] is False
            assert [f"{p['file']}:{p['line']}: {p['path']}: {p['message']}" for p in entry["problems"]] == [
                str(p) for p in exc.problems
            ]
        else:
            assert entry == {"file": path, "valid": True, "digest": plan.digest, "problems": []}


def test_saga_contracts_env_with_a_module_without_handlers_is_a_configuration_error(tmp_path: Path) -> None:
    (tmp_path / "no_handlers_here.py").write_text('"""Declares nothing."""\nVALUE = 1\n', encoding="utf-8")
    result = saga(
        "validate",
        MODEL_INGEST,
        env={"SAGA_CONTRACTS": "no_handlers_here", "PYTHONPATH": str(tmp_path)},
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "'no_handlers_here'" in result.stderr
    assert "no @action or @worker handlers" in result.stderr
    assert_no_traceback(result)


def test_saga_contracts_env_selects_the_registry(tmp_path: Path) -> None:
    (tmp_path / "only_lookup.py").write_text(
        "from workers.demo import cache_lookup\n"
        "from workers.demo.models import CacheLookupOutput, ModelRef\n"
        "from workers.sdk import action\n\n\n"
        '@action("own.thing", version=7, input=ModelRef, output=CacheLookupOutput, queue="own")\n'
        "def own_thing(payload: ModelRef) -> CacheLookupOutput:\n"
        "    return CacheLookupOutput(modelId=payload.modelId, hit=True)\n",
        encoding="utf-8",
    )
    env = {"SAGA_CONTRACTS": "only_lookup", "PYTHONPATH": str(tmp_path)}
    listed = saga("contracts", "list", "--json", env=env)
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout) == [
        {"ref": "cache.lookup@1", "kind": "action", "queue": "tasks.actions"},
        {"ref": "own.thing@7", "kind": "action", "queue": "own"},
    ]
    # model-ingest needs contracts this registry does not have: invalid definition (exit 1), not a crash
    result = saga("validate", MODEL_INGEST, env=env)
    assert result.returncode == 1
    out = lines(result.stdout)
    assert out and all(PROBLEM_LINE.match(line) for line in out)
    assert "thumbnail.render@3" in result.stdout
    assert "cache.lookup@1" not in result.stdout

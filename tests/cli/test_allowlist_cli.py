"""``saga validate`` with the task-queue rule and a per-namespace allowlist (SAGA_ALLOWLIST_FILE), run as a
real subprocess: a refused queue or contract is a problem line and exit 1; an allowlist that cannot be used
is a configuration error, exit 2."""

from __future__ import annotations

import json
from pathlib import Path

from tests.cli.test_cli import DEFINITION_FILES, MODEL_INGEST, PROBLEM_LINE, assert_no_traceback, saga, write

ALLOWLIST = """\
namespaces:
  "model-":
    contracts: ["cache.*", "thumbnail.*", "semantic.analyse@*", "metadata.extract@2", "audit.*"]
    queues: ["tasks.*", "rendering", "analysis"]
"""
EVERYTHING = """\
namespaces:
  "":
    contracts: ["*"]
    queues: ["*"]
"""
SHARD_QUEUE = """\
name: stray
version: "1.0.0"
entry: a
stages:
  - name: a
    type: action
    action: cache.lookup@1
    queue: orch.fast.0
    input: { modelId: "m-1" }
    on_success: completed
"""


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line]


def test_validate_reports_what_the_allowlist_refuses_and_exits_1(tmp_path: Path) -> None:
    allow = write(tmp_path, "allow.yaml", ALLOWLIST)
    result = saga("validate", MODEL_INGEST, env={"SAGA_ALLOWLIST_FILE": allow})
    assert result.returncode == 1, result.stdout + result.stderr
    assert_no_traceback(result)
    by_path = {}
    for line in lines(result.stdout):
        match = PROBLEM_LINE.match(line)
        assert match, line
        assert match["file"] == MODEL_INGEST
        by_path[match["path"]] = match["message"]
    assert set(by_path) == {"stages[5].queue", "stages[7].action"}
    assert by_path["stages[5].queue"] == (
        f"stage 'technical-metadata': queue 'metadata' is not allowed for definitions named 'model-*' by "
        f"allowlist {allow} (allowed: tasks.*, rendering, analysis); name an allowed queue, or have it added "
        "to the allowlist's 'model-' entry"
    )
    assert (
        "contract 'catalogue.publish@2' is not allowed for definitions named 'model-*'"
        in (by_path["stages[7].action"])
    )
    assert result.stderr.strip() == "0 of 1 definitions valid; 2 problems"


def test_an_allowlist_that_allows_everything_changes_nothing(tmp_path: Path) -> None:
    allow = write(tmp_path, "allow.yaml", EVERYTHING)
    result = saga("validate", *DEFINITION_FILES, env={"SAGA_ALLOWLIST_FILE": allow})
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stderr.strip() == f"{len(DEFINITION_FILES)} of {len(DEFINITION_FILES)} definitions valid"


def test_a_shard_queue_is_refused_without_an_allowlist(tmp_path: Path) -> None:
    stray = write(tmp_path, "stray.yaml", SHARD_QUEUE)
    result = saga("validate", stray)
    assert result.returncode == 1, result.stdout + result.stderr
    assert_no_traceback(result)
    [line] = lines(result.stdout)
    match = PROBLEM_LINE.match(line)
    assert match and (match["file"], match["line"], match["path"]) == (stray, "8", "stages[0].queue")
    assert "queue 'orch.fast.0' is reserved" in match["message"]


def test_a_malformed_allowlist_is_a_configuration_error(tmp_path: Path) -> None:
    allow = write(tmp_path, "allow.yaml", 'namespaces:\n  "model.":\n    contracts: []\n')
    result = saga("validate", MODEL_INGEST, env={"SAGA_ALLOWLIST_FILE": allow})
    assert result.returncode == 2, result.stdout + result.stderr
    assert_no_traceback(result)
    assert f"allowlist {allow} (SAGA_ALLOWLIST_FILE) is invalid" in result.stderr
    assert f"{allow}:2: namespaces.model.: prefix 'model.' can match no definition" in result.stderr
    as_json = saga("validate", "--json", MODEL_INGEST, env={"SAGA_ALLOWLIST_FILE": allow})
    assert as_json.returncode == 2
    error = json.loads(as_json.stdout)["error"]
    assert (error["code"], error["ids"]) == ("allowlist_invalid", {"file": allow})


def test_a_missing_allowlist_file_is_a_configuration_error(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.yaml")
    result = saga("compile", MODEL_INGEST, env={"SAGA_ALLOWLIST_FILE": missing})
    assert result.returncode == 2, result.stdout + result.stderr
    assert_no_traceback(result)
    assert f"allowlist {missing} (SAGA_ALLOWLIST_FILE) cannot be read" in result.stderr

"""The run commands through real subprocesses, against a real stack: their JSON shapes and exit codes."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration.stack import Stack, running

pytestmark = pytest.mark.services


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with running("cli") as s:
        yield s


def saga(stack: Stack, *args: str) -> subprocess.CompletedProcess[str]:
    return stack.saga(*args)


def saga_json(stack: Stack, *args: str) -> Any:
    return stack.saga_json(*args)


def test_publish_start_wait_status_history_and_runs(stack: Stack) -> None:
    published = saga_json(stack, "definitions", "publish", "definitions/model-ingest.yaml")
    assert published[0]["definition"] == "model-ingest" and published[0]["digest"].startswith("sha256:")

    started = saga_json(stack, "start", "model-ingest", "--context", '{"modelId": "cli-1"}', "--wait", "30")
    assert started["state"] == "completed"
    assert started["output"] == {"modelId": "cli-1", "catalogueId": "cat-cli-1"}
    run_id = started["run_id"]

    status = saga_json(stack, "status", run_id)
    assert {
        "run_id",
        "state",
        "intent",
        "reason",
        "definition",
        "version",
        "digest",
        "shard",
        "output",
        "stages",
    } <= set(status)
    assert status["state"] == "completed" and status["intent"] == "completed"
    assert status["digest"] == published[0]["digest"]
    publish = status["stages"]["publish"]
    assert (publish["state"], publish["attempt"]) == ("completed", 1)

    history = saga_json(stack, "history", run_id)
    assert history["run_id"] == run_id
    events = history["events"]
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    assert all({"seq", "at", "kind", "stage", "attempt"} <= set(e) for e in events)
    kinds = [e["kind"] for e in events]
    assert kinds[0] == "run.started" and kinds[-1] == "run.completed"
    assert {
        "stage.dispatched",
        "stage.completed",
        "decision.taken",
        "join.released",
        "intent.set",
        "finaliser.completed",
    } <= set(kinds)

    listed = saga_json(stack, "runs", "--state", "completed")["runs"]
    assert any(r["run_id"] == run_id and r["definition"] == "model-ingest" for r in listed)
    assert saga_json(stack, "runs", "--state", "failed")["runs"] == []


def test_start_without_wait_is_pending_and_text_output_reads_well(stack: Stack) -> None:
    started = saga_json(stack, "start", "ingest-triage", "--context", '{"sizeMb": 1, "format": "obj"}')
    assert set(started) == {"run_id", "state"} and started["state"] == "pending"
    text = saga(stack, "history", started["run_id"])
    assert text.returncode == 0 and "run.started" in text.stdout


def test_a_failed_run_exits_1_with_its_reason(stack: Stack) -> None:
    stack.world.set_fault("cli-broken", "thumbnail.render", fail=True)
    done = saga(
        stack, "start", "model-ingest", "--context", '{"modelId": "cli-broken"}', "--wait", "30", "--json"
    )
    assert done.returncode == 1
    document = json.loads(done.stdout)
    assert document["state"] == "failed" and "render-thumbnail" in document["reason"]


@pytest.mark.parametrize(
    ("args", "code", "says"),
    [
        (("start", "model-ingest", "--context", "{not json"), 2, "--context is not JSON"),
        (("start", "model-ingest", "--context", "[1]"), 2, "--context must be a JSON object"),
        (("start", "no-such-flow", "--context", "{}"), 1, "'no-such-flow' is not published"),
        (("status", "0" * 32), 1, "not found"),
        (("history", "0" * 32), 1, "not found"),
    ],
)
def test_errors_say_what_is_wrong(stack: Stack, args: tuple[str, ...], code: int, says: str) -> None:
    done = saga(stack, *args)
    assert done.returncode == code, (done.stdout, done.stderr)
    assert says in done.stderr

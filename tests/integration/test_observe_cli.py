"""The read-only run commands (status, wait, watch, history, runs) through real subprocesses against a
real stack: what they show, their JSON and their exit codes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from orchestrator.views import plan_order
from tests.integration.stack import ROOT, Stack, poll, running
from workers.serial_lane import lane_key

pytestmark = pytest.mark.services

MODEL_INGEST_ORDER = [
    "cache-lookup",
    "cache-route",
    "render-thumbnail",
    "derive-fork",
    "semantic-analysis",
    "technical-metadata",
    "derive-join",
    "publish",
]
ISO = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with running("observe") as s:
        yield s


def start(stack: Stack, definition: str, context: dict[str, Any], *wait: str) -> dict[str, Any]:
    document: dict[str, Any] = stack.saga_json("start", definition, "--context", json.dumps(context), *wait)
    return document


def status(stack: Stack, run_id: str, *args: str) -> dict[str, Any]:
    document: dict[str, Any] = stack.saga_json("status", run_id, *args)
    return document


def test_status_lists_the_plan_in_order_with_results_route_and_inputs(stack: Stack) -> None:
    # Given a completed model-ingest run
    run_id = start(stack, "model-ingest", {"modelId": "obs-1"}, "--wait", "30")["run_id"]

    # When its status is asked for, as JSON and as text
    document = status(stack, run_id, "--inputs")
    text = stack.saga("status", run_id)

    # Then the stages are still a map, with the plan order beside it, and each says what it came to
    assert document["order"] == MODEL_INGEST_ORDER
    assert set(document["stages"]) == set(MODEL_INGEST_ORDER)
    assert document["stages"]["cache-lookup"]["result"] == {"hit": False, "modelId": "obs-1"}
    assert document["stages"]["cache-lookup"]["input"] == {"modelId": "obs-1"}
    assert (document["stages"]["cache-route"]["branch"], document["stages"]["cache-route"]["next"]) == (
        1,
        "render-thumbnail",
    )
    assert document["stages"]["derive-join"]["arrived"] == {"done": 2, "total": 2}
    assert text.returncode == 0, text.stderr
    rows = [line.split()[0] for line in text.stdout.splitlines()[4:]]
    assert rows == MODEL_INGEST_ORDER
    assert "→ render-thumbnail (branch 1)" in text.stdout
    assert re.search(rf"^created {ISO}  finished {ISO}$", text.stdout, re.MULTILINE)
    assert "queued" not in text.stdout


def test_a_stage_nobody_consumes_says_so_and_wait_gives_up_with_exit_3(stack: Stack) -> None:
    # Given no worker running, and a run whose first task waits on its queue
    stack.stop("worker")
    try:
        run_id = start(stack, "model-ingest", {"modelId": "obs-2"})["run_id"]
        poll(lambda: stack.record(run_id).get("s:cache-lookup:status") == "dispatched", 20, what="dispatched")

        # When its status is asked for
        lookup = status(stack, run_id)["stages"]["cache-lookup"]
        text = stack.saga("status", run_id).stdout

        # Then it is dispatched (never "queued") and says nobody consumes its queue
        queue = stack.settings.names().task_queue("tasks.actions", "cache.lookup@1")
        assert lookup["state"] == "dispatched"
        assert lookup["waiting"]["reason"] == "no-worker" and lookup["waiting"]["queue"] == queue
        assert f"waiting for a worker of cache.lookup@1 (nobody consumes {queue})" in text

        # And waiting for it gives up with exit 3, naming the command that waits again
        gave_up = stack.saga("wait", run_id, "--timeout", "1")
        assert gave_up.returncode == 3, gave_up.stderr
        assert f"'saga wait {run_id}'" in gave_up.stderr
        as_json = stack.saga("wait", run_id, "--timeout", "0.5", "--json")
        assert as_json.returncode == 3 and json.loads(as_json.stdout)["timed_out"] is True
    finally:
        stack.start_worker()

    # When a worker is back, the same wait ends with the run: exit 0
    done = stack.saga("wait", run_id, "--timeout", "30")
    assert done.returncode == 0, done.stderr
    assert "completed" in done.stdout


def test_a_serial_task_says_who_holds_the_lane(stack: Stack) -> None:
    # Given the serial lane held by another run's task on another worker
    since_ms = int(time.time() * 1000)
    holder = {
        "worker": "elsewhere:7",
        "run_id": "other-run",
        "stage": "swap",
        "contract": "index.swap@1",
        "fence": "1.1",
        "since_ms": since_ms,
        "token": "t",
    }
    key = lane_key(stack.prefix)
    stack.redis.set(key, json.dumps(holder, sort_keys=True), px=60_000)
    try:
        run_id = start(stack, "catalogue-reindex", {"index": "obs-idx"})["run_id"]

        # When its status is asked for while its first step waits
        found = poll(
            lambda: status(stack, run_id)["stages"].get("snapshot", {}).get("waiting"),
            20,
            what="a waiting reason",
        )

        # Then it names the lane's holder
        assert found["reason"] == "serial-lane" and found["holder"]["run_id"] == "other-run"
        assert "waiting for the serial lane (held by other-run/swap on elsewhere:7 since " in found["message"]
        assert status(stack, run_id)["order"] == ["snapshot", "rebuild", "swap"]
    finally:
        stack.redis.delete(key)

    # And once the lane is free the run goes on
    assert stack.saga("wait", run_id, "--timeout", "30").returncode == 0


def test_wait_on_a_failed_run_exits_1_with_state_and_reason(stack: Stack) -> None:
    stack.world.set_fault("obs-broken", "thumbnail.render", fail=True)
    run_id = start(stack, "model-ingest", {"modelId": "obs-broken"})["run_id"]

    done = stack.saga("wait", run_id, "--timeout", "30")
    as_json = stack.saga("wait", run_id, "--json")

    assert done.returncode == 1
    assert f"run {run_id} failed" in done.stdout and "render-thumbnail" in done.stderr
    assert as_json.returncode == 1
    document = json.loads(as_json.stdout)
    assert document["state"] == "failed" and "render-thumbnail" in document["reason"]
    assert document["timed_out"] is False


def test_unknown_runs_exit_1(stack: Stack) -> None:
    for args in (("status", "f" * 32), ("history", "f" * 32), ("wait", "f" * 32, "--timeout", "1")):
        done = stack.saga(*args)
        assert done.returncode == 1, (args, done.stdout, done.stderr)
        assert "not found" in done.stderr


def test_start_wait_timeout_names_saga_wait(stack: Stack) -> None:
    done = stack.saga("start", "model-ingest", "--context", '{"modelId": "obs-slow"}', "--wait", "0.001")
    assert done.returncode == 3  # still running, as saga wait says it
    assert re.search(r"'saga wait [0-9a-f]{32}' waits again", done.stderr), done.stderr


def test_watch_prints_the_table_in_plan_order_until_the_run_ends(stack: Stack) -> None:
    # Given a run slowed down so that there is something to watch
    stack.world.set_fault("obs-watch", "thumbnail.render", delay_ms=3000)
    run_id = start(stack, "model-ingest", {"modelId": "obs-watch"})["run_id"]

    # When it is watched with stdout not a terminal
    done = stack.saga("watch", run_id, "--interval", "0.1")

    # Then it exits 0 when the run completed, having printed only changed tables, stages in plan order
    assert done.returncode == 0, done.stderr
    assert "\x1b[" not in done.stdout
    tables = done.stdout.split("  run ")[1:]
    assert len(tables) >= 2 and len(set(tables)) == len(tables)
    last = tables[-1].splitlines()
    assert "state: completed" in last[0]
    assert [row.split()[1] for row in last[1:]] == MODEL_INGEST_ORDER
    assert any("▶ render-thumbnail" in t or "… render-thumbnail" in t for t in tables)


def test_watch_of_a_map_shows_items_done_of_total(stack: Stack) -> None:
    run_id = start(stack, "thumbnail-batch", {"modelIds": ["a", "b", "c"]}, "--wait", "30")["run_id"]
    done = stack.saga("watch", run_id)
    assert done.returncode == 0, done.stderr
    assert re.search(r"✔ render-all\s+completed\s+3/3", done.stdout)
    assert status(stack, run_id)["stages"]["render-all"]["items"] == {"done": 3, "total": 3}


def test_history_times_have_date_and_zone(stack: Stack) -> None:
    run_id = start(stack, "ingest-triage", {"sizeMb": 1, "format": "obj"}, "--wait", "30")["run_id"]
    text = stack.saga("history", run_id)
    assert text.returncode == 0, text.stderr
    assert re.match(rf"^\s+1 {ISO} run\.started\s", text.stdout)
    assert stack.saga_json("history", run_id)["events"][0]["kind"] == "run.started"


def test_runs_lists_newest_first_with_filters_and_a_limit(stack: Stack) -> None:
    # Given three fresh ingest-triage runs, one of which fails
    ids = []
    for size in (1, 2, 4096):
        context = json.dumps({"sizeMb": size, "format": "obj"})
        done = stack.saga("start", "ingest-triage", "--context", context, "--wait", "30", "--json")
        assert done.returncode == (1 if size > 2048 else 0), done.stderr
        ids.append(json.loads(done.stdout)["run_id"])

    # Then they are listed newest first, with the filters and limit applied
    newest = stack.saga_json("runs", "--definition", "ingest-triage", "--since", "10m", "--limit", "2")[
        "runs"
    ]
    assert [r["run_id"] for r in newest] == ids[::-1][:2]
    assert newest[0]["state"] == "failed" and newest[0]["reason"]
    assert re.fullmatch(ISO, newest[0]["created"]) and newest[0]["version"] == "1.0.0"
    failed = stack.saga_json("runs", "--state", "failed", "--definition", "ingest-triage")["runs"]
    assert ids[2] in [r["run_id"] for r in failed] and all(r["state"] == "failed" for r in failed)
    assert stack.saga_json("runs", "--version", "9.9.9")["runs"] == []
    assert (
        stack.saga_json("runs", "--since", "2000-01-01T00:00:00Z", "--limit", "1")["runs"][0]["run_id"]
        == ids[2]
    )
    assert stack.saga_json("runs", "--since", "2999-01-01T00:00:00Z")["runs"] == []

    # And the text has a header and ISO times
    text = stack.saga("runs", "--definition", "ingest-triage", "--limit", "3")
    header, *lines = text.stdout.splitlines()
    assert header.split() == ["RUN", "DEFINITION", "VERSION", "STATE", "CREATED", "UPDATED", "REASON"]
    assert [line.split()[0] for line in lines] == ids[::-1]
    assert re.search(ISO, lines[0])


def test_runs_refuses_an_unknown_state_listing_the_valid_ones(stack: Stack) -> None:
    done = stack.saga("runs", "--state", "queued")
    assert done.returncode == 2
    for state in ("pending", "running", "finalising", "completed", "failed"):
        assert state in done.stderr


def test_every_observe_option_is_documented() -> None:
    for command, options in {
        "status": ("--inputs", "--json"),
        "wait": ("--timeout", "--json"),
        "watch": ("--interval", "--timeout"),
        "history": ("--json",),
        "runs": ("--state", "--definition", "--version", "--limit", "--since", "--json"),
    }.items():
        done = subprocess.run(
            [sys.executable, "-m", "orchestrator", command, "--help"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        for option in options:
            assert option in done.stdout, (command, option)


def test_plan_order_of_the_stored_plan_matches_the_golden_one(stack: Stack) -> None:
    run_id = start(stack, "catalogue-reindex", {"index": "obs-order"}, "--wait", "30")["run_id"]
    document = status(stack, run_id)
    plan = json.loads((ROOT / "tests" / "golden" / "plans" / "catalogue-reindex.json").read_text())
    assert document["order"] == plan_order(plan)

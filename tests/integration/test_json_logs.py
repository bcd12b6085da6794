"""SAGA_LOG_FORMAT=json on real processes: every line an orchestrator and a worker write is one JSON
object, and the records logged while a run's messages are handled carry its ids."""

from __future__ import annotations

import json
from typing import Any

import pytest

from orchestrator.client import SyncClient
from tests.integration.stack import Stack

pytestmark = pytest.mark.services

JSON = {"SAGA_LOG_FORMAT": "json"}


def records(log: str) -> list[dict[str, Any]]:
    """Every line of a process's log (its stdout and stderr), each of which must be a JSON log record."""
    found = []
    for number, line in enumerate(log.splitlines(), 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            pytest.fail(f"line {number} is not JSON: {line!r}")
        assert isinstance(record, dict), line
        assert {"time", "level", "logger", "message"} <= record.keys(), line
        found.append(record)
    return found


def test_every_line_is_json_and_a_runs_records_carry_its_ids() -> None:
    stack = Stack("jsonlogs")
    stack.setup()
    try:
        # Given an orchestrator and a worker logging JSON (with -v), and a render that fails for this
        # model, so the worker logs the failed task
        stack.start_orchestrator(extra_env=JSON)
        stack.start_worker(extra_env=JSON)
        stack.world.set_fault("json-1", "thumbnail.render", fail=True)
        # When a model-ingest run goes through both
        with SyncClient(stack.settings) as client:
            run_id = client.start("model-ingest", {"modelId": "json-1"})
            assert client.wait(run_id, timeout_s=15).state == "failed"
        shard = stack.shard_of(run_id)
        for name in ("orchestrator", "worker"):  # stopped: their logs are complete, the drain included
            assert stack.stop(name) == 0
        orchestrator, worker = records(stack.log("orchestrator")), records(stack.log("worker"))
    finally:
        stack.teardown()
    # Then every line of both logs was a JSON record (checked above), the start-up lines and the
    # development-mode durability warning included
    for logged, starting in (
        (orchestrator, "orchestrator serving "),
        (worker, "worker workers.demo serving "),
    ):
        assert any(r["message"].startswith(starting) and r["level"] == "INFO" for r in logged)
        assert any(r["logger"] == "orchestrator.durability" and r["level"] == "WARNING" for r in logged)
    # and the worker's record of the failed task carries the run, stage, attempt, shard and message ids
    [failed] = [r for r in worker if r.get("run_id") == run_id]
    assert failed["message"].startswith(f"task render-thumbnail of run {run_id} failed")
    assert failed["shard"] == shard and failed["stage"] == "render-thumbnail" and failed["attempt"] == 1
    assert failed["message_id"]
    # and the orchestrator's records about the run's shard carry it
    assert any(r.get("shard") == shard and "serving it" in r["message"] for r in orchestrator)

"""The pure rendering of what a run is doing (orchestrator/views.py): plan order, the status document's
additions, waiting reasons, and the text of status, watch, history and runs."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from orchestrator import views
from orchestrator.client import status_document

PLANS = Path(__file__).resolve().parents[1] / "golden" / "plans"
AT = int(datetime(2026, 12, 2, 1, 2, 3, 456_000, tzinfo=UTC).timestamp() * 1000)


def plan(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((PLANS / f"{name}.json").read_text())
    return data


def stage(status: str, attempt: int = 1, **fields: str) -> dict[str, str]:
    return {"status": status, "attempt": str(attempt), "fence": f"1.{attempt}", **fields}


def record(stages: dict[str, dict[str, str]], **run: str) -> dict[str, str]:
    flat = {
        "run_id": "r-1",
        "shard": "fast.0",
        "digest": "sha256:abc",
        "status": "running",
        "definition": "model-ingest",
        "version": "2.3.0",
        "context": json.dumps({"modelId": "m-1"}),
        "created_at": str(AT),
        **run,
    }
    for name, fields in stages.items():
        if name.startswith("b:"):
            flat[name] = fields["count"]
            continue
        flat.update({f"s:{name}:{k}": v for k, v in fields.items()})
    return flat


def view(flat: dict[str, str], name: str = "model-ingest", inputs: bool = False) -> dict[str, Any]:
    return views.enrich(status_document(flat), flat, plan(name), inputs=inputs)


# ---- plan order ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "order"),
    [
        (
            "model-ingest",
            [
                "cache-lookup",
                "cache-route",
                "render-thumbnail",
                "derive-fork",
                "semantic-analysis",
                "technical-metadata",
                "derive-join",
                "publish",
            ],
        ),
        ("catalogue-reindex", ["snapshot", "rebuild", "swap"]),
        ("ingest-triage", ["size-gate", "format-gate"]),
        ("thumbnail-batch", ["render-all"]),
    ],
)
def test_plan_order_is_the_order_a_run_meets_its_stages(name: str, order: list[str]) -> None:
    assert views.plan_order(plan(name)) == order


def test_plan_order_walks_a_branch_to_its_end_and_puts_the_join_after_every_branch() -> None:
    stages = {
        "fork": {"type": "fork", "branches": ["a1", "b1"]},
        "a1": {"type": "action", "on_success": "a2", "on_failure": "failed"},
        "a2": {"type": "action", "on_success": "join", "on_failure": "failed"},
        "b1": {"type": "action", "on_success": "join", "on_failure": "cleanup"},
        "join": {"type": "join", "fork": "fork", "on_success": "completed", "on_failure": "failed"},
        "cleanup": {"type": "action", "on_success": "failed", "on_failure": "failed"},
    }
    assert views.plan_order({"entry": "fork", "stages": stages}) == [
        "fork",
        "a1",
        "a2",
        "b1",
        "join",
        "cleanup",
    ]


# ---- small helpers ------------------------------------------------------------------------------------


def test_times_are_iso_8601_utc_with_milliseconds() -> None:
    assert views.iso_utc(AT) == "2026-12-02T01:02:03.456Z"
    assert views.iso_utc(None) == "-"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("15m", AT - 15 * 60_000),
        ("2h", AT - 2 * 3_600_000),
        ("1d", AT - 86_400_000),
        ("90s", AT - 90_000),
        ("2026-12-02T01:02:03.456Z", AT),
        ("2026-12-02T01:02:03.456", AT),  # no zone: UTC
        ("2026-12-02T02:02:03.456+01:00", AT),
    ],
)
def test_since_takes_a_duration_or_an_iso_datetime(text: str, expected: int) -> None:
    assert views.parse_since(text, AT) == expected


@pytest.mark.parametrize("text", ["yesterday", "15", "15x", ""])
def test_since_refuses_anything_else_and_says_what_it_takes(text: str) -> None:
    with pytest.raises(ValueError, match="ISO 8601"):
        views.parse_since(text, AT)


def test_truncate_keeps_one_line_and_marks_the_cut() -> None:
    assert views.truncate("a\nb", 10) == "a b"
    assert views.truncate("x" * 20, 8) == "xxxxxxx…"
    assert len(views.compact({"k": "v" * 500})) == views.RESULT_WIDTH


# ---- the status document ------------------------------------------------------------------------------


def test_a_join_waits_until_a_branch_arrived_then_counts_arrivals() -> None:
    fork_released = {
        "cache-lookup": stage("completed", result='{"hit": false, "modelId": "m-1"}'),
        "cache-route": stage("completed", result='{"branch": 1}'),
        "render-thumbnail": stage("completed", result='{"thumbnailUri": "s3://t/m-1.png"}'),
        "derive-fork": stage("completed"),
        "semantic-analysis": stage("dispatched"),
        "technical-metadata": stage("dispatched"),
        "derive-join": stage("running"),
        "b:derive-join": {"count": "2"},
    }
    before = view(record(fork_released))
    join = before["stages"]["derive-join"]
    assert join["state"] == "running" and join["arrived"] == {"done": 0, "total": 2}
    assert views.shown_state(join) == "waiting"

    one_arrived = {
        **fork_released,
        "technical-metadata": stage("completed", result="{}"),
        "b:derive-join": {"count": "1"},
    }
    after = view(record(one_arrived))["stages"]["derive-join"]
    assert views.shown_state(after) == "running" and views.progress(after) == "1/2 arrived"


def test_the_document_adds_plan_order_results_and_the_decision_route() -> None:
    document = view(
        record(
            {
                "cache-lookup": stage("completed", result='{"hit": false, "modelId": "m-1"}'),
                "cache-route": stage("completed", result='{"branch": 1}'),
                "render-thumbnail": stage("failed", 2, error="renderer crashed"),
            }
        )
    )
    assert document["order"][:3] == ["cache-lookup", "cache-route", "render-thumbnail"]
    assert set(document["stages"]) == {"cache-lookup", "cache-route", "render-thumbnail"}  # still a map
    assert document["stages"]["cache-lookup"]["result"] == {"hit": False, "modelId": "m-1"}
    route = document["stages"]["cache-route"]
    assert (route["branch"], route["next"]) == (1, "render-thumbnail")
    assert document["stages"]["render-thumbnail"] == {
        "state": "failed",
        "attempt": 2,
        "type": "worker",
        "error": "renderer crashed",
    }


def test_a_map_shows_items_done_of_total() -> None:
    flat = record(
        {"render-all": stage("dispatched", items="10"), "b:render-all": {"count": "7"}},
        definition="thumbnail-batch",
        context=json.dumps({"modelIds": [f"m-{i}" for i in range(10)]}),
    )
    document = view(flat, "thumbnail-batch", inputs=True)
    bag = document["stages"]["render-all"]
    assert bag["items"] == {"done": 3, "total": 10}
    assert bag["input"][:2] == [{"modelId": "m-0"}, {"modelId": "m-1"}]
    row = views.table_rows(document)[0]
    assert "render-all" in row and "dispatched" in row and "3/10" in row


def test_inputs_are_bound_from_the_context_and_the_results_read() -> None:
    flat = record(
        {
            "snapshot": stage("completed", result='{"index": "idx-2", "step": "snapshot"}'),
            "rebuild": stage("dispatched"),
        },
        definition="catalogue-reindex",
        context=json.dumps({"index": "idx-1"}),
    )
    document = view(flat, "catalogue-reindex", inputs=True)
    assert document["stages"]["snapshot"]["input"] == {"index": "idx-1"}
    assert document["stages"]["rebuild"]["input"] == {"index": "idx-2"}
    assert "input" not in view(flat, "catalogue-reindex")["stages"]["rebuild"]


# ---- waiting reasons ----------------------------------------------------------------------------------

QUEUE = "saga.task.tasks.serial:index.snapshot@1"


def reason(
    consumers: int | None, holder: dict[str, Any] | None, serial: bool = True
) -> dict[str, Any] | None:
    return views.waiting_reason(
        run_id="r-1",
        stage="snapshot",
        contract="index.snapshot@1",
        queue="tasks.serial",
        broker_queue=QUEUE,
        consumers=consumers,
        holder=holder,
        serial=serial,
    )


def test_nobody_consuming_the_queue_is_the_reason() -> None:
    found = reason(0, None)
    assert found is not None and found["reason"] == "no-worker"
    assert found["message"] == f"waiting for a worker of index.snapshot@1 (nobody consumes {QUEUE})"


def test_a_serial_task_waits_for_the_lane_another_task_holds() -> None:
    holder = {
        "worker": "host:42",
        "run_id": "r-9",
        "stage": "swap",
        "contract": "index.swap@1",
        "since_ms": AT,
    }
    found = reason(1, holder)
    assert found is not None and found["reason"] == "serial-lane" and found["holder"] == holder
    assert (
        found["message"]
        == "waiting for the serial lane (held by r-9/swap on host:42 since 2026-12-02T01:02:03.456Z)"
    )


def test_no_reason_when_it_is_not_known() -> None:
    assert reason(None, None) is None  # the broker was not asked
    assert reason(2, None) is None  # consumed, lane free: a worker may be on it
    assert reason(1, {"run_id": "r-1", "stage": "snapshot", "worker": "w"}) is None  # it holds the lane
    assert reason(1, {"run_id": "r-9", "stage": "x"}, serial=False) is None


# ---- text ---------------------------------------------------------------------------------------------


def test_status_text_lists_every_stage_in_plan_order_with_why_it_waits() -> None:
    document = view(
        record(
            {
                "cache-lookup": stage("completed", result='{"hit": false, "modelId": "' + "m" * 200 + '"}'),
                "cache-route": stage("completed", result='{"branch": 1}'),
                "render-thumbnail": stage("dispatched"),
            }
        ),
        inputs=True,
    )
    document["stages"]["render-thumbnail"]["waiting"] = reason(0, None)
    lines = views.status_lines(document, inputs=True)
    assert lines[0] == "r-1  model-ingest 2.3.0  running"
    assert lines[1] == "created 2026-12-02T01:02:03.456Z"
    names = [line.split()[0] for line in lines[3:] if not line.strip().startswith("input")]
    assert names == views.plan_order(plan("model-ingest"))
    lookup = next(line for line in lines if line.strip().startswith("cache-lookup"))
    assert lookup.endswith("…") and len(lookup) < 140  # a long result is cut
    assert any("→ render-thumbnail (branch 1)" in line for line in lines)
    assert any("waiting for a worker of index.snapshot@1" in line for line in lines)
    assert any(line.strip() == 'input {"modelId": "m-1"}' for line in lines)


def test_live_table_prints_only_changes_when_not_a_terminal() -> None:
    table = views.LiveTable(tty=False)
    document = view(record({"cache-lookup": stage("dispatched")}))
    first = table.frame(document, 0.1)
    assert first is not None and "cache-lookup" in first and "dispatched" in first
    assert table.frame(document, 0.2) is None
    later = view(record({"cache-lookup": stage("completed", result="{}")}))
    assert "✔ cache-lookup" in (table.frame(later, 0.3) or "")
    ended = view(record({"cache-lookup": stage("completed", result="{}")}, status="completed"))
    assert "state: completed" in (table.frame(ended, 0.4) or "")  # only the run's state changed


def test_live_table_redraws_in_place_on_a_terminal() -> None:
    table = views.LiveTable(tty=True)
    document = view(record({"cache-lookup": stage("dispatched")}))
    first = table.frame(document, 0.1) or ""
    again = table.frame(document, 0.2) or ""
    assert not first.startswith("\x1b[") and again.startswith(f"\x1b[{1 + 8}F")


def test_history_lines_carry_date_and_zone() -> None:
    line = views.history_line(
        {
            "seq": 3,
            "id": "1-0",
            "at": AT,
            "kind": "stage.completed",
            "stage": "publish",
            "attempt": 1,
            "ok": True,
        }
    )
    assert line.startswith("   3 2026-12-02T01:02:03.456Z stage.completed")
    assert "publish" in line and "#1" in line and '{"ok": true}' in line


def test_runs_table_has_a_header_and_iso_times() -> None:
    rows = [
        {
            "run_id": "r-2",
            "definition": "model-ingest",
            "version": "2.3.0",
            "state": "failed",
            "created_at": AT,
            "finished_at": AT + 1000,
            "reason": "render-thumbnail: " + "x" * 200,
        }
    ]
    header, line = views.runs_lines(rows)
    assert header.split() == list(views.RUN_COLUMNS)
    assert line.split()[:6] == [
        "r-2",
        "model-ingest",
        "2.3.0",
        "failed",
        "2026-12-02T01:02:03.456Z",
        "2026-12-02T01:02:04.456Z",
    ]
    assert line.endswith("…") and len(line) < 200

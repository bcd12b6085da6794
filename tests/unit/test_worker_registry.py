"""The live worker registry's pure parts (keys, entries, the rows of ``saga contracts list --live``), the
text of ``contracts list --live`` and of a stage waiting for a contract version, the command's JSON shape,
and a worker's presence riding out a Redis it cannot reach."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pytest
from click.testing import CliRunner

from orchestrator import views
from orchestrator.cli import main
from orchestrator.contracts import Registry
from orchestrator.shardmap import ShardMap
from orchestrator.store import shardmap_store, worker_registry
from orchestrator.store.connect import async_client
from orchestrator.store.worker_registry import Presence, WorkerInfo, contract_rows, live_key, worker_key
from orchestrator.views import live_contract_lines

RENDER_PLAN: dict[str, Any] = {
    "name": "probe-render",
    "version": "3.0.0",
    "contracts": {"probe.render@3": {"kind": "worker", "queue": "probe-rendering"}},
    "stages": {
        "first": {"type": "worker", "worker": "probe.render@3", "queue": "probe-rendering"},
        "second": {
            "type": "worker",
            "worker": "probe.render@3",
            "queue": "probe-rendering",
            "execution_deadline_ms": 60_000,
        },
    },
}
DIGEST = "sha256:" + "d0" * 32


def info(pid: int, *refs: str, adapters: dict[str, str] | None = None) -> WorkerInfo:
    return WorkerInfo(
        id=f"host-a:{pid}:abc123",
        host="host-a",
        pid=pid,
        started_at_ms=1_796_173_323_456,
        serving=tuple(("probe-rendering", ref) for ref in refs),
        adapters=adapters or {},
    )


OLD = info(101, "probe.render@3")
NEW = info(202, "probe.render@3", "probe.render@4", adapters={"probe.render@3": "probe.render@4"})


def test_keys_share_one_hash_tag() -> None:
    assert live_key("saga") == "saga:{workers}:live"
    assert worker_key("saga", "h:1:ab") == "saga:{workers}:worker:h:1:ab"


def test_an_entry_round_trips_and_an_unknown_one_is_skipped() -> None:
    document = json.loads(json.dumps(NEW.to_document()))
    assert WorkerInfo.from_document(document) == NEW
    assert document["contracts"] == ["probe.render@3", "probe.render@4"]
    assert document["queues"] == ["probe-rendering"]
    assert WorkerInfo.from_document({"id": "x"}) is None
    assert WorkerInfo.from_document("garbage") is None


def test_contract_rows_join_the_registry_the_live_workers_and_the_pinned_runs() -> None:
    registry = Registry.from_modules(["tests.integration.probe_apps.render_v4"])
    rows = contract_rows(registry.contracts(), [OLD, NEW], {DIGEST: RENDER_PLAN}, {DIGEST: 5})
    by_ref = {row["ref"]: row for row in rows}
    assert [row["ref"] for row in rows] == ["probe.render@3", "probe.render@4"]
    old = by_ref["probe.render@3"]
    assert set(old) == {"ref", "kind", "queue", "registered", "workers", "pinned_runs", "startable", "plans"}
    assert (old["kind"], old["queue"], old["registered"], old["pinned_runs"]) == (
        "worker",
        "probe-rendering",
        True,
        5,
    )
    assert [(w["pid"], w["adapter_to"]) for w in old["workers"]] == [(101, None), (202, "probe.render@4")]
    assert old["workers"][0] == {
        "id": "host-a:101:abc123",
        "host": "host-a",
        "pid": 101,
        "started_at_ms": 1_796_173_323_456,
        "adapter_to": None,
        "queues": ["probe-rendering"],
    }
    pinned = {"digest": DIGEST, "definition": "probe-render", "version": "3.0.0", "runs": 5}
    assert old["plans"] == [{**pinned, "startable": False}] and not old["startable"]
    assert by_ref["probe.render@4"]["pinned_runs"] == 0 and by_ref["probe.render@4"]["plans"] == []


def test_a_version_no_run_pins_but_a_startable_definition_uses_is_not_free_to_drop() -> None:
    registry = Registry.from_modules(["tests.integration.probe_apps.render_v4"])
    rows = contract_rows(registry.contracts(), [NEW], {DIGEST: RENDER_PLAN}, {}, startable=[DIGEST])
    old = {row["ref"]: row for row in rows}["probe.render@3"]
    assert old["pinned_runs"] == 0 and old["startable"]
    assert old["plans"] == [
        {"digest": DIGEST, "definition": "probe-render", "version": "3.0.0", "runs": 0, "startable": True}
    ]
    (line,) = [line for line in live_contract_lines(rows) if "pinned by" in line]
    assert "0 unfinished runs; new runs may start on it" in line


def test_versions_only_runs_or_workers_know_are_listed_too() -> None:
    stray = info(303, "other.op@7")
    rows = contract_rows([], [stray], {DIGEST: RENDER_PLAN}, {DIGEST: 2})
    assert [(r["ref"], r["registered"], len(r["workers"]), r["pinned_runs"]) for r in rows] == [
        ("other.op@7", False, 1, 0),
        ("probe.render@3", False, 0, 2),
    ]
    assert rows[0]["kind"] is None and rows[1]["queue"] == "probe-rendering"


def test_versions_sort_by_number() -> None:
    rows = contract_rows([], [info(1, "a@12", "a@3", "a@1")], {}, {})
    assert [r["ref"] for r in rows] == ["a@1", "a@3", "a@12"]


def test_the_live_contracts_table() -> None:
    rows = contract_rows([], [NEW], {DIGEST: RENDER_PLAN}, {DIGEST: 5})
    rows += contract_rows([], [], {DIGEST: {**RENDER_PLAN, "contracts": {"gone.op@1": {}}}}, {DIGEST: 1})
    assert views.live_contract_lines(rows) == [
        "CONTRACT        KIND    QUEUE            RUNS  LIVE WORKERS",
        "probe.render@3  worker  probe-rendering  5     host-a:202 (adapter to probe.render@4)",
        f"    pinned by probe-render 3.0.0 ({DIGEST[:19]}…): 5 unfinished runs",
        "probe.render@4  ?       ?                0     host-a:202",
        "gone.op@1       ?       ?                1     none: its runs wait for a worker",
        f"    pinned by probe-render 3.0.0 ({DIGEST[:19]}…): 1 unfinished run",
    ]


# ---- a stage waiting for a contract version ----------------------------------------------------------


def dispatched(waiting: dict[str, Any] | None = None) -> dict[str, Any]:
    stage: dict[str, Any] = {"state": "dispatched", "attempt": 1, "type": "worker"}
    return {**stage, "waiting": waiting} if waiting else stage


def view_of(**stages: dict[str, Any]) -> dict[str, Any]:
    return {"run_id": "r-1", "stages": stages}


def queue(task_queue: str, ref: str) -> str:
    return f"saga.task.{task_queue}:{ref}"


def test_a_stage_waiting_for_a_version_nobody_serves_says_which() -> None:
    nobody = {
        "reason": "no-worker",
        "queue": queue("probe-rendering", "probe.render@3"),
        "contract": "probe.render@3",
        "message": "waiting for a worker of probe.render@3 (nobody consumes "
        "saga.task.probe-rendering:probe.render@3)",
    }
    found = views.with_live_workers(view_of(first=dispatched(nobody)), RENDER_PLAN, {}, queue)
    first = found["stages"]["first"]
    assert first["live_workers"] == []
    assert first["waiting"]["reason"] == "no-worker"
    assert first["waiting"]["message"] == nobody["message"] + "; no live worker serves it"
    assert "no live worker serves it" in views.stage_detail(first)

    # Without the broker's word, the registry alone says it
    alone = views.with_live_workers(view_of(first=dispatched()), RENDER_PLAN, {}, queue, broker_known=False)
    assert alone["stages"]["first"]["waiting"] == {
        "reason": "no-live-worker",
        "queue": "saga.task.probe-rendering:probe.render@3",
        "contract": "probe.render@3",
        "message": "waiting for a worker of probe.render@3 (no live worker serves it)",
    }


def test_a_stage_a_live_worker_serves_lists_it() -> None:
    serving = {"probe.render@3": [NEW.summary("probe.render@3")]}
    found = views.with_live_workers(
        view_of(first=dispatched(), second=dispatched()), RENDER_PLAN, serving, queue
    )
    first, second = found["stages"]["first"], found["stages"]["second"]
    assert [w["pid"] for w in first["live_workers"]] == [202]
    assert "waiting" not in first  # it reports no acceptance: it may be running already
    assert second["waiting"]["reason"] == "not-accepted"
    assert (
        second["waiting"]["message"]
        == "waiting for a worker of probe.render@3 to take it (1 live worker serves it)"
    )


def test_stages_not_dispatched_are_left_alone() -> None:
    running = {"state": "running", "attempt": 1, "type": "worker"}
    found = views.with_live_workers(view_of(first=running), RENDER_PLAN, {}, queue, broker_known=False)
    assert found["stages"]["first"] == running


# ---- the command's JSON shape ------------------------------------------------------------------------


def test_contracts_list_live_json_and_text(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: dict[str, Any] = {}

    async def shard_map(settings: Any, *, seed: bool) -> ShardMap:
        return ShardMap.seed(("fast",), 2)

    async def read_rows(client: Any, prefix: str, shards: Any, contracts: Any) -> list[dict[str, Any]]:
        asked.update(prefix=prefix, shards=list(shards), refs=[c.ref for c in contracts])
        return contract_rows(contracts, [NEW], {DIGEST: RENDER_PLAN}, {DIGEST: 5})

    monkeypatch.setattr(shardmap_store, "current_map", shard_map)
    monkeypatch.setattr(worker_registry, "read_contract_rows", read_rows)
    monkeypatch.setenv("SAGA_KEY_PREFIX", "sagaunit")
    runner = CliRunner()
    app = ["--contracts", "tests.integration.probe_apps.render_v4"]
    done = runner.invoke(main, ["contracts", "list", "--live", "--json", *app])
    assert done.exit_code == 0, done.output
    rows = json.loads(done.output)
    assert asked == {
        "prefix": "sagaunit",
        "shards": ["fast.0", "fast.1"],
        "refs": ["probe.render@3", "probe.render@4"],
    }
    assert [(r["ref"], r["pinned_runs"], [w["pid"] for w in r["workers"]]) for r in rows] == [
        ("probe.render@3", 5, [202]),
        ("probe.render@4", 0, [202]),
    ]
    text = runner.invoke(main, ["contracts", "list", "--live", *app])
    assert text.exit_code == 0, text.output
    assert text.output.splitlines()[0].split() == ["CONTRACT", "KIND", "QUEUE", "RUNS", "LIVE", "WORKERS"]
    assert "host-a:202 (adapter to probe.render@4)" in text.output


# ---- presence ----------------------------------------------------------------------------------------


def test_presence_rides_out_a_redis_it_cannot_reach(caplog: pytest.LogCaptureFixture) -> None:
    async def go() -> tuple[bool, bool]:
        client = async_client("redis://127.0.0.1:1/0", socket_connect_timeout=0.2, socket_timeout=0.2)
        presence = Presence(client, "sagaunit", NEW, lease_ms=600)
        try:
            first = await presence.renew()
            second = await presence.renew()
            presence.start()
            await asyncio.sleep(0.3)
            await presence.stop()  # neither renewing nor leaving raises
            return first, second
        finally:
            await client.aclose()

    with caplog.at_level(logging.WARNING, logger="orchestrator.store.worker_registry"):
        assert asyncio.run(go()) == (False, False)
    warnings = [r.getMessage() for r in caplog.records if "cannot register" in r.getMessage()]
    assert len(warnings) == 1  # said once per outage, not at every renewal
    assert "retrying every 0.2 s" in warnings[0]

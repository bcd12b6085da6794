"""Rolling worker upgrades (invariant 14): runs pinned to ``probe.render@3`` stay in flight while their
only worker is replaced by one serving ``@4`` plus an adapter for ``@3``, then by one serving only
``@4``, and a ``@3`` worker comes back later. No run fails for lack of a handler; while nobody serves
``@3`` its tasks wait, and ``saga status`` and ``saga contracts list --live`` say so.

The probe apps (``tests/integration/probe_apps/render_*.py``) record which process ran which contract
version's task, and whether natively or through the adapter.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator.client import Client
from orchestrator.contracts import Registry
from orchestrator.provision import provision
from orchestrator.settings import redis_client
from orchestrator.store import worker_registry
from orchestrator.store.connect import async_client
from tests.integration.probe_apps.render_models import renders_key
from tests.integration.stack import Stack, poll

pytestmark = pytest.mark.services

PROBES = Path(__file__).parent / "probe_apps"
APP_V3 = "tests.integration.probe_apps.render_v3"
APP_V4 = "tests.integration.probe_apps.render_v4"  # @4, and @3 through an adapter
APP_V4_ONLY = "tests.integration.probe_apps.render_v4_only"
OLD, NEW = "probe.render@3", "probe.render@4"
CONTRACTS = ("--contracts", APP_V3, "--contracts", APP_V4)
REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture
def stack() -> Iterator[Stack]:
    s = Stack("rolling")
    s.setup()
    registry = Registry.from_modules([APP_V3, APP_V4])
    asyncio.run(provision(s.settings, registry, [PROBES / "probe-render.yaml"]))
    try:
        yield s
    finally:
        s.teardown()


def start_runs(stack: Stack, prefix: str, count: int, hold_s: float) -> list[str]:
    async def go() -> list[str]:
        async with Client(stack.settings) as client:
            return [
                await client.start("probe-render", {"modelId": f"{prefix}-{n}", "hold_s": hold_s})
                for n in range(count)
            ]

    return asyncio.run(go())


def serving(stack: Stack) -> dict[str, set[int]]:
    """Contract ref -> pids of the live workers serving it, as the registry says."""

    async def read() -> list[worker_registry.WorkerInfo]:
        client = redis_client(stack.settings)
        try:
            return await worker_registry.live_workers(client, stack.prefix)
        finally:
            await client.aclose()

    index = worker_registry.serving_index(asyncio.run(read()))
    return {ref: {w.pid for w in found} for ref, found in index.items()}


def pid(stack: Stack, name: str) -> int:
    return stack.processes[name].pid


def live_rows(stack: Stack) -> dict[str, dict[str, Any]]:
    return {row["ref"]: row for row in stack.saga_json("contracts", "list", "--live", *CONTRACTS)}


def renders(stack: Stack, runs: list[str]) -> list[dict[str, Any]]:
    rows = [json.loads(raw) for raw in stack.redis.lrange(renders_key(stack.prefix), 0, -1)]
    return [r for r in rows if r["run_id"] in runs]


def all_at(stack: Stack, runs: list[str], stage: str, state: str) -> bool:
    return all(stack.record(r).get(f"s:{stage}:status") == state for r in runs)


def test_runs_pinned_to_an_old_version_survive_a_rolling_upgrade_of_their_workers(stack: Stack) -> None:
    # Given the orchestrator and the only worker, which serves probe.render@3
    stack.start_orchestrator()
    stack.start_worker("worker-v3", "--app", APP_V3)
    v3 = pid(stack, "worker-v3")
    poll(lambda: serving(stack).get(OLD) == {v3}, 30, what="the @3 worker to register")

    # And four runs pinned to @3 whose first render is running on it (long enough for the new worker to
    # start and register before they end)
    batch_a = start_runs(stack, "a", 4, hold_s=5.0)
    poll(lambda: all_at(stack, batch_a, "first", "running"), 30, what="batch A's first renders to run")

    # When a worker serving @4 plus an adapter for @3 joins, and then the old worker stops
    stack.start_worker("worker-v4a", "--app", APP_V4)
    v4a = pid(stack, "worker-v4a")
    poll(lambda: serving(stack) == {OLD: {v3, v4a}, NEW: {v4a}}, 30, what="the @4 worker to register")
    rows = live_rows(stack)
    assert rows[OLD]["pinned_runs"] == 4 and rows[NEW]["pinned_runs"] == 0
    adapters = {w["pid"]: w["adapter_to"] for w in rows[OLD]["workers"]}
    assert adapters == {v3: None, v4a: NEW}
    assert stack.stop("worker-v3") == 0  # it finishes the renders it runs, and leaves the registry

    # Then the runs' second renders (pinned to @3) run on the new worker, through the adapter
    for run_id in batch_a:
        assert stack.wait_finished(run_id, 30)["status"] == "completed"
    done_a = renders(stack, batch_a)
    assert sorted((r["stage"], r["handler"], r["contract"], r["pid"]) for r in done_a) == sorted(
        [("first", "v3", OLD, v3)] * 4 + [("second", "v4", OLD, v4a)] * 4
    )
    output = json.loads(stack.record(batch_a[0])["output"])
    assert output == {"first": "thumbs/a-0-64.png", "second": "thumbs/a-0-256x256.webp"}

    # When that worker is replaced in turn by one serving only @4, and more @3 runs start
    stack.start_worker("worker-v4", "--app", APP_V4_ONLY)
    v4 = pid(stack, "worker-v4")
    poll(lambda: serving(stack).get(NEW) == {v4a, v4}, 30, what="the @4-only worker to register")
    assert stack.stop("worker-v4a") == 0
    poll(lambda: serving(stack) == {NEW: {v4}}, 30, what="the adapter's worker to leave the registry")
    batch_b = start_runs(stack, "b", 3, hold_s=0.02)
    poll(lambda: all_at(stack, batch_b, "first", "dispatched"), 30, what="batch B's first renders sent")

    # Then they wait, and status says for which version, and that no live worker serves it
    status = stack.saga_json("status", batch_b[0])
    first = status["stages"]["first"]
    assert status["state"] == "running" and first["state"] == "dispatched"
    assert first["live_workers"] == []
    assert first["waiting"]["contract"] == OLD
    assert first["waiting"]["message"].startswith(f"waiting for a worker of {OLD} (")
    assert "no live worker serves it" in first["waiting"]["message"]
    text = stack.saga("status", batch_b[0])
    assert text.returncode == 0, text.stderr
    line = next(row for row in text.stdout.splitlines() if row.strip().startswith("first"))
    assert f"waiting for a worker of {OLD}" in line and "no live worker serves it" in line

    # And the live contract list shows the runs pinned to a version nobody serves
    rows = live_rows(stack)
    assert (rows[OLD]["workers"], rows[OLD]["pinned_runs"]) == ([], 3)
    assert [w["pid"] for w in rows[NEW]["workers"]] == [v4]
    assert rows[OLD]["plans"][0]["definition"] == "probe-render"
    listing = stack.saga("contracts", "list", "--live", *CONTRACTS)
    assert listing.returncode == 0, listing.stderr
    assert any(
        row.startswith(OLD) and "none: its runs wait for a worker" in row
        for row in listing.stdout.splitlines()
    )

    # When a @3 worker comes back
    stack.start_worker("worker-v3-again", "--app", APP_V3)
    v3_again = pid(stack, "worker-v3-again")

    # Then the waiting runs complete on it: no run failed for lack of a handler
    for run_id in batch_b:
        assert stack.wait_finished(run_id, 30)["status"] == "completed"
    assert {(r["handler"], r["pid"]) for r in renders(stack, batch_b)} == {("v3", v3_again)}
    assert all(stack.record(r)["status"] == "completed" for r in batch_a + batch_b)
    assert live_rows(stack)[OLD]["pinned_runs"] == 0
    for name in ("worker-v3", "worker-v4a", "worker-v4", "worker-v3-again"):
        assert "no handler" not in stack.log(name)


def test_a_worker_that_stops_renewing_leaves_the_registry_when_its_lease_ends() -> None:
    # Given two entries under a prefix of their own, one with a short lease
    prefix = f"sagatestworkers{uuid.uuid4().hex[:8]}"
    info = worker_registry.WorkerInfo.of_this_process([("tasks.parallel", OLD)])
    other = worker_registry.WorkerInfo.of_this_process([("tasks.parallel", NEW)])

    async def go() -> tuple[list[str], list[str], list[str], list[str]]:
        client = async_client(REDIS_URL, decode_responses=True)
        try:
            await worker_registry.register(client, prefix, info, lease_ms=300)
            await worker_registry.register(client, prefix, other, lease_ms=60_000)
            both = [w.id for w in await worker_registry.live_workers(client, prefix)]
            # When the first one renews no more, then the second one leaves cleanly
            await asyncio.sleep(0.4)
            left = [w.id for w in await worker_registry.live_workers(client, prefix)]
            await worker_registry.unregister(client, prefix, other.id)
            gone = [w.id for w in await worker_registry.live_workers(client, prefix)]
            members = await client.zrange(worker_registry.live_key(prefix), 0, -1)
            return both, left, gone, members
        finally:
            keys = [k async for k in client.scan_iter(match=f"{prefix}:*")]
            if keys:
                await client.delete(*keys)
            await client.aclose()

    both, left, gone, members = asyncio.run(go())
    # Then a reading lists both, then only the one whose lease runs, then none
    assert sorted(both) == sorted([info.id, other.id])
    assert left == [other.id]
    assert gone == []
    assert members == [info.id]  # the expired member stays in the set until someone's next renewal

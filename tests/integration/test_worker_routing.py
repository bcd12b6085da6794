"""Worker pools that share queues (invariant 14): a task reaches only a worker that serves its contract
version, a task nobody serves waits for one instead of failing, and ``tasks.serial`` runs one handler at a
time across every run, contract and worker process, also when a serial attempt times out or is cancelled
while its thread-pool handler keeps running.

Two probe apps (``tests/integration/probe_apps``) run beside the demo app on the shared queues; their
handlers record when they really ran, so overlaps are measured by the handlers themselves.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

from orchestrator.client import Client
from orchestrator.contracts import Registry
from orchestrator.provision import provision
from tests.faults import invariants
from tests.integration.probe_apps import intervals_key
from tests.integration.stack import Stack, poll, rabbitmqctl
from workers.serial_lane import lane_key

pytestmark = pytest.mark.services

PROBES = Path(__file__).parent / "probe_apps"
APP_A, APP_B = "tests.integration.probe_apps.a", "tests.integration.probe_apps.b"
RUNS = 40
TIMES_OUT = {n for n in range(RUNS) if n % 10 == 3}  # serial-a holds 2.6 s against a 2 s deadline
CANCELLED = {n for n in range(RUNS) if n % 10 == 7}  # cancelled while serial-a runs (1.5 s)


@pytest.fixture
def stack() -> Iterator[Stack]:
    s = Stack("routing")
    s.setup()
    registry = Registry.from_modules([APP_A, APP_B])
    asyncio.run(provision(s.settings, registry, [PROBES / "probe-chain.yaml"]))
    try:
        yield s
    finally:
        s.teardown()


def intervals(stack: Stack, kind: str) -> list[dict[str, Any]]:
    rows = [json.loads(raw) for raw in stack.redis.lrange(intervals_key(stack.prefix), 0, -1)]
    return sorted((r for r in rows if r["kind"] == kind), key=lambda r: r["start"])


def hold_s(n: int) -> float:
    return 2.6 if n in TIMES_OUT else 1.5 if n in CANCELLED else 0.03


async def start_all(stack: Stack) -> tuple[dict[int, str], list[str]]:
    async with Client(stack.settings) as client:
        probes = {n: await client.start("probe-chain", {"n": n, "hold_s": hold_s(n)}) for n in range(RUNS)}
        demos = [await client.start("model-ingest", {"modelId": f"m-{i}"}) for i in range(3)]
    return probes, demos


async def cancel(stack: Stack, run_id: str) -> None:
    async with Client(stack.settings) as client:
        await client.cancel(run_id, "test: cancel while the serial handler runs", "test")


def test_two_apps_share_the_queues_and_tasks_serial_is_serial(stack: Stack) -> None:
    # Given the demo app and two probe apps on the shared queues: one process serving both probe apps and
    # one serving only app A, each of concurrency 8, so serial tasks of both contracts can be taken at once
    stack.start_orchestrator()
    stack.start_worker("worker-demo")
    stack.start_worker("worker-ab", "--app", APP_A, "--app", APP_B, "--concurrency", "8")
    stack.start_worker("worker-a", "--app", APP_A, "--concurrency", "8")

    # When 40 probe runs and 3 model-ingest runs start together, and some serial stages are cancelled
    probes, demos = asyncio.run(start_all(stack))
    to_cancel = {probes[n] for n in CANCELLED}

    def cancel_the_running() -> bool:
        for run_id in [r for r in to_cancel if stack.record(r).get("s:serial-a:status") == "running"]:
            asyncio.run(cancel(stack, run_id))
            to_cancel.discard(run_id)
        return not to_cancel

    poll(cancel_the_running, 90, what="every run to cancel to reach its serial stage")
    every = [*probes.values(), *demos]
    left = invariants.wait_for_convergence(stack.redis, stack.prefix, every, 120)
    assert not left, left

    # Then every run ended as its script says: none failed for want of a handler
    for n, run_id in probes.items():
        record = stack.record(run_id)
        if n in TIMES_OUT:
            assert (record["status"], record["s:serial-a:status"]) == ("failed", "timed-out"), record
        elif n in CANCELLED:
            assert record["status"] == "failed" and record["reason"].startswith("cancelled"), record
        else:
            assert record["status"] == "completed", (n, record)
    assert all(stack.record(r)["status"] == "completed" for r in demos)
    for name in ("worker-demo", "worker-ab", "worker-a"):
        assert "no handler" not in stack.log(name)

    # And no two serial handlers ever overlapped, the timed-out and cancelled ones included (their threads
    # ran on past their attempt's end, holding the serial lane until they returned)
    # (a timed-out attempt's handler runs on after its run has failed and records its interval when it
    # returns: wait for every handler to have returned, not only for every run to have ended)
    expected = RUNS + (RUNS - len(TIMES_OUT) - len(CANCELLED))

    def every_serial_interval() -> list[dict[str, Any]] | None:
        rows = intervals(stack, "serial")
        return rows if len(rows) >= expected else None

    serial = poll(every_serial_interval, 30, what=f"{expected} serial handlers to return")
    assert {r["contract"] for r in serial} == {"probe.serial-a@1", "probe.serial-b@1"}
    assert len({r["pid"] for r in serial}) == 2  # both processes took serial tasks
    overlaps = [(a, b) for a, b in pairwise(serial) if b["start"] < a["end"]]
    assert not overlaps, overlaps[:3]
    lingering = [r for r in serial if r["end"] - r["start"] > 1.4]
    assert len(lingering) == len(TIMES_OUT) + len(CANCELLED)

    # While parallel stages did run side by side
    parallel = intervals(stack, "parallel")
    assert len(parallel) == 2 * RUNS
    assert any(b["start"] < a["end"] for a, b in pairwise(parallel))

    # And the fault suite's shared invariants hold for every run
    violations = invariants.check_runs(stack.redis, stack.prefix, every, expect_state=None, effects=False)
    invariants.assert_no_violations(violations, "runs sharing queues between worker apps")


def test_a_task_nobody_serves_waits_for_a_worker_of_its_version(stack: Stack) -> None:
    # Given only the demo app's workers
    stack.start_orchestrator()
    stack.start_worker("worker-demo")

    # When a probe run starts, its first tasks wait: nothing fails for lack of a handler
    async def start() -> str:
        async with Client(stack.settings) as client:
            return await client.start("probe-chain", {"n": 1, "hold_s": 0.01})

    run_id = asyncio.run(start())
    poll(lambda: stack.record(run_id).get("s:wide-a:status") == "dispatched", 30, what="wide-a dispatched")
    waiting = stack.settings.names().task_queue("tasks.parallel", "probe.parallel-a@1")
    poll(lambda: stack.queue_depths().get(waiting) == 1, 30, what=f"the task to wait on {waiting}")
    assert stack.record(run_id)["status"] == "running"

    # Then a worker of that version arrives and the run completes
    stack.start_worker("worker-ab", "--app", APP_A, "--app", APP_B)
    assert stack.wait_finished(run_id, 60)["status"] == "completed"


def test_a_worker_on_a_broker_without_the_topology_says_so_in_one_line() -> None:
    # Given a vhost where `saga topology apply` never ran
    bare = Stack("bare")
    rabbitmqctl("add_vhost", bare.vhost)
    rabbitmqctl("set_permissions", "-p", bare.vhost, "guest", ".*", ".*", ".*")
    try:
        # When a worker starts there
        done = bare.saga("worker", "--app", APP_A, timeout_s=60)
    finally:
        bare.teardown()
    # Then it exits 2 with one line naming what is missing and the fix, no traceback
    errors = [line for line in done.stderr.splitlines() if line.lower().startswith("error:")]
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert len(errors) == 1 and "saga.tasks" in errors[0] and "saga topology apply" in errors[0], done.stderr


def test_environments_on_one_broker_and_one_redis_never_meet(stack: Stack) -> None:
    # Given a second environment, namespace "other", on the same vhost and the same Redis
    other = {"SAGA_NAMESPACE": "other", "SAGA_KEY_PREFIX": f"{stack.prefix}other"}
    applied = stack.saga("topology", "apply", extra_env=other)
    assert applied.returncode == 0, applied.stderr
    stack.start_orchestrator("orchestrator-other", extra_env=other)
    stack.start_worker("worker-other", extra_env=other)

    # When a run starts in the first environment, where nothing runs yet
    async def start() -> str:
        async with Client(stack.settings) as client:
            return await client.start("model-ingest", {"modelId": "m-apart"})

    run_id = asyncio.run(start())
    shard_queues = [stack.settings.names().shard_queue(s) for s in ("fast.0", "fast.1")]
    poll(lambda: sum(stack.queue_depths().get(q, 0) for q in shard_queues) == 1, 20, what="the start")

    # Then the other environment's orchestrator leaves it alone: no run under either prefix
    other_keys = stack.redis.keys(f"{other['SAGA_KEY_PREFIX']}:*")
    assert not stack.record(run_id) and not any(run_id in key for key in other_keys)
    assert stack.queue_depths().get("other.shard.fast.0") == 0

    # And once its own orchestrator and worker run, the run completes in its own environment
    stack.start_orchestrator()
    stack.start_worker()
    assert stack.wait_finished(run_id, 60)["status"] == "completed"
    for key in stack.redis.scan_iter(match=f"{other['SAGA_KEY_PREFIX']}:*"):
        stack.redis.delete(key)


def test_a_worker_waiting_for_the_serial_lane_stops_at_once_and_gives_the_task_back(stack: Stack) -> None:
    # Given the serial lane held by someone else (another worker's long handler)
    lane = lane_key(stack.prefix)
    stack.redis.set(lane, json.dumps({"worker": "elsewhere:1", "run_id": "other"}), px=120_000)
    stack.start_orchestrator()
    stack.start_worker("worker-ab", "--app", APP_A, "--app", APP_B)

    async def start() -> str:
        async with Client(stack.settings) as client:
            return await client.start("probe-chain", {"n": 1, "hold_s": 0.01})

    run_id = asyncio.run(start())
    serial_queue = stack.settings.names().task_queue("tasks.serial", "probe.serial-a@1")
    poll(lambda: stack.record(run_id).get("s:serial-a:status") == "dispatched", 30, what="serial-a sent")
    poll(lambda: stack.list_queues("messages_unacknowledged").get(serial_queue) == 1, 30, what="it waits")

    # When the worker is asked to stop while its serial task waits for the lane
    began = time.monotonic()
    assert stack.stop("worker-ab") == 0
    # Then it stops at once (not when the lane frees) and the task is back on its queue, not run
    assert time.monotonic() - began < 10
    poll(lambda: stack.queue_depths().get(serial_queue) == 1, 30, what="the task back on its queue")
    assert intervals(stack, "serial") == []

    # And once the lane is free, another worker runs it and the run completes
    stack.redis.delete(lane)
    stack.start_worker("worker-a", "--app", APP_A, "--app", APP_B)
    assert stack.wait_finished(run_id, 60)["status"] == "completed"

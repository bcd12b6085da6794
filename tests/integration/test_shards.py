"""``saga shards`` on a live system: shards added, drained and retired while runs go on, an orchestrator
that follows the map, and nothing lost (the fault suite's shared invariants)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest

from orchestrator.bus.envelope import Envelope
from orchestrator.client import Client
from orchestrator.wire.kinds import Kind
from tests.faults import invariants
from tests.integration.stack import Stack, poll

pytestmark = pytest.mark.services


@pytest.fixture
def stack() -> Iterator[Stack]:
    s = Stack("shards", shard_count=2)
    s.setup()
    try:
        yield s
    finally:
        s.teardown()


def shards(stack: Stack, *args: str) -> Any:
    return stack.saga_json("shards", *args)


def by_shard(stack: Stack) -> dict[str, dict[str, Any]]:
    return {s["shard"]: s for s in shards(stack, "list")["shards"]}


async def start(stack: Stack, definition: str, contexts: list[dict[str, Any]]) -> list[str]:
    async with Client(stack.settings) as client:
        return [await client.start(definition, context) for context in contexts]


def test_shards_added_drained_and_retired_under_runs(stack: Stack) -> None:
    # Given the first map (two shards per class) and an orchestrator that follows it
    stack.start_orchestrator()
    stack.start_worker()
    listed = shards(stack, "list")
    assert listed["version"] == 1
    assert [(s["shard"], s["state"]) for s in listed["shards"]] == [
        ("fast.0", "active"),
        ("fast.1", "active"),
        ("slow.0", "active"),
        ("slow.1", "active"),
    ]

    # When two fast shards are added
    assert shards(stack, "add", "--class", "fast", "--count", "2") == {"added": ["fast.2", "fast.3"]}
    # Then the orchestrator serves them without a restart, and new starts land on them
    poll(lambda: all(by_shard(stack)[s]["consumers"] == 1 for s in ("fast.2", "fast.3")), 30, what="served")
    first = asyncio.run(start(stack, "model-ingest", [{"modelId": f"grow-{i}"} for i in range(40)]))
    # the triage refuses them; 40 over 4 shards leave fast.0 none with odds of 1 in 100,000
    too_big = [{"sizeMb": 9000 + i, "format": "glb"} for i in range(40)]
    failing = asyncio.run(start(stack, "ingest-triage", too_big))
    # a run's shard is known once that shard has created it (the run-id index), not when it is started
    poll(lambda: all(stack.shard_of(run_id) for run_id in first + failing), 30, what="every run created")
    placed = {run_id: stack.shard_of(run_id) for run_id in first + failing}
    assert {"fast.2", "fast.3"} & set(placed.values())

    # When fast.0 drains: starts made after it no longer land on it, its runs still finish
    assert shards(stack, "drain", "fast.0") == {"shard": "fast.0", "state": "draining"}
    later = asyncio.run(start(stack, "model-ingest", [{"modelId": f"later-{i}"} for i in range(30)]))
    assert "fast.0" not in {stack.shard_of(run_id) for run_id in later}
    every = first + failing + later
    left = invariants.wait_for_convergence(stack.redis, stack.prefix, every, 90)
    assert not left, left

    # Then retire is refused for an active shard, and done for the drained one, which holds nothing now
    refused = stack.saga("shards", "retire", "fast.1", "--json")
    assert refused.returncode == 1 and json.loads(refused.stdout)["error"]["code"] == "retire_refused"
    assert "drain it first" in json.loads(refused.stdout)["error"]["message"]
    assert shards(stack, "retire", "fast.0") == {"shard": "fast.0", "state": "retired"}
    after = by_shard(stack)
    assert after["fast.0"]["state"] == "retired" and after["fast.0"]["queued"] is None  # its queue is gone
    assert stack.queue_depths().get("saga.shard.fast.0") is None

    # And its finished runs stay readable; a request for one of them is refused with the reason
    on_retired = [run_id for run_id in every if placed.get(run_id) == "fast.0"]
    assert on_retired, "no run landed on fast.0 before it drained"
    status = stack.saga_json("status", on_retired[0])
    assert status["state"] in ("completed", "failed")
    [failed_there, *_] = [r for r in on_retired if r in failing]
    again = stack.saga("redrive", failed_there, "--json")
    assert again.returncode == 1 and "retired" in again.stdout, again.stdout
    listed_runs = {r["run_id"] for r in stack.saga_json("runs", "--limit", "500")["runs"]}
    assert set(on_retired) <= listed_runs

    # And a straggler, a task sent before the retire whose result comes after it, is not published into
    # the deleted queue: the worker parks the result on the rejected queue, saying why
    straggler = Envelope(
        kind=Kind.TASK,
        message_id=f"task-straggler-{on_retired[0]}",
        run_id=on_retired[0],
        shard="fast.0",
        stage="render-thumbnail",
        attempt=9,
        fence="9.9",
        contract="thumbnail.render@3",
        body={"input": {"modelId": "late-1"}},
    )
    queue = stack.settings.names().task_queue("tasks.parallel", "thumbnail.render@3")
    stack.publish_envelope(straggler, stack.settings.names().tasks_exchange, queue)
    rejected = stack.settings.names().rejected_queue

    def parked() -> list[dict[str, Any]]:
        queues = stack.saga_json("dead-letters", "list", "--queue", rejected)["queues"]
        return [m for q in queues for m in q["messages"] if m["run_id"] == on_retired[0]]

    [entry] = poll(parked, 30, what="the straggler's result on the rejected queue")
    assert entry["kind"] == "result" and entry["reason"] == "unroutable", entry
    assert stack.saga_json("status", on_retired[0])["state"] == status["state"]  # nothing changed it

    # And new runs still complete on the shards left, with every invariant holding for all of them
    last = asyncio.run(start(stack, "model-ingest", [{"modelId": f"last-{i}"} for i in range(10)]))
    assert not invariants.wait_for_convergence(stack.redis, stack.prefix, last, 60)
    expected = {r: ("failed" if r in failing else "completed") for r in every + last}
    for state in ("completed", "failed"):
        runs = [r for r, s in expected.items() if s == state]
        violations = invariants.check_runs(stack.redis, stack.prefix, runs, expect_state=state, effects=False)
        invariants.assert_no_violations(violations, f"{state} runs across a shard map change")
    assert shards(stack, "list")["version"] == 4  # seed, add, drain, retire


def test_a_change_on_a_stale_reading_and_bad_requests_are_refused(stack: Stack) -> None:
    unknown = stack.saga("shards", "drain", "fast.9", "--json")
    assert unknown.returncode == 1 and json.loads(unknown.stdout)["error"]["code"] == "shard_refused"
    no_class = stack.saga("shards", "add", "--class", "medium", "--count", "1")
    assert no_class.returncode == 1 and "not in the shard map" in no_class.stderr
    assert shards(stack, "drain", "slow.0")["state"] == "draining"
    last = stack.saga("shards", "drain", "slow.1")
    assert last.returncode == 1 and "last active shard of class slow" in last.stderr
    zero = stack.saga("shards", "add", "--class", "fast", "--count", "0")
    assert zero.returncode == 2


def test_a_namespace_without_a_map_is_not_seeded_by_a_change() -> None:
    # Given a namespace whose topology was never applied (its processes may run other settings)
    bare = Stack("no-map")
    try:
        # When a shard command would change its map
        done = bare.saga("shards", "drain", "fast.1", "--json")
        # Then it is refused, and no map was stored from this shell's settings
        assert done.returncode == 1 and json.loads(done.stdout)["error"]["code"] == "shard_map_missing"
        assert bare.redis.get(f"{bare.prefix}:{{shardmap}}:map") is None
    finally:
        bare.redis.close()

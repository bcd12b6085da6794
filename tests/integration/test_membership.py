"""Orchestrator processes that follow the shard map divide the shards among themselves: evenly over 1, 2
and 3 processes, a killed one's shards served again, a shard added to the map served, nothing lost."""

from __future__ import annotations

import asyncio
import signal
from collections import Counter
from collections.abc import Iterator

import pytest

from orchestrator.client import Client
from tests.faults import invariants
from tests.faults.lifecycle import active_consumers, named_amqp_url
from tests.integration.stack import Stack, poll

pytestmark = pytest.mark.services


@pytest.fixture
def stack() -> Iterator[Stack]:
    s = Stack("members", shard_count=3)  # fast.0-2, slow.0-2
    s.setup()
    try:
        yield s
    finally:
        s.teardown()


def start(stack: Stack, name: str) -> None:
    stack.start_orchestrator(name, extra_env={"SAGA_AMQP_URL": named_amqp_url(stack, name)})


def spread(stack: Stack, names: list[str], shards: int) -> dict[str, int]:
    """Wait until every shard queue has an active consumer and each of ``names`` serves within one of an
    even share of each class; return the counts."""

    def even() -> dict[str, int] | None:
        active = active_consumers(stack)
        if len(active) != shards or any(owner is None for owner in active.values()):
            return None
        counts = Counter(active.values())
        for shard_class in ("fast", "slow"):
            per = Counter(o for q, o in active.items() if f".shard.{shard_class}." in q)
            share = [per.get(n, 0) for n in names]
            if max(share) - min(share) > 1 or sum(share) != shards // 2:
                return None
        return {n: counts.get(n, 0) for n in names}

    found: dict[str, int] = poll(even, 90, interval_s=0.5, what=f"the shards spread over {names}")
    return found


async def start_runs(stack: Stack, prefix: str, n: int) -> list[str]:
    async with Client(stack.settings) as client:
        return [await client.start("model-ingest", {"modelId": f"{prefix}-{i}"}) for i in range(n)]


def test_processes_divide_the_shards_and_take_over_a_killed_ones_share(stack: Stack) -> None:
    stack.start_worker()
    # One process serves all six shards; three divide them two each
    start(stack, "a")
    assert spread(stack, ["a"], 6) == {"a": 6}
    runs = asyncio.run(start_runs(stack, "one", 20))
    start(stack, "b")
    start(stack, "c")
    assert spread(stack, ["a", "b", "c"], 6) == {"a": 2, "b": 2, "c": 2}
    listed = stack.saga_json("shards", "list")["shards"]
    owners = Counter(s["serving"] for s in listed)  # the member process ids whose share each shard is
    assert None not in owners and sorted(owners.values()) == [2, 2, 2], listed
    runs += asyncio.run(start_runs(stack, "three", 20))

    # When one of them is killed, the two left take its shards (its lease ends) and serve all six
    stack.stop("b", signal.SIGKILL)
    assert spread(stack, ["a", "c"], 6) == {"a": 3, "c": 3}
    runs += asyncio.run(start_runs(stack, "two", 20))

    # And a shard added to the map is served by one of them without a restart
    assert stack.saga_json("shards", "add", "--class", "fast", "--count", "1") == {"added": ["fast.3"]}
    poll(lambda: active_consumers(stack).get("saga.shard.fast.3") in ("a", "c"), 30, what="fast.3 served")

    # Nothing was lost or doubled
    assert not invariants.wait_for_convergence(stack.redis, stack.prefix, runs, 90)
    violations = invariants.check_runs(stack.redis, stack.prefix, runs, effects=False)
    invariants.assert_no_violations(violations, "runs while orchestrators joined, died and shards were added")


def test_a_paused_process_s_shards_are_taken_over_and_its_late_work_changes_nothing(stack: Stack) -> None:
    stack.start_worker()
    start(stack, "a")
    start(stack, "b")
    spread(stack, ["a", "b"], 6)
    runs = asyncio.run(start_runs(stack, "pause", 30))
    # When b stops answering (SIGSTOP) with work in hand, a takes every shard once b's lease ends and the
    # broker drops b's connection
    stack.processes["b"].send_signal(signal.SIGSTOP)
    try:
        assert spread(stack, ["a"], 6) == {"a": 6}
        runs += asyncio.run(start_runs(stack, "after", 20))
    finally:
        stack.processes["b"].send_signal(signal.SIGCONT)
    # b wakes up: whatever it still does is a valid transition or a recorded duplicate
    assert not invariants.wait_for_convergence(stack.redis, stack.prefix, runs, 90)
    violations = invariants.check_runs(stack.redis, stack.prefix, runs, effects=False)
    invariants.assert_no_violations(violations, "runs across a paused orchestrator")

"""A bag's (map's) bookkeeping on the real Redis: a bitmap of arrived items and a list of their results,
whose cost per item does not grow with the bag; and a bag opened in the hash form of earlier versions
finishing in it, each item still counted once.

Uses the store test's helpers: a key prefix of its own per test, deleted afterwards.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pytest

from orchestrator.compiler import CompiledPlan
from orchestrator.engine import advance
from orchestrator.engine.model import BagRefill, BarrierReleased, Expect, RunSnapshot
from orchestrator.engine.plan import Plan
from orchestrator.store.keys import ShardKeys
from orchestrator.store.redis_store import RedisStore, _grouped, function_name
from orchestrator.store.replies import APPLIED, CONFLICT, DUPLICATE
from orchestrator.store.spec import build_spec
from orchestrator.wire.sizes import DEFAULT_BAG_WINDOW
from tests.integration.test_store import NOW, SHARD, redis_apply, started, task_result, with_store

pytestmark = pytest.mark.services

BOOKKEEPING_LIMIT = 64  # bytes of Redis per bag item while the run is live, results not counted


@dataclass(frozen=True)
class Bag:
    plan: CompiledPlan
    keys: ShardKeys
    tasks: list[dict[str, Any]]  # its item tasks sent so far, in item order
    read: RunSnapshot  # the run as its items find it (arrivals commute: one read serves them all)


async def open_bag(store: RedisStore, run_id: str, width: int) -> Bag:
    """A thumbnail-batch run of ``width`` items started, its tasks (its first chunk, if it is wider than
    a window) taken from the outbox and marked sent (as the shard does once the broker confirmed them)."""
    plan = await started(store, "thumbnail-batch", {"modelIds": [f"m-{i}" for i in range(width)]}, run_id)
    outbox = await store.outbox(SHARD)
    tasks = sorted(outbox.values(), key=lambda t: t["body"]["item"])
    await store.mark_sent(SHARD, list(outbox))
    read = await store.snapshot(SHARD, run_id)
    assert read is not None and len(tasks) == min(width, DEFAULT_BAG_WINDOW)  # its first chunk
    return Bag(plan, store.keys(SHARD), tasks, read)


async def refilled(
    store: RedisStore, plan: CompiledPlan, run_id: str, tasks: list[dict[str, Any]], refills: list[Any]
) -> tuple[list[dict[str, Any]], RunSnapshot]:
    """A bag's refill applied as the shard applies it (in-process, from a fresh read): its tasks taken
    from the outbox and marked sent; the tasks so far with them, and the run as it is now."""
    (message,) = refills
    body = message.body
    event = BagRefill(message.message_id, body["stage"], body["fence"], body["sent"])
    code, _, _ = await redis_apply(store, plan.plan, plan.digest, run_id, event, NOW)
    assert code == APPLIED
    outbox = await store.outbox(SHARD)
    more = sorted((t for t in outbox.values() if t["kind"] == "task"), key=lambda t: t["body"]["item"])
    assert [t["body"]["item"] for t in more] == list(range(len(tasks), len(tasks) + len(more)))
    await store.mark_sent(SHARD, list(outbox))
    read = await store.snapshot(SHARD, run_id)
    assert read is not None
    return tasks + more, read


async def memory_usage(store: RedisStore, key: str) -> int:
    used = await store.client.memory_usage(key, samples=0)
    return int(used or 0)


@pytest.mark.parametrize("width", [1_000, 10_000])
def test_a_live_bag_keeps_at_most_64_bytes_of_bookkeeping_per_item(width: int) -> None:
    async def test(store: RedisStore) -> None:
        # Given a started bag of `width` items
        run_id = f"run-bag-{width}"
        bag = await open_bag(store, run_id, width)
        plan, keys, tasks, read = bag.plan, bag.keys, bag.tasks, bag.read
        run_before = await memory_usage(store, keys.run(run_id))
        applied_before = await store.client.scard(keys.applied(run_id))  # type: ignore[misc]

        # When every item but the last arrives (the run is still live, the bag not released); a bag
        # wider than its window is sent in chunks, each refill applied as the shard applies it
        payload = 0
        for index in range(width - 1):
            event = task_result(tasks[index])
            decision = advance(plan.typed, plan.digest, read, event, NOW)
            assert decision.arrival is not None and decision.arrival.result is not None
            payload += len(decision.arrival.result.encode())
            result = await store.apply(SHARD, run_id, event.message_id, decision, plan.typed, NOW)
            assert result.code == APPLIED
            refills = decision.arrival.continuations(int(result.detail))
            if refills:
                tasks, read = await refilled(store, plan, run_id, tasks, refills)
        assert len(tasks) == width

        # Then the bag's keys cost at most 64 bytes per arrived item beside the results themselves
        bag_keys = (keys.bag_arrived(run_id, "render-all"), keys.bag_results(run_id, "render-all"))
        bag = sum([await memory_usage(store, key) for key in bag_keys])
        arrived = width - 1
        per_item = (bag - payload) / arrived
        assert per_item <= BOOKKEEPING_LIMIT, (bag, payload, per_item)
        # and nothing per item went anywhere else: no hash of members, the run hash as it was (its
        # counter and revision change in place), no applied ids, no history entries; a chunked bag
        # adds one applied id and one history entry per chunk (its refill)
        chunks = -(-width // DEFAULT_BAG_WINDOW)
        assert not await store.client.exists(keys.barrier(run_id, "render-all"))
        assert await memory_usage(store, keys.run(run_id)) - run_before < BOOKKEEPING_LIMIT
        applied = await store.client.scard(keys.applied(run_id))  # type: ignore[misc]
        assert applied == applied_before + chunks - 1
        kinds = [e["kind"] for e in await store.history(SHARD, run_id)]
        assert kinds.count("items.dispatched") == chunks - 1
        assert "callback.rejected" not in kinds and len(kinds) < 10 + chunks, kinds
        print(f"W={width}: {bag} B of bag keys, {payload} B of results, {per_item:.1f} B/item bookkeeping")
        # and a nudge reads from the bitmap which items arrived
        arrived_items = frozenset(str(i) for i in range(width - 1))
        assert await store.arrivals(SHARD, run_id, ("render-all",)) == {"render-all": arrived_items}

        # And the last item releases the bag once, with every result in item order
        last = task_result(tasks[-1])
        done = await store.apply(
            SHARD, run_id, last.message_id, advance(plan.typed, plan.digest, read, last, NOW), plan.typed, NOW
        )
        assert (done.code, done.detail) == (APPLIED, "0")
        released = await store.snapshot(SHARD, run_id, "render-all")
        assert released is not None
        assert released.map_results["render-all"] == [task_result(t).result for t in tasks]

    with_store(test)


async def arrive_in_hash(
    store: RedisStore, plan: Plan, run_id: str, task: Mapping[str, Any], read: Any
) -> int:
    """An arrival as a process of the previous version applied it: its spec names no bag keys, so the
    item goes into the barrier's hash."""
    event = task_result(task)
    decision = advance(plan, read.digest, read, event, NOW)
    barriers = list(plan.barriers)
    spec = build_spec(
        decision, run_id=run_id, message_id=event.message_id, now_ms=NOW, barriers=barriers, retention_ms=0
    )
    keys = store.keys(SHARD).transition_keys(run_id, barriers)
    reply = await store.client.fcall(function_name(spec.function), len(keys), *keys, spec.encode())  # type: ignore[misc]
    return int(reply[0])


async def arrive_now(
    store: RedisStore, plan: CompiledPlan, run_id: str, read: Any, task: Mapping[str, Any]
) -> tuple[int, str]:
    """The report of ``task`` decided from ``read`` (arrivals commute) and applied by this version."""
    event = task_result(task)
    decision = advance(plan.typed, plan.digest, read, event, NOW)
    result = await store.apply(SHARD, run_id, event.message_id, decision, plan.typed, NOW)
    return result.code, result.detail


def test_a_bag_opened_in_its_hash_finishes_there_each_item_counted_once() -> None:
    async def test(store: RedisStore) -> None:
        # Given a bag of 6 whose first 3 items arrived in the barrier's hash (the earlier form)
        run_id = "run-bag-hash"
        bag = await open_bag(store, run_id, 6)
        plan, keys, tasks, read = bag.plan, bag.keys, bag.tasks, bag.read
        for task in tasks[:3]:
            assert await arrive_in_hash(store, plan.typed, run_id, task, read) == APPLIED
        assert await store.client.hlen(keys.barrier(run_id, "render-all")) == 3
        assert await store.arrivals(SHARD, run_id, ("render-all",)) == {"render-all": frozenset("012")}

        # When this version's arrivals come: a duplicate of an item already in the hash, then the rest
        arrive = functools.partial(arrive_now, store, plan, run_id, read)
        assert (await arrive(tasks[1]))[0] == DUPLICATE
        outcomes = [await arrive(task) for task in tasks[3:]]

        # Then they join the hash (the bag finishes in the form it began), each counted once
        assert outcomes == [(APPLIED, "2"), (APPLIED, "1"), (APPLIED, "0")]
        assert await store.client.hlen(keys.barrier(run_id, "render-all")) == 6
        assert not await store.client.exists(keys.bag_arrived(run_id, "render-all"))
        assert not await store.client.exists(keys.bag_results(run_id, "render-all"))
        # and the release reads every result in item order, exactly once
        outbox = [json.loads(v) for v in (await store.client.hgetall(keys.outbox())).values()]
        assert [m["kind"] for m in outbox] == ["barrier.released"]
        code, _, _ = await redis_apply(store, plan.plan, plan.digest, run_id, release(outbox[0]), NOW)
        assert code == APPLIED
        final = await store.snapshot(SHARD, run_id)
        assert final is not None and final.stages["render-all"].result == [
            task_result(t).result for t in tasks
        ]

    with_store(test)


def test_a_bag_in_both_forms_counts_each_item_once_and_releases_every_result() -> None:
    """A process of the previous version arriving at a bag this version opened (both running for a
    moment) creates its hash beside the bitmap: an item in either form is a duplicate in the other."""

    async def test(store: RedisStore) -> None:
        # Given a bag of 6 whose items 0-2 arrived in the bitmap, then item 3 in a new hash
        run_id = "run-bag-both"
        bag = await open_bag(store, run_id, 6)
        plan, keys, tasks, read = bag.plan, bag.keys, bag.tasks, bag.read

        arrive = functools.partial(arrive_now, store, plan, run_id, read)

        assert [await arrive(t) for t in tasks[:3]] == [(APPLIED, "5"), (APPLIED, "4"), (APPLIED, "3")]
        assert await arrive_in_hash(store, plan.typed, run_id, tasks[3], read) == APPLIED

        # When items of either form come again, and the rest arrive
        assert (await arrive(tasks[1]))[0] == DUPLICATE
        assert (await arrive(tasks[3]))[0] == DUPLICATE
        assert [await arrive(t) for t in tasks[4:]] == [(APPLIED, "1"), (APPLIED, "0")]

        # Then the arrivals read both forms, and the release every result in item order
        assert await store.arrivals(SHARD, run_id, ("render-all",)) == {"render-all": frozenset("012345")}
        assert await store.client.hget(keys.run(run_id), "b:render-all") == "0"
        released = await store.snapshot(SHARD, run_id, "render-all")
        assert released is not None
        assert released.map_results["render-all"] == [task_result(t).result for t in tasks]

    with_store(test)


def release(message: Mapping[str, Any]) -> BarrierReleased:
    """The release an arrival put in the outbox, as the shard receives it."""
    body = message["body"]
    return BarrierReleased(message["id"], body["stage"], body["fence"])


def test_a_rounds_arrivals_in_one_call_are_each_checked_and_applied_as_alone() -> None:
    """The shard applies a round's item results of one bag in one FCALL (saga_arrive_many): each
    arrival keeps its own checks and reply, as if it had been its own call, in order."""

    async def test(store: RedisStore) -> None:
        # Given a bag of 6 whose item 0 arrived already
        run_id = "run-bag-many"
        bag = await open_bag(store, run_id, 6)
        plan, tasks, read = bag.plan, bag.tasks, bag.read
        assert (await arrive_now(store, plan, run_id, read, tasks[0]))[0] == APPLIED

        def decided(task: Mapping[str, Any], **changes: Any) -> tuple[str, str, Any, Plan]:
            event = task_result(task)
            decision = advance(plan.typed, plan.digest, read, event, NOW)
            return run_id, event.message_id, dataclasses.replace(decision, **changes), plan.typed

        # When one round brings items 1 and 2, item 0 again, item 3 decided from a fence that is no
        # longer the bag's, item 2 again, then items 4 and 5
        stale = decided(tasks[3])
        wrong_fence = tuple(
            Expect(e.key, e.field, "9.9") if e.field == "fence" else e for e in stale[2].expects
        )
        round_ = [
            decided(tasks[1]),
            decided(tasks[2]),
            decided(tasks[0]),
            decided(tasks[3], expects=wrong_fence),
            decided(tasks[2]),
            decided(tasks[4]),
            decided(tasks[5]),
        ]
        calls = [store._call(SHARD, *transition, NOW) for transition in round_]
        assert [spec.function for spec, _ in _grouped(calls)] == ["saga_arrive_many"]  # one FCALL
        results = await store.apply_many(SHARD, round_, NOW)

        # Then each has its own reply: arrivals count down, duplicates and the conflict change nothing
        replies = [(r.code, r.detail) for r in results]
        assert replies == [
            (APPLIED, "4"),
            (APPLIED, "3"),
            (DUPLICATE, round_[2][1]),  # a duplicate's reply names the message
            (CONFLICT, "s:render-all:fence"),
            (DUPLICATE, round_[4][1]),
            (APPLIED, "2"),
            (APPLIED, "1"),
        ], replies
        assert [r.rev is not None for r in results] == [True, True, False, False, False, True, True]
        # and item 3, decided again from the bag as it is, arrives last and releases it
        code, detail = await arrive_now(store, plan, run_id, read, tasks[3])
        assert (code, detail) == (APPLIED, "0")
        outbox = [json.loads(v) for v in (await store.client.hgetall(bag.keys.outbox())).values()]
        assert [m["kind"] for m in outbox] == ["barrier.released"]
        assert await store.arrivals(SHARD, run_id, ("render-all",)) == {"render-all": frozenset("012345")}

    with_store(test)

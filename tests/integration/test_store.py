"""The Redis store against the real Redis: the ``saga`` Functions library and its Python port agree, and the
atomic steps keep their promises (compare-and-set, dedupe, barrier counting, retention, hash tags).

Every test works under a key prefix of its own (``t<uuid>``) and deletes its keys afterwards. Async code
runs through ``asyncio.run``; no pytest plugin is needed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from orchestrator.compiler import CompiledPlan, compile_text
from orchestrator.engine import advance
from orchestrator.engine.model import BarrierReleased, CancelRun, Decision, Event, StageResult, StartRun
from orchestrator.store.facets import static_facets, status_facets
from orchestrator.store.memory import MemoryStore
from orchestrator.store.redis_store import LIBRARY_NAME, RedisStore, library_source
from orchestrator.store.replies import APPLIED, CONFLICT, DUPLICATE
from orchestrator.wire import ids
from tests.conftest import DEFINITIONS, DEMO_REGISTRY, compile_yaml
from tests.faults import invariants
from tests.integration.stack import publish_active
from tests.unit.engine_sim import SHARD, Poisoned, Sim, apply_event, handler_output, heartbeat, typed
from tests.unit.redrive_cases import Case, cases, redriven
from tests.unit.redrive_cases import compiled as redrive_compiled
from tests.unit.test_engine_clocks import probe

pytestmark = pytest.mark.services

REDIS_URL = os.environ.get("SAGA_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
NOW = 1_700_000_000_000

_plans: dict[str, CompiledPlan] = {}


def compiled(name: str) -> CompiledPlan:
    if name not in _plans:
        path = DEFINITIONS / f"{name}.yaml"
        _plans[name] = compile_text(path.read_text(encoding="utf-8"), str(path), DEMO_REGISTRY)
    return _plans[name]


def with_store(
    test: Callable[[RedisStore], Awaitable[None]], retention_ms: int = 3_600_000, *, direct: bool = False
) -> None:
    """Run ``test`` with a RedisStore under a fresh prefix (``direct``: on the lane a shard's store has);
    delete every key of that prefix after."""

    async def main() -> None:
        client = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
        store = RedisStore(client, prefix=f"t{uuid.uuid4().hex}", retention_ms=retention_ms, direct=direct)
        try:
            await store.load_library()
            await test(store)
        finally:
            keys = [k async for k in client.scan_iter(match=f"{store.prefix}:*", count=1000)]
            if keys:
                await client.delete(*keys)
            await client.aclose()

    asyncio.run(main())


async def redis_apply(
    store: RedisStore, raw: Mapping[str, Any], digest: str, run_id: str, event: Event, now: int
) -> tuple[int | None, str, Decision]:
    """One event through engine and RedisStore, as the shard's processor does it (CONFLICT: decide again)."""
    plan = typed(raw)
    map_stage = event.stage if isinstance(event, BarrierReleased) and event.stage in plan.bags else None
    for _ in range(8):
        snapshot = await store.snapshot(SHARD, run_id, map_stage)
        decision = advance(plan, snapshot.digest if snapshot else digest, snapshot, event, now)
        if snapshot is None and not decision.create:
            return None, "", decision
        result = await store.apply(SHARD, run_id, event.message_id, decision, plan, now)
        if result.code != CONFLICT:
            return result.code, result.detail, decision
    raise AssertionError(f"8 conflicts in a row for {event}")


@dataclasses.dataclass
class State:
    """Everything stored for one run (and its outbox entries), in one comparable shape."""

    record: dict[str, str]
    history: list[tuple[str, str, str, str, Any]]
    applied: set[str]
    barriers: dict[str, dict[str, str]]
    outbox: dict[str, str]
    timers: dict[str, int]  # the run's members of the shard's timer set, with their due times
    live: dict[str, int]  # the shard's unfinished runs per plan digest (one run per test: this one's)


async def redis_state(store: RedisStore, run_id: str, plan: Mapping[str, Any]) -> State:
    client, keys = store.client, store.keys(SHARD)
    rows = await client.xrange(keys.history(run_id))
    outbox = await client.hgetall(keys.outbox())
    return State(
        record=await client.hgetall(keys.run(run_id)),
        history=[(f["kind"], f["stage"], f["attempt"], f["at"], json.loads(f["detail"])) for _, f in rows],
        applied=set(await client.smembers(keys.applied(run_id))),
        barriers={b: await store.barrier_members(SHARD, run_id, b) for b in typed(plan).barriers},
        outbox={k: v for k, v in outbox.items() if json.loads(v)["run_id"] == run_id},
        timers={
            m: int(due)
            for m, due in await client.zrange(keys.timers(), 0, -1, withscores=True)
            if m.startswith(f"{run_id}|")
        },
        live={d: int(n) for d, n in (await client.hgetall(keys.live())).items()},
    )


def memory_state(store: MemoryStore, run_id: str, plan: Mapping[str, Any]) -> State:
    run = store.runs[run_id]
    return State(
        record=dict(run.record),
        history=[(h["kind"], h["stage"], h["attempt"], str(h["at"]), h["detail"]) for h in run.history],
        applied=set(run.applied),
        barriers={b: dict(run.barriers.get(b, {})) for b in typed(plan).barriers},
        outbox={k: v for k, v in store.outbox.items() if json.loads(v)["run_id"] == run_id},
        timers={m: due for m, due in store.timers.items() if m.startswith(f"{run_id}|")},
        live=dict(store.live),
    )


def scenario(name: str, context: dict[str, Any], run_id: str, order: str = "fifo", **kwargs: Any) -> Sim:
    """Run a scenario through the in-memory simulator and return it (its ``log`` is the event sequence).

    ``order``: ``fifo``; ``lifo`` (newest first); or ``chaos`` (seeded shuffle with duplicates and stale)."""
    plan = compiled(name)
    sim = Sim(plan.plan, plan.digest, run_id=run_id, **kwargs)
    sim.start(context)
    rng = random.Random(run_id)
    while sim.pending or sim.store.timers:
        if not sim.pending or (order == "chaos" and sim.store.timers and rng.random() < 0.1):
            sim.fire_next_timer()  # time moves on: a retry's backoff ends, a deadline passes
            continue
        if order == "fifo":
            sim.deliver_at(0)
        elif order == "lifo":
            sim.deliver_at(len(sim.pending) - 1)
        else:
            sim.deliver_at(rng.randrange(len(sim.pending)))
            if sim.delivered and rng.random() < 0.3:
                sim.deliver(rng.choice(sim.delivered))  # a duplicate
            if sim.tasks and rng.random() < 0.15:
                task = rng.choice(sim.tasks).body
                if not str(task["stage"]).startswith("finaliser:"):
                    sim.handle(
                        StageResult(
                            f"stale-{len(sim.log)}",
                            str(task["stage"]),
                            int(task["attempt"]),
                            "0.9",
                            True,
                            {},
                            None,
                            task["item"],
                            sim.digest,
                        )
                    )
    return sim


SCENARIOS = [
    ("model-ingest", {"modelId": "miss-1"}, "fifo", {}),
    ("model-ingest", {"modelId": "cached-1"}, "lifo", {}),
    ("model-ingest", {"modelId": "miss-2"}, "chaos", {}),
    ("model-ingest", {"modelId": "fork-1"}, "fifo", {"fail_stages": frozenset({"technical-metadata"})}),
    ("model-ingest", {"modelId": "fin-1"}, "lifo", {"fail_stages": frozenset({"finaliser:0"})}),
    ("model-ingest", {"wrong": 1}, "fifo", {}),
    ("thumbnail-batch", {"modelIds": [f"m-{i}" for i in range(7)]}, "lifo", {}),
    ("thumbnail-batch", {"modelIds": [f"m-{i}" for i in range(9)]}, "chaos", {}),
    ("thumbnail-batch", {"modelIds": []}, "fifo", {}),
    ("thumbnail-batch", {"modelIds": ["a", "b", "c", "d"]}, "chaos", {"fail_items": frozenset({2})}),
    ("catalogue-reindex", {"index": "books"}, "chaos", {"fail_stages": frozenset({"snapshot"})}),
    ("catalogue-reindex", {"index": "films"}, "fifo", {}),
]


# ---- (a) the Lua library and its Python port agree ---------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "context", "order", "kwargs"),
    SCENARIOS,
    ids=[f"{s[0]}-{i}-{s[2]}" for i, s in enumerate(SCENARIOS)],
)
def test_memory_store_and_redis_store_agree_step_by_step(
    name: str, context: dict[str, Any], order: str, kwargs: dict[str, Any]
) -> None:
    run_id = f"run-{name}-{order}-{uuid.uuid4().hex[:8]}"
    sim = scenario(name, context, run_id, order, **kwargs)
    assert sim.status in ("completed", "failed")
    plan = compiled(name)

    async def test(store: RedisStore) -> None:
        memory = MemoryStore()
        for step, (event, now) in enumerate(sim.log):
            mine = apply_event(memory, plan.plan, plan.digest, run_id, event, now)
            code, detail, decision = await redis_apply(store, plan.plan, plan.digest, run_id, event, now)
            assert (code, detail) == (mine.code, mine.detail), (step, event)
            assert decision == mine.decision, (step, event)
            assert await redis_state(store, run_id, plan.plan) == memory_state(memory, run_id, plan.plan), (
                step,
                event,
            )
        final = await redis_state(store, run_id, plan.plan)
        assert final.record["status"] == sim.status
        assert [h[0] for h in final.history] == sim.kinds()
        assert set(final.outbox) == set(sim.published)
        assert await store.run_ids(SHARD) == [run_id]
        # the store's own readers see the same run
        snapshot, expected = await store.snapshot(SHARD, run_id), memory.snapshot(run_id)
        assert snapshot is not None and expected is not None
        assert dataclasses.replace(snapshot, map_results={}) == dataclasses.replace(expected, map_results={})
        for stage in sorted(plan.typed.bags):
            with_items = await store.snapshot(SHARD, run_id, stage)  # a map's results are read on demand
            assert with_items is not None
            assert with_items.map_results[stage] == expected.map_results.get(stage, [])
        history = await store.history(SHARD, run_id)
        assert [e["kind"] for e in history] == sim.kinds()
        assert [e["seq"] for e in history] == list(range(1, len(history) + 1))

    with_store(test)


def test_heartbeats_sent_again_or_out_of_order_agree_in_both_stores() -> None:
    # Given an attempt whose heartbeats arrive again and out of order
    sim = probe("heartbeat_timeout_ms: 900")
    sim.deliver_where(lambda d: d.kind == "task")
    sim.deliver_where(lambda d: d.kind == "event" and type(d.event).__name__ == "StageAccepted")
    start = sim.clock
    for beat, sent in ((2, 200), (2, 200), (1, 100), (3, 300)):
        sim.clock += 100
        sim.handle(heartbeat(sim.run_id, "render", "1.1", beat=beat, issued_at_ms=start + sent))

    # When the same events go through the Lua library and its Python port
    async def test(store: RedisStore) -> None:
        memory = MemoryStore()
        for step, (event, now) in enumerate(sim.log):
            mine = apply_event(memory, sim.plan, sim.digest, sim.run_id, event, now)
            code, _, decision = await redis_apply(store, sim.plan, sim.digest, sim.run_id, event, now)
            # Then both decide and hold the same after every step, the copy and the late beat moving nothing
            assert (code, decision) == (mine.code, mine.decision), step
            assert await redis_state(store, sim.run_id, sim.plan) == memory_state(
                memory, sim.run_id, sim.plan
            ), step
        assert [h.verdict.value for h in sim.handled[-4:]] == ["applied", "duplicate", "duplicate", "applied"]
        assert (await redis_state(store, sim.run_id, sim.plan)).record[
            "s:render:beat"
        ] == f"1.1|{start + 300}"

    with_store(test)


REDRIVE_CASES = cases()


async def replay_both(
    store: RedisStore, plan: CompiledPlan, run_id: str, log: list[tuple[Event | Poisoned, int]]
) -> MemoryStore:
    """``log`` through the Lua library and its port side by side: the same codes, decisions and stored
    state after every step."""
    memory = MemoryStore()
    for step, (event, now) in enumerate(log):
        if isinstance(event, Poisoned):  # lua/poison.lua and its port
            code = await store.poison(SHARD, run_id, event.message_id, event.error, now)
            assert code == memory.poison(run_id, event.message_id, event.error, now), (step, event)
        else:
            mine = apply_event(memory, plan.plan, plan.digest, run_id, event, now)
            code, detail, decision = await redis_apply(store, plan.plan, plan.digest, run_id, event, now)
            assert (code, detail, decision) == (mine.code, mine.detail, mine.decision), (step, event)
        assert await redis_state(store, run_id, plan.plan) == memory_state(memory, run_id, plan.plan), (
            step,
            event,
        )
    return memory


@pytest.mark.parametrize("case", REDRIVE_CASES, ids=[c.id for c in REDRIVE_CASES])
def test_memory_store_and_redis_store_agree_on_every_redrive(case: Case) -> None:
    """Each re-drive case (tests/unit/redrive_cases.py): the failing epoch, the re-drive and the new
    epoch, step by step, give the same codes, decisions and stored state in Lua as in its port."""
    run_id = f"run-redrive-{uuid.uuid4().hex[:8]}"
    sim = redriven(case, run_id)
    plan = redrive_compiled(case.definition)

    async def test(store: RedisStore) -> None:
        await replay_both(store, plan, run_id, sim.log)
        final = await redis_state(store, run_id, plan.plan)
        assert final.record["status"] == sim.status
        assert [h[0] for h in final.history] == sim.kinds()
        # and the fault suite's shared invariants hold over what Redis now holds
        await store.save_plan(plan.digest, plan.plan, plan.versions)
        await store.claim(run_id, SHARD)
        await store.client.delete(store.keys(SHARD).outbox())  # a replay publishes nothing
        with redis.Redis.from_url(REDIS_URL, decode_responses=True) as r:
            violations = invariants.check_runs(r, store.prefix, [run_id], expect_state=None, effects=False)
        invariants.assert_no_violations(violations, case.id)

    with_store(test)


BAG_TO_JOIN = """
    name: bag-to-join
    version: "1.0.0"
    entry: split
    stages:
      - name: split
        type: fork
        branches: [bag, quick]
      - name: bag
        type: map
        worker: thumbnail.render@3
        queue: tasks.parallel
        items: "${context.modelIds}"
        max_items: 10
        input: { modelId: "${item}" }
        on_success: meet
        on_failure: meet
      - name: quick
        type: action
        action: cache.lookup@1
        input: { modelId: "q" }
        on_success: meet
      - name: meet
        type: join
        required: [bag, quick]
        acceptable_terminal_states: [completed, failed]
        on_success: completed
"""


def test_an_item_that_arrived_stays_even_when_its_failure_would_arrive_at_a_join() -> None:
    """A bag's item arrived; its task, redelivered and run again, fails under the same report id. The
    failure's route would fail the bag and arrive at the join: the arrival function must refuse it as
    the item's duplicate (its absent member), as the transition function and the port do."""
    plan = compile_yaml(BAG_TO_JOIN)
    run_id = f"run-bag-join-{uuid.uuid4().hex[:8]}"
    sim = Sim(plan.plan, plan.digest, run_id=run_id)
    sim.start({"modelIds": ["a", "b"]})
    sim.deliver_at(0)
    handled = sim.deliver_task("bag", 0)
    assert handled is not None and handled.took_effect
    again = dataclasses.replace(handled.event, ok=False, result=None, error="boom", retryable=False)
    refused = sim.handle(again)
    assert refused.decision.arrival is not None and refused.decision.absent  # the case under test
    assert refused.code == DUPLICATE and sim.record["s:bag:status"] == "dispatched"

    async def test(store: RedisStore) -> None:
        memory = await replay_both(store, plan, run_id, sim.log)
        assert memory.runs[run_id].record["s:bag:status"] == "dispatched"

    with_store(test)


# ---- (b) compare-and-set -----------------------------------------------------------------------------------


async def started(store: RedisStore, name: str, context: dict[str, Any], run_id: str) -> CompiledPlan:
    plan = compiled(name)
    code, _, decision = await redis_apply(
        store, plan.plan, plan.digest, run_id, StartRun(f"start-{run_id}", run_id, SHARD, context), NOW
    )
    assert code == APPLIED and decision.create
    return plan


async def raw_dump(store: RedisStore, run_id: str, plan: Mapping[str, Any]) -> dict[str, Any]:
    client, keys = store.client, store.keys(SHARD)
    return {
        "record": await client.hgetall(keys.run(run_id)),
        "history": await client.xlen(keys.history(run_id)),
        "applied": await client.smembers(keys.applied(run_id)),
        "outbox": await client.hgetall(keys.outbox()),
        "runs": await client.zrange(keys.runs(), 0, -1, withscores=True),
        "barriers": {b: await store.barrier_members(SHARD, run_id, b) for b in typed(plan).barriers},
    }


def task_result(task: Mapping[str, Any], ok: bool = True, message_id: str | None = None) -> StageResult:
    """The worker's report for a task (an outbox payload)."""
    body = task["body"]
    value = handler_output(body["contract"], body["input"]) if ok else None
    return StageResult(
        message_id or ids.result_id(task["id"]),
        body["stage"],
        body["attempt"],
        body["fence"],
        ok,
        value,
        None if ok else "RuntimeError: boom",
        body["item"],
        body["digest"],
    )


def test_a_transition_whose_expects_no_longer_hold_conflicts_and_writes_nothing() -> None:
    async def test(store: RedisStore) -> None:
        plan = await started(store, "model-ingest", {"modelId": "m-1"}, "run-cas")
        (task,) = (await store.outbox(SHARD)).values()
        read = await store.snapshot(SHARD, "run-cas")

        # two actors read the same snapshot; the first one's transition wins
        first = task_result(task)
        won = await store.apply(
            SHARD,
            "run-cas",
            first.message_id,
            advance(plan.typed, plan.digest, read, first, NOW),
            plan.typed,
            NOW,
        )
        assert won.code == APPLIED

        # a paused consumer's cancellation, decided on the old snapshot: it would cancel cache-lookup,
        # which has completed meanwhile
        second = CancelRun("cancel-from-a-paused-consumer", "stop")
        late = advance(plan.typed, plan.digest, read, second, NOW + 1)
        before = await raw_dump(store, "run-cas", plan.plan)
        lost = await store.apply(SHARD, "run-cas", second.message_id, late, plan.typed, NOW + 1)

        assert lost.code == CONFLICT
        assert lost.detail.startswith("s:cache-lookup:")
        assert await raw_dump(store, "run-cas", plan.plan) == before

        # the in-memory port gives the same answer for the same spec
        memory = MemoryStore()
        barriers = list(plan.typed.barriers)
        start = StartRun("start-run-cas", "run-cas", SHARD, {"modelId": "m-1"})
        memory.apply(
            "run-cas", start.message_id, advance(plan.typed, plan.digest, None, start, NOW), barriers, NOW
        )
        assert (
            memory.apply(
                "run-cas", first.message_id, advance(plan.typed, plan.digest, read, first, NOW), barriers, NOW
            )[0]
            == APPLIED
        )
        assert memory.apply("run-cas", second.message_id, late, barriers, NOW + 1) == (CONFLICT, lost.detail)

    with_store(test)


def test_an_arrival_after_the_intent_conflicts_and_does_not_count() -> None:
    async def test(store: RedisStore) -> None:
        plan = await started(store, "thumbnail-batch", {"modelIds": ["a", "b", "c"]}, "run-arr")
        tasks = sorted((await store.outbox(SHARD)).values(), key=lambda t: t["body"]["item"])
        read = await store.snapshot(SHARD, "run-arr")
        arrival = task_result(tasks[0])
        decided = advance(plan.typed, plan.digest, read, arrival, NOW)
        assert decided.arrival is not None

        # a failure no retry can mend: the map (and the run) fail at once
        failure = dataclasses.replace(task_result(tasks[1], ok=False), retryable=False)
        assert (
            await store.apply(
                SHARD,
                "run-arr",
                failure.message_id,
                advance(plan.typed, plan.digest, read, failure, NOW),
                plan.typed,
                NOW,
            )
        ).code == APPLIED

        before = await raw_dump(store, "run-arr", plan.plan)
        result = await store.apply(SHARD, "run-arr", arrival.message_id, decided, plan.typed, NOW + 1)
        assert result.code == CONFLICT
        assert result.detail in ("intent", "s:render-all:fence")
        assert await raw_dump(store, "run-arr", plan.plan) == before
        assert before["record"]["b:render-all"] == "3"

    with_store(test)


# ---- (c) a message id applied twice ------------------------------------------------------------------------


def test_the_same_message_id_applied_twice_is_a_recorded_duplicate() -> None:
    async def test(store: RedisStore) -> None:
        plan = await started(store, "model-ingest", {"modelId": "m-1"}, "run-dup")
        (task,) = (await store.outbox(SHARD)).values()
        event = task_result(task)
        decision = advance(plan.typed, plan.digest, await store.snapshot(SHARD, "run-dup"), event, NOW)

        assert (
            await store.apply(SHARD, "run-dup", event.message_id, decision, plan.typed, NOW)
        ).code == APPLIED
        before = await raw_dump(store, "run-dup", plan.plan)
        again = await store.apply(SHARD, "run-dup", event.message_id, decision, plan.typed, NOW + 5)
        after = await raw_dump(store, "run-dup", plan.plan)

        assert (again.code, again.detail) == (DUPLICATE, event.message_id)
        assert after["history"] == before["history"] + 1
        assert {k: v for k, v in after.items() if k != "history"} == {
            k: v for k, v in before.items() if k != "history"
        }
        last = (await store.history(SHARD, "run-dup"))[-1]
        assert last["kind"] == "callback.rejected"
        assert last["reason"] == "duplicate" and last["message_id"] == event.message_id
        assert last["at"] == NOW + 5

        # a start re-sent for an existing run is a duplicate too, and creates nothing
        start = StartRun("start-run-dup", "run-dup", SHARD, {"modelId": "m-1"})
        resent = await store.apply(
            SHARD,
            "run-dup",
            start.message_id,
            advance(plan.typed, plan.digest, None, start, NOW),
            plan.typed,
            NOW,
        )
        assert resent.code == DUPLICATE
        assert (await raw_dump(store, "run-dup", plan.plan))["record"] == after["record"]

    with_store(test)


# ---- (d) barrier arrivals ----------------------------------------------------------------------------------


def test_arrivals_count_distinct_items_and_release_exactly_once_under_concurrency() -> None:
    items = 200

    async def test(store: RedisStore) -> None:
        model_ids = [f"m-{i}" for i in range(items)]
        plan = await started(store, "thumbnail-batch", {"modelIds": model_ids}, "run-bag")
        keys = store.keys(SHARD)
        tasks = sorted((await store.outbox(SHARD)).values(), key=lambda t: t["body"]["item"])
        assert len(tasks) == items
        read = await store.snapshot(SHARD, "run-bag")

        def arrive(item: int, message_id: str | None = None) -> Awaitable[Any]:
            event = task_result(tasks[item], message_id=message_id)
            decision = advance(plan.typed, plan.digest, read, event, NOW)  # arrivals commute: one snapshot
            return store.apply(SHARD, "run-bag", event.message_id, decision, plan.typed, NOW)

        # the same item twice counts once
        first, again = await arrive(0), await arrive(0)
        assert (first.code, first.detail) == (APPLIED, str(items - 1))
        assert again.code == DUPLICATE
        assert await store.client.hget(keys.run("run-bag"), "b:render-all") == str(items - 1)

        # a report under an id that answers no task is refused by the engine, before any arrival
        forged = task_result(tasks[150], message_id="result-resent-150")
        assert advance(plan.typed, plan.digest, read, forged, NOW).arrival is None

        # every other item, concurrently, with duplicates (the same id again)
        calls = [arrive(i) for i in range(1, items)]
        calls += [arrive(i) for i in range(0, 60)]
        calls += [arrive(i) for i in range(150, 170)]
        random.Random(3).shuffle(calls)
        results = await asyncio.gather(*calls)

        applied = [r for r in results if r.code == APPLIED]
        assert len(applied) == items - 1
        assert sorted(int(r.detail) for r in applied) == list(range(items - 1))  # each count seen once
        assert [r.detail for r in applied].count("0") == 1
        assert sum(1 for r in results if r.code == DUPLICATE) == 80
        assert await store.client.hget(keys.run("run-bag"), "b:render-all") == "0"
        assert len(await store.barrier_members(SHARD, "run-bag", "render-all")) == items

        release_id = ids.message_id("release", "run-bag", "render-all", "1.1")
        outbox = await store.outbox(SHARD)
        assert release_id in outbox
        assert [m["kind"] for m in outbox.values()].count("barrier.released") == 1

        # once sent, a later duplicate arrival does not append the release again
        assert await store.mark_sent(SHARD, [release_id]) == 1
        assert (await arrive(7)).code == DUPLICATE
        assert release_id not in await store.outbox(SHARD)

        # the release completes the map with every result, in item order
        release = BarrierReleased(release_id, "render-all", "1.1")
        code, _, decision = await redis_apply(store, plan.plan, plan.digest, "run-bag", release, NOW + 1)
        assert code == APPLIED and decision.verdict.value == "applied"
        snapshot = await store.snapshot(SHARD, "run-bag")
        assert snapshot is not None
        assert snapshot.stages["render-all"].result == [
            {"thumbnailUri": f"thumbs/{m}.png"} for m in model_ids
        ]
        assert (
            json.loads((await store.client.hget(keys.run("run-bag"), "output")) or "null")["count"] == items
        )
        # and a second delivery of the release is a duplicate
        code, _, decision = await redis_apply(store, plan.plan, plan.digest, "run-bag", release, NOW + 2)
        assert code == DUPLICATE or decision.verdict.value == "duplicate"

    with_store(test)


def test_a_joins_last_branch_releases_it_in_its_own_call_and_only_while_the_count_is_one() -> None:
    """The last branch's transition completes the join and dispatches its successor in the call that
    counts it (no release message); the same branch decided on a read taken before the other branch
    arrived is an arrival with a release message, and whichever of the two is applied first is the
    only one: the other conflicts on the count and writes nothing."""

    async def test(store: RedisStore) -> None:
        plan = await started(store, "model-ingest", {"modelId": "m-1"}, "run-join")
        for stage in ("cache-lookup", "render-thumbnail"):
            (task,) = [t for t in (await store.outbox(SHARD)).values() if t["body"]["stage"] == stage]
            await store.mark_sent(SHARD, [task["id"]])
            code, _, _ = await redis_apply(store, plan.plan, plan.digest, "run-join", task_result(task), NOW)
            assert code == APPLIED
        branches = {t["body"]["stage"]: t for t in (await store.outbox(SHARD)).values()}
        assert set(branches) == {"semantic-analysis", "technical-metadata"}
        await store.mark_sent(SHARD, [t["id"] for t in branches.values()])
        before_any = await store.snapshot(SHARD, "run-join")
        code, detail, _ = await redis_apply(
            store, plan.plan, plan.digest, "run-join", task_result(branches["semantic-analysis"]), NOW
        )
        assert (code, detail) == (APPLIED, "1")

        last = task_result(branches["technical-metadata"])
        stale = advance(plan.typed, plan.digest, before_any, last, NOW)  # the count read as 2
        assert stale.arrival is not None and stale.arrival.release is not None
        read = await store.snapshot(SHARD, "run-join")
        inline = advance(plan.typed, plan.digest, read, last, NOW)
        assert inline.arrival is not None and inline.arrival.release is None
        assert [m.body["stage"] for m in inline.outgoing] == ["publish"]

        # the count is not the 1 it was read as (say another arrival counted meanwhile): no release
        counter = store.keys(SHARD).run("run-join")
        await store.client.hset(counter, "b:derive-join", "2")
        moved = await raw_dump(store, "run-join", plan.plan)
        refused = await store.apply(SHARD, "run-join", last.message_id, inline, plan.typed, NOW)
        assert (refused.code, refused.detail) == (CONFLICT, "b:derive-join")
        assert await raw_dump(store, "run-join", plan.plan) == moved
        await store.client.hset(counter, "b:derive-join", "1")

        # the stale decision first: it counts the branch and sends the release; the inline one conflicts
        first = await store.apply(SHARD, "run-join", last.message_id, stale, plan.typed, NOW)
        assert (first.code, first.detail) == (APPLIED, "0")
        after_first = await raw_dump(store, "run-join", plan.plan)
        second = await store.apply(SHARD, "run-join", last.message_id, inline, plan.typed, NOW)
        assert second.code == CONFLICT
        assert await raw_dump(store, "run-join", plan.plan) == after_first
        release_id = ids.release_id("run-join", "derive-join", "1.1")
        assert [json.loads(m)["kind"] for m in after_first["outbox"].values()] == ["barrier.released"]
        assert release_id in after_first["outbox"]

    with_store(test)

    async def inline_wins(store: RedisStore) -> None:
        plan = await started(store, "model-ingest", {"modelId": "m-1"}, "run-join")
        keys = store.keys(SHARD)
        while (run := await store.snapshot(SHARD, "run-join")) is not None and run.barriers.get(
            "derive-join", 2
        ) > 0:
            sent = await store.outbox(SHARD)
            await store.mark_sent(SHARD, list(sent))
            for task in sent.values():
                code, _, _ = await redis_apply(
                    store, plan.plan, plan.digest, "run-join", task_result(task), NOW
                )
                assert code == APPLIED
        assert run is not None and run.stages["derive-join"].status.value == "completed"
        assert [m["body"]["stage"] for m in (await store.outbox(SHARD)).values()] == ["publish"]
        assert set(await store.barrier_members(SHARD, "run-join", "derive-join")) == {
            "semantic-analysis",
            "technical-metadata",
        }
        kinds = [fields["kind"] for _, fields in await store.client.xrange(keys.history("run-join"))]
        assert kinds.count("join.released") == 1
        assert kinds[-3:] == ["branch.arrived", "join.released", "stage.dispatched"]

    with_store(inline_wins)


# ---- (e) the library is reloaded when Redis lost it --------------------------------------------------------


def test_a_transition_after_function_flush_reloads_the_library_and_succeeds() -> None:
    async def test(store: RedisStore) -> None:
        plan = await started(store, "model-ingest", {"modelId": "m-1"}, "run-flush")
        (task,) = (await store.outbox(SHARD)).values()

        await store.client.function_flush("SYNC")  # what a restarted Redis without persistence looks like
        event = task_result(task)
        code, _, _ = await redis_apply(store, plan.plan, plan.digest, "run-flush", event, NOW)

        assert code == APPLIED
        libraries = await store.client.function_list(library=LIBRARY_NAME)
        assert libraries, "the library was not loaded again"
        assert (await store.snapshot(SHARD, "run-flush")).stages["cache-lookup"].status.value == "completed"  # type: ignore[union-attr]

        await store.client.function_flush("SYNC")
        pending = list(await store.outbox(SHARD))
        assert await store.mark_sent(SHARD, pending[:1]) == 1  # mark_sent reloads it as well

    with_store(test)


# ---- (f) retention -----------------------------------------------------------------------------------------


def test_a_finished_run_gets_the_retention_ttl_and_shard_keys_do_not_expire() -> None:
    retention = 120_000
    sim = scenario("model-ingest", {"modelId": "miss-ttl"}, "run-ttl")
    assert sim.status == "completed"
    plan = compiled("model-ingest")
    last = next(i for i, h in enumerate(sim.handled) if h.decision.finished)

    async def test(store: RedisStore) -> None:
        keys = store.keys(SHARD)
        run_keys = [
            keys.run("run-ttl"),
            keys.history("run-ttl"),
            keys.applied("run-ttl"),
            keys.barrier("run-ttl", "derive-join"),
        ]
        for event, now in sim.log[:last]:
            await redis_apply(store, plan.plan, plan.digest, "run-ttl", event, now)
        for key in run_keys:
            assert await store.client.pttl(key) == -1, key  # a running run does not expire

        for event, now in sim.log[last:]:
            await redis_apply(store, plan.plan, plan.digest, "run-ttl", event, now)
        assert (await store.client.hget(keys.run("run-ttl"), "status")) == "completed"
        for key in run_keys:
            ttl = await store.client.pttl(key)
            assert 0 < ttl <= retention, (key, ttl)
        for key in (keys.outbox(), keys.runs()):
            assert await store.client.exists(key) == 1, key
            assert await store.client.pttl(key) == -1, key
        assert await store.run_ids(SHARD) == ["run-ttl"]

    with_store(test, retention_ms=retention)


# ---- (g) mark_sent -----------------------------------------------------------------------------------------


def test_mark_sent_removes_only_the_given_ids() -> None:
    async def test(store: RedisStore) -> None:
        await started(store, "thumbnail-batch", {"modelIds": ["a", "b", "c", "d", "e"]}, "run-sent")
        outbox = await store.outbox(SHARD)
        ordered = sorted(outbox, key=lambda k: outbox[k]["body"]["item"])
        assert len(ordered) == 5

        assert await store.mark_sent(SHARD, []) == 0
        assert await store.mark_sent(SHARD, [ordered[0], ordered[2], "task-never-published"]) == 2
        assert set(await store.outbox(SHARD)) == {ordered[1], ordered[3], ordered[4]}
        assert await store.mark_sent(SHARD, [ordered[0]]) == 0  # already gone
        left = await store.outbox(SHARD)
        assert left == {k: outbox[k] for k in (ordered[1], ordered[3], ordered[4])}  # payloads untouched

        memory = MemoryStore(outbox=dict.fromkeys(ordered, "x"))
        assert memory.mark_sent([ordered[0], ordered[2], "task-never-published"]) == 2
        assert set(memory.outbox) == set(left)

    with_store(test)


# ---- (h) hash tags -----------------------------------------------------------------------------------------


def test_every_key_the_store_writes_carries_the_shard_hash_tag() -> None:
    sims = [
        scenario("model-ingest", {"modelId": "miss-tag"}, "run-tag-1"),
        scenario("thumbnail-batch", {"modelIds": ["a", "b"]}, "run-tag-2", "lifo"),
        scenario(
            "model-ingest", {"modelId": "fail-tag"}, "run-tag-3", fail_stages=frozenset({"semantic-analysis"})
        ),
    ]

    async def test(store: RedisStore) -> None:
        for sim in sims:
            for event, now in sim.log:
                await redis_apply(store, sim.plan, sim.digest, sim.run_id, event, now)
        written = {k async for k in store.client.scan_iter(match=f"{store.prefix}:*", count=1000)}
        for key in written:
            start = key.index("{")
            assert key[start + 1 : key.index("}", start)] == SHARD, key  # the key's hash tag
        keys = store.keys(SHARD)
        expected = {keys.outbox(), keys.runs()}
        for sim in sims:
            expected |= {keys.run(sim.run_id), keys.history(sim.run_id), keys.applied(sim.run_id)}
        expected |= {keys.barrier("run-tag-1", "derive-join")}
        expected |= {keys.bag_arrived("run-tag-2", "render-all"), keys.bag_results("run-tag-2", "render-all")}
        for sim in sims:  # the listing indexes of its definition, its version and its final status
            name, version = sim.plan["name"], sim.plan["version"]
            expected |= {*static_facets(keys, name, version), *status_facets(keys, name, version, sim.status)}
        assert written == expected

    with_store(test)


def test_mark_sent_takes_ten_thousand_ids_at_once() -> None:
    """A shard marks every entry a batch's transitions and the relay confirmed in ONE call: 10,000 ids
    (a backlog re-published after an outage, say) must not hit Lua's unpack limit (about 8,000 values)."""
    count = 10_000

    async def test(store: RedisStore) -> None:
        entries = {f"task-{i}": json.dumps({"id": f"task-{i}"}) for i in range(count)}
        await store.client.hset(store.keys(SHARD).outbox(), mapping=entries)  # type: ignore[misc]
        sent = list(await store.outbox(SHARD))
        assert len(sent) == count

        assert await store.mark_sent(SHARD, sent) == count
        assert await store.outbox(SHARD) == {}

    with_store(test)


def test_two_releases_libraries_coexist_on_one_redis() -> None:
    """Functions are global to a server: an older release's library (another name) must survive ours."""

    async def test(store: RedisStore) -> None:
        older = library_source().replace(LIBRARY_NAME, "saga_0000000000")
        await store.client.function_load(older, replace=True)  # type: ignore[misc]
        try:
            await store.load_library()
            names = _library_names(await store.client.function_list())  # type: ignore[misc]
            assert {"saga_0000000000", LIBRARY_NAME} <= names
            await started(store, "ingest-triage", {"sizeMb": 1, "format": "glb"}, "run-coexist")
            assert (await store.snapshot(SHARD, "run-coexist")) is not None
        finally:
            await store.client.function_delete("saga_0000000000")  # type: ignore[misc]

    with_store(test)


def _library_names(listing: list[list[object]]) -> set[str]:
    """FUNCTION LIST answers one flat [key, value, ...] list per library."""
    names = set()
    for library in listing:
        fields = {_text(k): v for k, v in zip(library[::2], library[1::2], strict=True)}
        names.add(_text(fields["library_name"]))
    return names


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@pytest.mark.parametrize("direct", [False, True], ids=["pipelined", "lane"])
def test_a_start_is_claimed_once_and_its_versions_state_read_as_governance_wrote_it(direct: bool) -> None:
    """What a shard reads and writes before it creates a run (invariants 2 and 12): a run id is claimed by
    the first shard only, a claim made again or by another shard names the first; a published version's
    state is read as governance keeps it, an unknown digest as none. The same on the lane and pipelined."""
    plan = compiled("model-ingest")

    async def test(store: RedisStore) -> None:
        assert await store.claim_fresh([], "fast.0") == []
        assert await store.digest_info([]) == []
        assert await store.claim_fresh(["run-a", "run-b"], "fast.0") == [("fast.0", True), ("fast.0", True)]
        # claimed before, by this shard and by another: neither call claims it, both learn the owner
        assert await store.claim_fresh(["run-a", "run-c"], "fast.0") == [("fast.0", False), ("fast.0", True)]
        assert await store.claim_fresh(["run-a", "run-d"], "fast.1") == [("fast.0", False), ("fast.1", True)]
        assert await store.owner("run-d") == "fast.1"

        assert await store.digest_info([plan.digest, "sha256:unknown"]) == [None, None]
        await publish_active(store, plan)
        info, unknown = await store.digest_info([plan.digest, "sha256:unknown"])
        assert unknown is None and info is not None
        assert (info.definition, info.startable) == (plan.name, True)

    with_store(test, direct=direct)

"""A shard keeps the records of the runs it advanced, so the next message of a run needs no read before
its write. Real Redis: the kept record must equal the run hash after every transition, every round trip
it saves must be one the old path made, and a write this process did not make must never be decided
over (the revision check turns it into a conflict, and the message is decided again from Redis)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from orchestrator.bus.envelope import Envelope, decode, signed_message
from orchestrator.bus.publisher import envelope_for, outgoing_from_payload
from orchestrator.client import start_envelope
from orchestrator.compiler import CompiledPlan
from orchestrator.shard.processor import Processor
from orchestrator.store.keys import plan_key, refused_key
from orchestrator.store.redis_store import ApplyResult, PlanNotFound, RedisStore
from orchestrator.store.replies import CONFLICT
from orchestrator.store.spec import snapshot_from_record
from orchestrator.wire import bodies, ids
from orchestrator.wire.kinds import Kind
from orchestrator.wire.outgoing import Outgoing
from tests.conftest import compile_yaml
from tests.faults import invariants
from tests.integration.stack import publish_active
from tests.integration.test_nudge_race import REDIS_URL, SHARD, SIGNER, SPLIT, report
from tests.integration.test_store import BAG_TO_JOIN
from tests.unit.test_engine import compiled

pytestmark = pytest.mark.services


class CountingStore(RedisStore):
    """The store, counting run reads (batched and one by one) and the conflicts its transitions meet."""

    conflicts: list[str]
    read_runs: list[str]

    @property
    def reads(self) -> int:
        return len(self.read_runs)

    async def records(self, shard: str, run_ids: list[str]) -> list[dict[str, str] | None]:
        self.read_runs += run_ids
        return await super().records(shard, run_ids)

    async def snapshot(self, shard: str, run_id: str, *args: Any, **kwargs: Any) -> Any:
        self.read_runs.append(run_id)
        return await super().snapshot(shard, run_id, *args, **kwargs)

    async def run_digest(self, shard: str, run_id: str) -> str | None:
        self.read_runs.append(run_id)
        return await super().run_digest(shard, run_id)

    async def apply_many(self, *args: Any, **kwargs: Any) -> list[ApplyResult]:
        results = await super().apply_many(*args, **kwargs)
        self.conflicts += [r.detail for r in results if r.code == CONFLICT]
        return results


async def with_store(test: Callable[[CountingStore, aioredis.Redis], Awaitable[None]]) -> None:
    client = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
    store = CountingStore(client, prefix=f"t{uuid.uuid4().hex}")
    store.conflicts, store.read_runs = [], []
    try:
        await store.load_library()
        await test(store, client)
    finally:
        keys = [k async for k in client.scan_iter(match=f"{store.prefix}:*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()


async def assert_kept_records_are_redis(
    processor: Processor, store: RedisStore, client: aioredis.Redis
) -> tuple[int, int]:
    """Every kept record equals its run hash (but the live-count flag, which no decision reads), and the
        engine's snapshot kept with it, where there is one, is the snapshot of that hash. Returns how many
    records and snapshots were checked."""
    kept = list(processor.records._kept.items())
    snapshots = 0
    for (shard, run_id), run in kept:
        stored = await client.hgetall(store.keys(shard).run(run_id))  # type: ignore[misc]
        stored.pop("counted", None)
        kept_fields = {name: value for name, value in run.record.items() if name != "counted"}
        assert kept_fields == stored, f"kept record of {run_id} differs from Redis"
        if run.snapshot is not None:
            built = snapshot_from_record(stored, {}, shared=True)
            assert run.snapshot == built, f"kept snapshot of {run_id} differs from Redis's record"
            snapshots += 1
    return len(kept), snapshots


async def deliver_all(
    processor: Processor, store: RedisStore, client: aioredis.Redis, *, snapshots: bool = False
) -> int:
    """Answer everything in the outbox, every task of a round in one batch (as a busy shard sees them),
    checking the kept records after each batch (``snapshots``: and that some kept snapshots were checked).
    Returns the number of messages handled."""
    handled = checked = 0
    for _ in range(40):
        entries = [outgoing_from_payload(p) for p in (await store.outbox(SHARD)).values()]
        if not entries:
            assert checked or not snapshots, "no kept snapshot was checked"
            return handled
        await store.mark_sent(SHARD, [m.message_id for m in entries])
        batch = [message_for(m) for m in entries if m.kind in ("task", "barrier.released")]
        if batch:
            await processor.handle_batch(SHARD, batch)
            handled += len(batch)
            checked += (await assert_kept_records_are_redis(processor, store, client))[1]
    raise AssertionError("the runs did not settle")


async def settled_and_sound(
    processor: Processor, store: RedisStore, client: aioredis.Redis, runs: list[str], state: str
) -> None:
    """Answer everything the runs wait for: they end ``state``, and the fault suite's shared invariants
    hold over them."""
    await deliver_all(processor, store, client)
    with redis.Redis.from_url(REDIS_URL, decode_responses=True) as r:
        violations = invariants.check_runs(r, store.prefix, runs, expect_state=state, effects=False)
    invariants.assert_no_violations(violations, "a batch's rounds")


def message_for(message: Outgoing) -> Envelope:
    return report(message) if message.kind == "task" else envelope_for(message, SIGNER, 0)


async def start(
    store: RedisStore, processor: Processor, plan: CompiledPlan, name: str, contexts: list[Any]
) -> list[str]:
    await publish_active(store, plan)
    runs = [f"kept-{uuid.uuid4().hex[:10]}" for _ in contexts]
    await processor.handle_batch(
        SHARD,
        [
            start_envelope(SIGNER, run, name, plan.digest, ctx)
            for run, ctx in zip(runs, contexts, strict=True)
        ],
    )
    return runs


def test_kept_records_equal_the_run_hashes_and_spare_the_reads() -> None:
    async def main(store: CountingStore, client: aioredis.Redis) -> None:
        processor = Processor(store, lambda: int(time.time() * 1000))
        ingest = await start(
            store,
            processor,
            compiled("model-ingest"),
            "model-ingest",
            [{"modelId": f"miss-{i}"} for i in range(6)],
        )
        bags = await start(
            store, processor, compile_yaml(SPLIT), "split-bag", [{"modelIds": ["a", "b", "c", "d"]}] * 3
        )
        assert (await assert_kept_records_are_redis(processor, store, client))[
            0
        ] == 9  # kept from creation on
        handled = await deliver_all(processor, store, client, snapshots=True)
        # every transition after a run's creation was decided from its kept record, but around a bag's
        # release: it reads the items' results afresh (they are not kept), and the next message the record
        assert not set(store.read_runs) & set(ingest), f"{store.reads} reads for {handled} messages"
        assert all(store.read_runs.count(run) <= 3 for run in bags), store.read_runs
        assert not store.conflicts
        with redis.Redis.from_url(REDIS_URL, decode_responses=True) as r:
            states = {run: r.hget(store.keys(SHARD).run(run), "status") for run in ingest + bags}
            violations = invariants.check_runs(r, store.prefix, ingest + bags, effects=False)
        assert set(states.values()) == {"completed"}, states
        invariants.assert_no_violations(violations, "runs advanced from kept records")
        assert len(processor.records) == 0  # finished runs are not kept

    asyncio.run(with_store(main))


def test_a_write_made_elsewhere_is_never_decided_over() -> None:
    """Another process (an old consumer, a standby firing a timer) writes the run: this one's kept record
    is stale, its next transition expects a revision that is gone, and the message is decided again
    from what Redis holds."""

    async def main(store: CountingStore, client: aioredis.Redis) -> None:
        here = Processor(store, lambda: int(time.time() * 1000))
        elsewhere = Processor(store, lambda: int(time.time() * 1000))
        (run,) = await start(
            store, here, compiled("model-ingest"), "model-ingest", [{"modelId": "miss-stale"}]
        )
        lookup = await only_task(store)
        await here.handle_batch(SHARD, [report(lookup)])  # cache-lookup missed: render is dispatched
        render = await only_task(store)
        assert render.body["stage"] == "render-thumbnail" and (render.body.get("report") or {}).get("accept")
        # the acceptance is applied by the other process: this one's kept record does not know of it
        await elsewhere.handle_batch(SHARD, [acceptance(render)])
        assert here.records.get(SHARD, run) is not None
        await here.handle_batch(SHARD, [report(render)])
        assert store.conflicts, "the decision from the stale record met a conflict"
        # one read by the other process, one to decide the result again
        assert store.reads == 2, "the message was decided again from a fresh read"
        # the render's result counted once and the run goes on from it
        history = await store.history(SHARD, run)
        assert [e["kind"] for e in history].count("stage.completed") == 2
        await assert_kept_records_are_redis(here, store, client)
        await deliver_all(here, store, client)
        with redis.Redis.from_url(REDIS_URL, decode_responses=True) as r:
            assert r.hget(store.keys(SHARD).run(run), "status") == "completed"
            invariants.assert_no_violations(
                invariants.check_runs(r, store.prefix, [run], effects=False), "stale"
            )

    asyncio.run(with_store(main))


async def only_task(store: RedisStore) -> Outgoing:
    entries = [outgoing_from_payload(p) for p in (await store.outbox(SHARD)).values()]
    await store.mark_sent(SHARD, [m.message_id for m in entries])
    (task,) = [m for m in entries if m.kind == "task"]
    return task


def acceptance(task: Outgoing) -> Envelope:
    body = task.body
    fields = {n: body[n] for n in ("run_id", "shard", "stage", "attempt", "fence", "item", "digest")}
    raw = signed_message(
        SIGNER,
        kind=Kind.ACCEPTED,
        message_id=ids.acceptance_id(str(body["run_id"]), str(body["stage"]), str(body["fence"])),
        body={},
        **fields,
    )
    return decode(raw, SIGNER, 1_048_576)


def test_the_revision_alone_catches_a_write_no_decision_expects() -> None:
    """A write elsewhere that changes nothing the next decision expects (here: only the revision) still
    sends that decision back to a fresh read."""

    async def main(store: CountingStore, client: aioredis.Redis) -> None:
        here = Processor(store, lambda: int(time.time() * 1000))
        (run,) = await start(store, here, compiled("model-ingest"), "model-ingest", [{"modelId": "miss-rev"}])
        lookup = await only_task(store)
        await client.hincrby(store.keys(SHARD).run(run), "rev", 1)  # type: ignore[misc]
        await here.handle_batch(SHARD, [report(lookup)])
        assert store.conflicts == ["rev"]
        assert store.reads == 1
        await assert_kept_records_are_redis(here, store, client)
        await settled_and_sound(here, store, client, [run], "completed")
        with redis.Redis.from_url(REDIS_URL, decode_responses=True) as r:
            assert r.hget(store.keys(SHARD).run(run), "status") == "completed"

    asyncio.run(with_store(main))


def test_an_item_decided_from_a_kept_record_does_not_arrive_at_a_map_ended_elsewhere() -> None:
    """Another process ends a bag under the same fence (an item's last failure, whose route goes on to
    the join, so the run's intent stays unset). This one still keeps the record in which the bag is
    running: an item's success decided from it must not count at the bag's barrier."""

    async def main(store: CountingStore, client: aioredis.Redis) -> None:
        here = Processor(store, lambda: int(time.time() * 1000))
        elsewhere = Processor(store, lambda: int(time.time() * 1000))
        plan = compile_yaml(BAG_TO_JOIN)
        (run,) = await start(store, here, plan, "bag-to-join", [{"modelIds": ["a", "b", "c"]}])
        entries = [outgoing_from_payload(p) for p in (await store.outbox(SHARD)).values()]
        await store.mark_sent(SHARD, [m.message_id for m in entries])
        items = {m.body["item"]: m for m in entries if m.body["stage"] == "bag"}
        assert here.records.get(SHARD, run) is not None
        await elsewhere.handle_batch(SHARD, [failure(items[0])])  # the bag fails, for good
        counter = store.keys(SHARD).run(run)
        assert await client.hget(counter, "s:bag:status") == "failed"  # type: ignore[misc]
        members_before = len(await store.barrier_members(SHARD, run, "bag"))
        outcome = (await here.handle_batch(SHARD, [report(items[1])]))[0]
        assert not outcome.publish
        assert await client.hget(counter, "b:bag") == "3"  # type: ignore[misc]
        assert len(await store.barrier_members(SHARD, run, "bag")) == members_before
        kinds = [e["kind"] for e in await store.history(SHARD, run)]
        assert kinds[-1] == "callback.rejected", kinds
        (quick,) = [m for m in entries if m.body["stage"] == "quick"]
        # the other branch fails the run: the shared checks count a bag's release only on a completed
        # run, and know nothing of a join that tolerates a failed bag
        await here.handle_batch(SHARD, [failure(quick)])
        await deliver_all(here, store, client)
        with redis.Redis.from_url(REDIS_URL, decode_responses=True) as r:
            assert r.hget(store.keys(SHARD).run(run), "status") == "failed"
            violations = invariants.check_runs(r, store.prefix, [run], expect_state="failed", effects=False)
        invariants.assert_no_violations(violations, "a bag ended elsewhere")

    asyncio.run(with_store(main))


def failure(task: Outgoing) -> Envelope:
    """A worker's report that ``task`` failed in a way no retry mends."""
    body = task.body
    fields = {n: body[n] for n in ("run_id", "shard", "stage", "attempt", "fence", "item", "digest")}
    raw = signed_message(
        SIGNER,
        kind=Kind.RESULT,
        message_id=ids.result_id(task.message_id),
        body={"ok": False, "error": "boom", "retryable": False},
        **fields,
    )
    return decode(raw, SIGNER, 1_048_576)


def test_a_message_decided_again_keeps_its_place_before_its_runs_later_ones() -> None:
    """A batch holds a result that meets a conflict and, after it, an operator's cancel of the same run:
    the result is decided again in the next round, still before the cancel, so the run cancels after
    the result counted (a cancel taken first would make the result late and lose it)."""

    async def main(store: CountingStore, client: aioredis.Redis) -> None:
        here = Processor(store, lambda: int(time.time() * 1000))
        elsewhere = Processor(store, lambda: int(time.time() * 1000))
        (run,) = await start(
            store, here, compiled("model-ingest"), "model-ingest", [{"modelId": "miss-order"}]
        )
        await here.handle_batch(SHARD, [report(await only_task(store))])  # render is dispatched
        render = await only_task(store)
        await elsewhere.handle_batch(SHARD, [acceptance(render)])  # this process's record is stale now
        outcomes = await here.handle_batch(SHARD, [report(render), cancel_request(run)])
        assert store.conflicts, "the result was decided from the stale record first"
        assert [o.verdict.value if o.verdict else None for o in outcomes] == ["applied", "applied"]
        kinds = [e["kind"] for e in await store.history(SHARD, run)]
        completed = [i for i, kind in enumerate(kinds) if kind == "stage.completed"]
        assert len(completed) == 2 and completed[-1] < kinds.index("cancel.requested"), kinds
        assert "callback.rejected" not in kinds, kinds
        await settled_and_sound(here, store, client, [run], "failed")

    asyncio.run(with_store(main))


def cancel_request(run_id: str) -> Envelope:
    raw = signed_message(
        SIGNER,
        kind=Kind.CANCEL_RUN,
        message_id=f"cancel.run-{uuid.uuid4().hex}",
        run_id=run_id,
        shard=SHARD,
        body=bodies.request("not needed", "operator"),
    )
    return decode(raw, SIGNER, 1_048_576)


def test_a_runs_second_start_in_one_batch_sees_the_run_its_first_created() -> None:
    """Two starts of one run in a batch (a retry naming another plan): the second is decided once the
    first created the run, so no refusal is recorded for a run that exists and runs."""

    async def main(store: CountingStore, client: aioredis.Redis) -> None:
        processor = Processor(store, lambda: int(time.time() * 1000))
        plan = compiled("model-ingest")
        await publish_active(store, plan)
        run = f"kept-{uuid.uuid4().hex[:10]}"
        unpublished = "sha256:" + "0" * 64
        first = start_envelope(SIGNER, run, "model-ingest", plan.digest, {"modelId": "m-1"})
        second = start_envelope(SIGNER, run, "model-ingest", unpublished, {"modelId": "m-1"})
        created, refused = await processor.handle_batch(SHARD, [first, second])
        assert created.verdict is not None and created.verdict.value == "applied"
        assert refused.rejected is not None and refused.rejected[0] == "unknown-definition", refused
        assert not await client.exists(refused_key(store.prefix, run)), (
            "a refusal recorded for a run that runs"
        )
        assert await client.hget(store.keys(SHARD).run(run), "status") == "running"
        await settled_and_sound(processor, store, client, [run], "completed")

    asyncio.run(with_store(main))


def test_a_message_of_a_run_whose_plan_is_missing_is_not_refused_but_goes_back() -> None:
    """Redis lost a run's plan: its messages raise (the shard puts them back on the queue, and its
    delivery limit parks them), rather than being refused and acked, which would lose a result."""

    async def main(store: CountingStore, client: aioredis.Redis) -> None:
        (run,) = await start(
            store, Processor(store, lambda: 1), compiled("model-ingest"), "model-ingest", [{"modelId": "m-2"}]
        )
        lookup = await only_task(store)
        await client.delete(plan_key(store.prefix, compiled("model-ingest").digest))
        fresh = Processor(RedisStore(client, prefix=store.prefix), lambda: 2)  # no plan cached
        with pytest.raises(PlanNotFound):
            await fresh.handle_batch(SHARD, [report(lookup)])
        assert not fresh.records.get(SHARD, run)

    asyncio.run(with_store(main))

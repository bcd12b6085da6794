"""A bag larger than its window sends its items a window at a time (engine, through the in-memory store):
each item is sent exactly once and in order of its index, at most a window and a half are in flight, the
results come out in item order, and every failure path stops the chunks."""

from __future__ import annotations

import random

import pytest

from orchestrator.engine.model import BagRefill, CancelRun, Nudge, Verdict
from orchestrator.wire import ids
from orchestrator.wire.sizes import Limits
from tests.unit.engine_sim import Sim, handler_output
from tests.unit.test_engine import compiled

WINDOW = 8


def bag_sim(count: int, **kwargs: object) -> tuple[Sim, list[str]]:
    plan = compiled("thumbnail-batch")
    sim = Sim(plan.plan, plan.digest, limits=Limits(bag_window=WINDOW), **kwargs)  # type: ignore[arg-type]
    model_ids = [f"m-{i}" for i in range(count)]
    sim.start({"modelIds": model_ids})
    return sim, model_ids


def item_tasks(sim: Sim) -> list[int]:
    return [int(t.body["item"]) for t in sim.tasks if t.body["stage"] == "render-all"]


def in_flight(sim: Sim) -> int:
    return sum(1 for d in sim.pending if d.kind == "task" and d.stage == "render-all")


@pytest.mark.parametrize("count", [WINDOW, WINDOW + 1, 50, 64])
def test_a_bag_sends_each_item_once_a_window_at_a_time_and_completes_in_item_order(count: int) -> None:
    sim, model_ids = bag_sim(count)
    sim.deliver_at(0)  # the start: the first chunk only
    assert item_tasks(sim) == list(range(min(count, WINDOW)))
    most = 0
    rng = random.Random(count)
    while any(d.kind == "task" and d.stage == "render-all" for d in sim.pending):
        most = max(most, in_flight(sim))
        tasks = [i for i, d in enumerate(sim.pending) if d.kind == "task" and d.stage == "render-all"]
        sim.deliver_at(rng.choice(tasks))  # items finish in any order
        while any(d.kind == "event" for d in sim.pending):  # results, refills, the release
            sim.deliver_where(lambda d: d.kind == "event")
    sim.run()

    assert sim.status == "completed"
    assert sorted(item_tasks(sim)) == list(range(count))  # every item sent, none twice
    assert most <= WINDOW + WINDOW // 2
    expected = [handler_output("thumbnail.render@3", {"modelId": m}) for m in model_ids]
    assert sim.snapshot().stages["render-all"].result == expected
    refills = [m for m in sim.published if m.startswith("refill-")]
    chunks = -(-count // WINDOW)
    assert len(refills) == chunks - 1 and all(n == 1 for m, n in sim.published.items() if m in refills)
    (dispatched,) = sim.entries("stage.dispatched", "render-all")
    assert dispatched["detail"].get("sent", count) == min(count, WINDOW)
    later = sim.entries("items.dispatched", "render-all")
    assert [(e["detail"]["first"], e["detail"]["last"]) for e in later] == [
        (i, min(i + WINDOW, count) - 1) for i in range(WINDOW, count, WINDOW)
    ]


def test_a_bag_within_its_window_sends_everything_at_once_as_before() -> None:
    sim, _ = bag_sim(WINDOW)
    sim.deliver_at(0)
    (dispatched,) = sim.entries("stage.dispatched", "render-all")
    assert dispatched["detail"] == {"items": WINDOW, "queue": "tasks.parallel"}
    assert "s:render-all:sent" not in sim.record


def test_a_refill_delivered_again_or_forged_sends_nothing() -> None:
    sim, _ = bag_sim(20)
    sim.deliver_at(0)
    for item in range(WINDOW // 2):  # the arrival that leaves half a window in flight emits the refill
        sim.deliver_task("render-all", item)
    (refill,) = [d for d in sim.pending if isinstance(d.event, BagRefill)]
    first = sim.deliver(refill)
    assert first is not None and first.took_effect and sim.record["s:render-all:sent"] == "16"

    again = sim.deliver(refill)
    assert again is not None and again.verdict is Verdict.DUPLICATE and not again.published
    assert refill.event is not None
    forged = BagRefill("refill-forged", "render-all", refill.event.fence, 16)  # type: ignore[union-attr]
    refused = sim.handle(forged)
    assert refused.verdict is Verdict.INVALID and not refused.published
    assert sorted(item_tasks(sim)) == list(range(16))


def test_an_item_failing_for_good_ends_the_bag_and_no_later_chunk_is_sent() -> None:
    sim, _ = bag_sim(40, fail_items=frozenset({1}))
    sim.deliver_at(0)
    sim.deliver_task("render-all", 1)  # its first attempt fails: a retry after the backoff
    sim.fire_next_timer()
    sim.deliver_task("render-all", 1)  # and its last: the bag fails with half its first chunk out
    assert sim.snapshot().stages["render-all"].status.value == "failed"
    sent = len(item_tasks(sim))
    sim.run()  # the rest of the first chunk reports late; nothing refills the failed bag
    assert sim.status == "failed"
    assert len(item_tasks(sim)) == sent and max(item_tasks(sim)) < WINDOW
    assert not [m for m in sim.published if m.startswith("refill-")]


def test_a_cancelled_run_sends_no_further_chunk() -> None:
    sim, _ = bag_sim(40)
    sim.deliver_at(0)
    for item in range(WINDOW // 2):
        sim.deliver_task("render-all", item)
    (refill,) = [d for d in sim.pending if isinstance(d.event, BagRefill)]
    sim.pending.remove(refill)
    sim.handle(CancelRun("cancel.run-1", "operator"))
    late = sim.deliver(refill)
    assert late is not None and late.verdict is Verdict.LATE and not late.published
    assert max(item_tasks(sim)) < WINDOW


def test_a_nudge_resends_only_sent_items_that_did_not_arrive_and_a_refill_that_is_due() -> None:
    sim, _ = bag_sim(40)
    sim.deliver_at(0)
    for item in range(WINDOW // 2):
        sim.deliver_task("render-all", item)
    # the refill (and the other items in flight) are lost: the reconciler nudges the stranded run
    sim.pending.clear()
    nudged = sim.handle(Nudge("nudge-1"))
    resent = sorted(int(m.body["item"]) for m in nudged.published if m.kind == "task")
    assert resent == list(range(WINDOW // 2, WINDOW))
    fence = sim.snapshot().stages["render-all"].fence
    assert [m.message_id for m in nudged.published if m.kind == "bag.refill"] == [
        ids.refill_id(sim.run_id, "render-all", fence, WINDOW)
    ]
    sim.run()
    assert sim.status == "completed"
    assert sorted(set(item_tasks(sim))) == list(range(40))


def test_a_bag_keeps_its_own_window_whatever_window_later_processes_are_given() -> None:
    """A bag entered with a window of 8 refills by 8 at its own thresholds after the orchestrators were
    restarted with another window: a threshold of the new window could lie behind the items that
    already arrived, and the bag would wait for a refill that never comes."""
    sim, _ = bag_sim(40)
    sim.deliver_at(0)
    for item in range(WINDOW // 2 - 1):
        sim.deliver_task("render-all", item)
    sim.limits = Limits(bag_window=32)  # at = 8 - 16 < 0 if taken from the new setting
    sim.run()
    assert sim.status == "completed"
    assert sorted(item_tasks(sim)) == list(range(40))
    later = sim.entries("items.dispatched", "render-all")
    assert [e["detail"]["first"] for e in later] == [8, 16, 24, 32]
    assert sim.record["s:render-all:window"] == str(WINDOW)


def test_a_window_below_two_is_refused() -> None:
    with pytest.raises(ValueError, match="bag window of 1"):
        Limits(bag_window=1)

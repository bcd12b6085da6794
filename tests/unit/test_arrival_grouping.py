"""A round's arrivals of one run go to Redis together (``saga_arrive_many``), at most
``MAX_ARRIVALS_PER_CALL`` to a call, never mixed with another run's or with another kind of transition;
and an arrival's result is kept as text that reads back to the value the worker sent."""

from __future__ import annotations

import json
import math

from orchestrator.engine import advance
from orchestrator.engine.builder import result_text
from orchestrator.engine.model import StageResult
from orchestrator.engine.plan import typed_plan
from orchestrator.store.redis_store import ARRIVE_MANY, MAX_ARRIVALS_PER_CALL, _grouped
from orchestrator.store.spec import Spec
from orchestrator.wire import ids
from tests.unit.test_engine_chunked_bags import bag_sim

RUN_A = ["run:a", "history:a"]
RUN_B = ["run:b", "history:b"]


def arrival(n: int) -> Spec:
    return Spec("saga_arrive", {"mid": f"result-{n}"})


def shape(calls: list[tuple[Spec, list[str]]]) -> list[tuple[str, int]]:
    """Each call's function and how many transitions it carries."""
    return [(s.function, len(s.body["arrivals"]) if s.function == ARRIVE_MANY else 1) for s, _ in calls]


def test_a_runs_consecutive_arrivals_share_a_call_and_nothing_else_does() -> None:
    calls = [
        (arrival(1), RUN_A),
        (arrival(2), RUN_A),
        (arrival(3), RUN_A),
        (Spec("saga_transition", {"mid": "x"}), RUN_A),
        (arrival(4), RUN_A),
        (arrival(5), RUN_B),
        (arrival(6), RUN_B),
    ]
    grouped = _grouped(calls)
    assert shape(grouped) == [(ARRIVE_MANY, 3), ("saga_transition", 1), ("saga_arrive", 1), (ARRIVE_MANY, 2)]
    assert [m["mid"] for m in grouped[0][0].body["arrivals"]] == ["result-1", "result-2", "result-3"]
    assert grouped[3][1] == RUN_B


def test_a_call_carries_at_most_its_share_of_arrivals() -> None:
    count = 2 * MAX_ARRIVALS_PER_CALL + 7
    grouped = _grouped([(arrival(n), RUN_A) for n in range(count)])
    assert shape(grouped) == [
        (ARRIVE_MANY, MAX_ARRIVALS_PER_CALL),
        (ARRIVE_MANY, MAX_ARRIVALS_PER_CALL),
        (ARRIVE_MANY, 7),
    ]
    mids = [m["mid"] for s, _ in grouped for m in s.body["arrivals"]]
    assert mids == [f"result-{n}" for n in range(count)]  # in order, none lost


def kept_text(result: object) -> str:
    """The text a bag keeps for item 0's successful result ``result``."""
    sim, _ = bag_sim(3)
    sim.deliver_at(0)
    snapshot = sim.snapshot()
    (task,) = [t for t in sim.tasks if t.body["item"] == 0]
    fence = snapshot.stages["render-all"].fence
    event = StageResult(ids.result_id(task.message_id), "render-all", 1, fence, True, result, item=0)
    decision = advance(typed_plan(sim.plan), sim.digest, snapshot, event, 0)
    assert decision.arrival is not None and decision.arrival.result is not None
    return decision.arrival.result


def test_an_item_result_is_kept_as_text_that_reads_back_to_it() -> None:
    value = {"thumbnailUri": "thumbs/é-1e-05.png"}
    assert json.loads(kept_text(value)) == value
    # a non-finite number is not written as null (as orjson would): it reads back as it came
    back = json.loads(result_text({"score": math.nan, "other": None, "size": 1e-05}))
    assert math.isnan(back["score"]) and back["other"] is None and back["size"] == 1e-05

"""Property tests: every shipped definition, under hostile delivery, keeps the invariants of DESIGN.md §3.

For each definition a run is driven by the simulator in ``engine_sim`` while Hypothesis chooses what
happens next: deliver a RANDOM pending message (tasks, results and releases in any order), deliver an
already delivered one again (a DUPLICATE, 2-3 deliveries in all), or inject a STALE result or release
(a fence from an earlier epoch). Handlers fail where Hypothesis says so, always or only when their task
is run a second time (a flaky redelivery). After quiescence the run must be terminal and:

* each join/map barrier released at most once, and exactly once on a completed run that reached it;
* at most one accepted report per (stage, attempt) (per item, for a map);
* a map's result is the list of its items' results in item order;
* finalisers ran once each, in declared order, and the run ended once, after them;
* the outbox held exactly what each transition published, and no message was published twice;
* replaying the same event sequence against a fresh store gives identical histories and records.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from collections import Counter
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.compiler import CompiledPlan, compile_text
from orchestrator.engine.model import BarrierReleased, FinaliserResult, StageResult, StageStatus, Verdict
from tests.conftest import DEFINITIONS, DEMO_REGISTRY, ROOT
from tests.unit.engine_sim import Sim, replay

SETTINGS = settings(max_examples=60, deadline=None)
FORMATS = ["glb", "gltf", "obj", "stl", "fbx", "usdz", "", "GLB"]
ACCEPTED_FORMATS = {"glb", "gltf", "obj", "stl"}


@functools.cache
def compiled(name: str) -> CompiledPlan:
    path = DEFINITIONS / f"{name}.yaml"
    return compile_text(path.read_text(encoding="utf-8"), str(path), DEMO_REGISTRY)


def new_sim(name: str, **kwargs: Any) -> Sim:
    plan = compiled(name)
    return Sim(plan.plan, plan.digest, **kwargs)


# ---- driving ----------------------------------------------------------------------------------------


@st.composite
def schedules(draw: st.DrawFn) -> dict[str, int]:
    return {"duplicates": draw(st.integers(0, 8)), "stale": draw(st.integers(0, 4))}


def chaos(data: st.DataObject, sim: Sim, context: dict[str, Any]) -> Sim:
    """Drive ``sim`` to quiescence, letting Hypothesis pick every delivery."""
    budget = data.draw(schedules(), label="budget")
    sim.start(context)
    stale = 0
    for _ in range(10_000):
        if not sim.pending and not sim.store.timers:
            return sim
        options = ["deliver"] if sim.pending else []
        if sim.store.timers:
            options.append("timer")  # time jumps to the next timer: it may race the result it guards
        if budget["duplicates"] and sim.delivered:
            options.append("duplicate")
        if budget["stale"] and sim.tasks:
            options.append("stale")
        action = data.draw(st.sampled_from(options))
        if action == "deliver":
            sim.deliver_at(data.draw(st.integers(0, len(sim.pending) - 1)))
        elif action == "timer":
            sim.fire_next_timer()
        elif action == "duplicate":
            budget["duplicates"] -= 1
            again = data.draw(st.sampled_from(sim.delivered))
            for _ in range(data.draw(st.integers(1, 2))):
                sim.deliver(again)
        else:
            budget["stale"] -= 1
            stale += 1
            inject_stale(data, sim, stale)
    raise AssertionError("the run did not quiesce")


def inject_stale(data: st.DataObject, sim: Sim, n: int) -> None:
    """A result (or a barrier release) with a fence of an epoch that never existed: rejected, no effect."""
    task = data.draw(
        st.sampled_from([t for t in sim.tasks if not str(t.body["stage"]).startswith("fin")] or sim.tasks)
    )
    body = task.body
    stage = str(body["stage"])
    barriers = [s for s, spec in sim.plan["stages"].items() if spec["type"] in ("join", "map")]
    event: StageResult | BarrierReleased | FinaliserResult
    if barriers and data.draw(st.booleans(), label="stale release"):
        event = BarrierReleased(f"stale-release-{n}", data.draw(st.sampled_from(barriers)), "0.9")
    elif stage.startswith("finaliser:"):
        event = FinaliserResult(
            f"stale-{n}", int(stage.partition(":")[2]), "0.f9", True, {}, None, sim.digest
        )
    else:
        ok = data.draw(st.booleans(), label="stale ok")
        event = StageResult(
            f"stale-{n}",
            stage,
            int(body["attempt"]),
            "0.9",
            ok,
            {"stale": True} if ok else None,
            None if ok else "RuntimeError: stale",
            body["item"],
            sim.digest,
        )
    record = dict(sim.record)
    handled = sim.handle(event)
    assert handled.verdict is not Verdict.APPLIED, handled  # stale, late, or invalid (a barrier not reached)
    assert not handled.published
    assert sim.record == record, f"a stale {event} changed the run"


# ---- the invariants -----------------------------------------------------------------------------------


def accepted_reports(sim: Sim) -> list[StageResult | FinaliserResult]:
    return [
        h.event for h in sim.handled if h.took_effect and isinstance(h.event, StageResult | FinaliserResult)
    ]


def gave_up(sim: Sim) -> bool:
    """A stage's last attempt failed or timed out with no retry left (or a finaliser failed)."""
    snapshot = sim.snapshot()
    final_failures = {StageStatus.FAILED, StageStatus.TIMED_OUT}
    return snapshot.finaliser_failed or any(r.status in final_failures for r in snapshot.stages.values())


def check_retries(sim: Sim) -> None:
    """Attempts stay within the policy; every scheduled retry is dispatched, unless the run ended first;
    nothing but rejected or acknowledged callbacks happens after the run ended."""
    history = sim.history
    for name, stage in sim.plan["stages"].items():
        dispatches = [h for h in history if h["kind"] == "stage.dispatched" and h["stage"] == name]
        attempts = [int(h["attempt"]) for h in dispatches]
        if attempts:
            assert max(attempts) <= stage["retry"]["max_attempts"], (name, attempts)
            assert attempts == list(range(1, len(attempts) + 1)), (name, attempts)
    for i, h in enumerate(history):
        if h["kind"] == "retry.scheduled":
            later = history[i + 1 :]
            next_attempt = str(int(h["attempt"]) + 1)
            item = h["detail"].get("item")
            kind = "stage.dispatched" if item is None else "item.dispatched"
            dispatched = any(
                e["kind"] == kind
                and e["stage"] == h["stage"]
                and e["attempt"] == next_attempt
                and e["detail"].get("item") == item
                for e in later
            )
            assert dispatched or any(e["kind"] == "intent.set" for e in later), h
    end = next(i for i, h in enumerate(history) if h["kind"] in ("run.completed", "run.failed"))
    after = {h["kind"] for h in history[end + 1 :]}
    assert after <= {"callback.rejected", "cancellation.acknowledged"}, after


def check_compensations(sim: Sim) -> None:
    """A failed run undoes every completed stage that declares a compensation, newest first, each once,
    before its finalisers; a completed run undoes nothing."""
    history = sim.history
    dispatched = [h["stage"].partition(":")[2] for h in history if h["kind"] == "compensation.dispatched"]
    if sim.record["intent"] == "completed":
        assert not dispatched
        return
    completed = [
        h["stage"]
        for h in history
        if h["kind"] in ("stage.completed",) and sim.plan["stages"][h["stage"]].get("compensate")
    ]
    assert dispatched == list(reversed(completed)), (dispatched, completed)
    outcomes = [h for h in history if h["kind"] in ("compensation.completed", "compensation.failed")]
    assert [h["stage"].partition(":")[2] for h in outcomes] == dispatched
    ends = [i for i, h in enumerate(history) if h["kind"] in ("finaliser.dispatched", "run.failed")]
    assert all(history.index(h) < ends[0] for h in outcomes)  # before the finalisers (or the end)
    for name in dispatched:
        label = f"compensate:{name}"
        undone = any(h["kind"] == "compensation.completed" and h["stage"] == label for h in outcomes)
        assert (sim.record[f"s:{name}:status"] == "compensated") == undone


def check_invariants(sim: Sim) -> None:
    plan, history = sim.plan, sim.history
    kinds = [h["kind"] for h in history]

    # quiescent and terminal
    assert not sim.pending
    assert sim.status in ("completed", "failed"), sim.status
    assert sim.record["intent"] in ("completed", "failed")
    assert kinds.count("intent.set") == 1

    # the store never saw a conflict in a sequential run; every message id took effect at most once
    assert all(h.conflicts == 0 for h in sim.handled)
    effective = Counter(h.event.message_id for h in sim.handled if h.took_effect)
    assert all(n == 1 for n in effective.values()), effective

    # barriers: released at most once; exactly once on a completed run that reached them
    stages = sim.snapshot().stages
    for name, stage in plan["stages"].items():
        if stage["type"] == "join":
            released = sum(1 for h in history if h["kind"] == "join.released" and h["stage"] == name)
            reached = any(h["kind"] == "fork.released" and h["stage"] == stage["fork"] for h in history)
            assert released <= 1, (name, released)
            if sim.status == "completed" and reached:
                assert released == 1, name
        if stage["type"] == "map":
            released = sum(1 for h in history if h["kind"] == "stage.completed" and h["stage"] == name)
            assert released <= 1, (name, released)
            if sim.status == "completed" and name in stages:
                assert released == 1, name

    # at most one accepted report per (stage, attempt), per item for a map
    # (a timed-out attempt is settled too: its later result is stale)
    outcome_kinds = ("stage.completed", "stage.failed", "stage.timed_out")
    settled = Counter(
        (h["stage"], h["attempt"], h["detail"].get("item")) for h in history if h["kind"] in outcome_kinds
    )
    assert all(n == 1 for n in settled.values()), settled
    reports = Counter(
        (
            type(r).__name__,
            getattr(r, "stage", getattr(r, "index", None)),
            getattr(r, "attempt", None),
            getattr(r, "item", None),
        )
        for r in accepted_reports(sim)
    )
    assert all(n == 1 for n in reports.values()), reports

    check_retries(sim)
    check_compensations(sim)

    # a map's result: its items' results, in item order
    for name, stage in plan["stages"].items():
        if stage["type"] == "map" and name in stages and stages[name].status.value == "completed":
            values = {item: value for s, item, ok, value in sim.calls if s == name and ok}
            assert stages[name].result == [values[i] for i in range(len(values))]

    # finalisers: once each, in declared order, all attempted; the run ends once, after them
    names = [f"finaliser:{i}" for i in range(len(plan.get("finalisers") or []))]
    assert [h["stage"] for h in history if h["kind"] == "finaliser.dispatched"] == names
    outcomes = [h for h in history if h["kind"] in ("finaliser.completed", "finaliser.failed")]
    assert [h["stage"] for h in outcomes] == names
    ends = [i for i, h in enumerate(history) if h["kind"] in ("run.completed", "run.failed")]
    assert len(ends) == 1 and history[ends[0]]["kind"] == f"run.{sim.status}"
    assert all(i < ends[0] for i, h in enumerate(history) if h in outcomes)
    finaliser_failed = any(h["kind"] == "finaliser.failed" for h in outcomes)
    assert (sim.status == "completed") == (sim.record["intent"] == "completed" and not finaliser_failed)

    # nothing applies after the run ended
    finished_at = next(
        i for i, h in enumerate(sim.handled) if any(m.kind == "run.finished" for m in h.published)
    )
    assert not any(h.took_effect for h in sim.handled[finished_at + 1 :])

    # the outbox: everything published was confirmed, nothing was published twice, one end event
    assert sim.store.outbox == {}
    assert all(n == 1 for n in sim.published.values()), sim.published
    assert [m.body["state"] for m in sim.finished] == [sim.status]
    for cancel in sim.cancels:
        # cancelled with the run, or timed out: a timeout asks the worker to stop as well
        assert stages[str(cancel.body["stage"])].status.value in ("cancelled", "timed-out")

    # golden replay: the same events against a fresh store give the same run
    store, handled = replay(plan, sim.digest, sim.run_id, sim.log)
    again = store.runs[sim.run_id]
    original = sim.store.runs[sim.run_id]
    assert again.history == original.history
    assert again.record == original.record
    assert again.barriers == original.barriers
    assert again.applied == original.applied
    assert [h.decision for h in handled] == [h.decision for h in sim.handled]
    assert set(store.outbox) == set(sim.published)


# ---- one property per definition ----------------------------------------------------------------------

MODEL_IDS = st.builds(
    lambda cached, rest: ("cached-" if cached else "m-") + rest,
    st.booleans(),
    st.text(alphabet="abcxyz019-", min_size=1, max_size=8),
)


@SETTINGS
@given(
    data=st.data(),
    model_id=MODEL_IDS,
    fail=st.sets(
        st.sampled_from(
            [
                "cache-lookup",
                "render-thumbnail",
                "semantic-analysis",
                "technical-metadata",
                "publish",
                "finaliser:0",
            ]
        ),
        max_size=2,
    ),
    flaky=st.sets(st.sampled_from(["semantic-analysis", "technical-metadata", "publish"]), max_size=2),
)
def test_model_ingest_keeps_its_invariants_under_chaos(
    data: st.DataObject, model_id: str, fail: set[str], flaky: set[str]
) -> None:
    sim = chaos(
        data,
        new_sim("model-ingest", fail_stages=frozenset(fail), flaky_stages=frozenset(flaky)),
        {"modelId": model_id},
    )
    check_invariants(sim)

    # a handler failed, or an attempt timed out (time jumped ahead of its result)
    called_failed = any(not ok for _, _, ok, _ in sim.calls) or bool(sim.entries("stage.timed_out"))
    assert (sim.status == "failed") == gave_up(sim)
    if not called_failed:
        assert sim.status == "completed"
    if sim.record["intent"] == "completed":
        assert sim.output == {"modelId": model_id, "catalogueId": f"cat-{model_id}"}
        took = [h["detail"]["next"] for h in sim.entries("decision.taken", "cache-route")]
        assert took == (["publish"] if model_id.startswith("cached-") else ["render-thumbnail"])


@SETTINGS
@given(
    data=st.data(),
    model_ids=st.lists(st.text(alphabet="abc123", min_size=1, max_size=4), max_size=30),
    fail=st.sets(st.sampled_from(["render-all", "finaliser:0"]), max_size=1),
    flaky=st.booleans(),
)
def test_thumbnail_batch_keeps_its_invariants_under_chaos(
    data: st.DataObject, model_ids: list[str], fail: set[str], flaky: bool
) -> None:
    items = data.draw(st.sets(st.integers(0, max(len(model_ids) - 1, 0)), max_size=2)) if model_ids else set()
    sim = new_sim(
        "thumbnail-batch",
        fail_stages=frozenset(fail),
        fail_items=frozenset(items),
        flaky_stages=frozenset({"render-all"} if flaky else ()),
    )
    chaos(data, sim, {"modelIds": model_ids})
    check_invariants(sim)

    assert (sim.status == "failed") == gave_up(sim)
    if not any(not ok for _, _, ok, _ in sim.calls):
        assert sim.status == "completed"
    if sim.record["intent"] == "completed":
        expected = [{"thumbnailUri": f"thumbs/{m}.png"} for m in model_ids]
        assert sim.snapshot().stages["render-all"].result == expected
        assert sim.output == {"count": len(model_ids), "thumbnails": expected}


@SETTINGS
@given(
    data=st.data(),
    size=st.one_of(st.integers(-3, 5000), st.floats(-1.0, 5000.0, allow_nan=False)),
    fmt=st.sampled_from(FORMATS),
)
def test_ingest_triage_keeps_its_invariants_under_chaos(data: st.DataObject, size: float, fmt: str) -> None:
    sim = chaos(data, new_sim("ingest-triage"), {"sizeMb": size, "format": fmt})
    check_invariants(sim)

    if size < 0:
        assert sim.record["reason"].startswith("invalid context: ")
    expected = size >= 0 and size <= 2048 and fmt in ACCEPTED_FORMATS
    assert sim.status == ("completed" if expected else "failed")
    assert not sim.tasks
    if expected:
        assert sim.output == {"format": fmt}


@SETTINGS
@given(
    data=st.data(),
    index=st.text(min_size=1, max_size=10),
    fail=st.sets(st.sampled_from(["snapshot", "rebuild", "swap", "finaliser:0"]), max_size=2),
    flaky=st.sets(st.sampled_from(["snapshot", "rebuild", "swap"]), max_size=1),
)
def test_catalogue_reindex_keeps_its_invariants_under_chaos(
    data: st.DataObject, index: str, fail: set[str], flaky: set[str]
) -> None:
    sim = new_sim("catalogue-reindex", fail_stages=frozenset(fail), flaky_stages=frozenset(flaky))
    chaos(data, sim, {"index": index})
    check_invariants(sim)

    assert (sim.status == "failed") == gave_up(sim)
    if sim.record["intent"] == "completed":
        assert sim.output == {"index": index, "lastStep": "swap"}
        order = [h["stage"] for h in sim.entries("stage.completed")]
        assert order == ["snapshot", "rebuild", "swap"]


# ---- determinism across processes -----------------------------------------------------------------------

SCENARIOS = """
import json
from tests.unit.test_engine_properties import new_sim
out = []
for name, ctx, fail in [
    ("model-ingest", {"modelId": "m-1"}, {"technical-metadata"}),
    ("model-ingest", {"modelId": "m-2"}, set()),
    ("thumbnail-batch", {"modelIds": ["a", "b", "c", "d", "e"]}, set()),
]:
    sim = new_sim(name, fail_stages=frozenset(fail))
    sim.start(ctx)
    while sim.pending:
        sim.deliver_at(len(sim.pending) - 1)
    out.append({"history": sim.history, "record": sim.record, "published": sorted(sim.published)})
print(json.dumps(out, sort_keys=True))
"""


def test_the_same_events_give_the_same_history_whatever_the_hash_seed() -> None:
    """Invariant 9 across processes: no decision depends on set or dict iteration order of a process."""
    outputs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(ROOT)}
        done = subprocess.run(
            [sys.executable, "-c", SCENARIOS], capture_output=True, text=True, cwd=ROOT, env=env, check=False
        )
        assert done.returncode == 0, done.stderr
        outputs.append(json.loads(done.stdout))
    assert outputs[0] == outputs[1]


# ---- shrunk counterexamples, kept as regular tests ---------------------------------------------------


def test_counterexample_flaky_redelivery_of_a_map_item_that_already_arrived() -> None:
    """Shrunk by ``test_thumbnail_batch_keeps_its_invariants_under_chaos`` (flaky handler): item 0 arrives,
    its task is redelivered twice and the handler now fails; the failure report carries the SAME result id
    as the success already counted, and it must not fail the map (message id applied twice)."""
    sim = new_sim("thumbnail-batch", flaky_stages=frozenset({"render-all"}))
    sim.start({"modelIds": ["1", "1", "1"]})
    for _ in range(5):
        sim.deliver_at(0)  # the start, the three tasks, then item 0's result
    task0 = sim.delivered[1]
    assert task0.kind == "task" and task0.item == 0
    sim.deliver(task0)
    sim.deliver(task0)  # redelivered twice: the handler fails both times
    sim.deliver_at(0)  # item 1's result
    sim.deliver_at(1)  # item 0's failure report
    sim.run()

    check_invariants(sim)
    assert sim.status == "completed"

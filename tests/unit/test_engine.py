"""The pure engine with the in-memory store, driven by the simulator in ``engine_sim``.

Each test starts a run of a real (or inline) definition, delivers what the run publishes and checks the
run record, its history and what was published. No services.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import pytest

from orchestrator.compiler import CompiledPlan, compile_text
from orchestrator.engine import advance
from orchestrator.engine.model import StageResult, StartRun, Verdict
from orchestrator.store.memory import MemoryStore
from orchestrator.store.replies import APPLIED, DUPLICATE, NO_RUN
from orchestrator.wire import ids
from orchestrator.wire.kinds import Kind
from tests.conftest import DEFINITIONS, DEMO_REGISTRY, compile_yaml
from tests.unit.engine_sim import SHARD, Handled, Sim, handler_output, report


@functools.cache
def compiled(name: str) -> CompiledPlan:
    path = DEFINITIONS / f"{name}.yaml"
    return compile_text(path.read_text(encoding="utf-8"), str(path), DEMO_REGISTRY)


def sim_for(name: str, context: dict[str, Any] | None = None, **kwargs: Any) -> Sim:
    plan = compiled(name)
    sim = Sim(plan.plan, plan.digest, **kwargs)
    if context is not None:
        sim.start(context)
    return sim


def sim_of(yaml: str, context: dict[str, Any], **kwargs: Any) -> Sim:
    plan = compile_yaml(yaml)
    sim = Sim(plan.plan, plan.digest, **kwargs)
    sim.start(context)
    return sim


def reason(sim: Sim) -> str:
    return sim.record.get("reason", "")


def stage_state(sim: Sim, stage: str) -> str:
    return sim.snapshot().stages[stage].status.value


def late(handled: Handled | None) -> bool:
    return handled is not None and handled.verdict is Verdict.LATE


# ---- model-ingest: the happy paths --------------------------------------------------------------------


def test_model_ingest_cache_miss_runs_every_stage_and_completes_with_output() -> None:
    sim = sim_for("model-ingest", {"modelId": "miss-1"})
    sim.run()

    assert sim.status == "completed"
    assert sim.record["intent"] == "completed"
    assert sim.output == {"modelId": "miss-1", "catalogueId": "cat-miss-1"}
    stages = sim.snapshot().stages
    for name in ("cache-lookup", "render-thumbnail", "semantic-analysis", "technical-metadata", "publish"):
        assert stages[name].status.value == "completed", name
    assert stages["derive-join"].status.value == "completed"
    assert stages["publish"].result == {"published": True, "catalogueId": "cat-miss-1"}
    kinds = sim.kinds()
    assert kinds[0] == "run.started" and kinds[-1] == "run.completed"
    assert kinds.count("fork.released") == 1
    assert kinds.count("branch.arrived") == 2
    assert kinds.count("join.released") == 1
    assert kinds.count("finaliser.completed") == 1
    assert [e["detail"]["next"] for e in sim.entries("decision.taken")] == ["render-thumbnail"]
    # the run announced its end exactly once, with its output
    assert len(sim.finished) == 1
    assert sim.finished[0].body["state"] == "completed"
    assert sim.finished[0].body["output"] == sim.output
    assert not sim.cancels
    assert all(n == 1 for n in sim.published.values())


def test_model_ingest_cache_hit_skips_rendering_and_the_fork() -> None:
    sim = sim_for("model-ingest", {"modelId": "cached-7"})
    sim.run()

    assert sim.status == "completed"
    assert sim.output == {"modelId": "cached-7", "catalogueId": "cat-cached-7"}
    stages = sim.snapshot().stages
    skipped = {"render-thumbnail", "derive-fork", "semantic-analysis", "technical-metadata", "derive-join"}
    assert not skipped & set(stages)
    assert stages["publish"].status.value == "completed"
    assert stages["cache-lookup"].result == {"modelId": "cached-7", "hit": True}
    assert [t.body["stage"] for t in sim.tasks] == ["cache-lookup", "publish", "finaliser:0"]
    assert "fork.released" not in sim.kinds()
    assert [e["detail"]["next"] for e in sim.entries("decision.taken")] == ["publish"]


def test_tasks_carry_the_run_identity_and_the_bound_input() -> None:
    sim = sim_for("model-ingest", {"modelId": "m-1"})
    sim.deliver_at(0)  # the start

    (task,) = sim.tasks
    plan = compiled("model-ingest")
    assert task.route == ("task", "tasks.actions")
    assert task.message_id == ids.message_id("task", "run-1", "cache-lookup", "1.1", "")
    assert task.body == {
        "run_id": "run-1",
        "shard": SHARD,
        "stage": "cache-lookup",
        "attempt": 1,
        "fence": "1.1",
        "item": None,
        "contract": "cache.lookup@1",
        "digest": plan.digest,
        "tenant": "default",
        "input": {"modelId": "m-1"},
        "idempotency_key": task.message_id,
    }
    assert sim.record["digest"] == plan.digest
    assert sim.record["definition"] == "model-ingest"


# ---- failures ---------------------------------------------------------------------------------------


def test_failing_stage_fails_the_run_names_the_stage_and_still_runs_the_finaliser() -> None:
    sim = sim_for("model-ingest", {"modelId": "broken-1"}, fail_stages=frozenset({"render-thumbnail"}))
    sim.run()

    assert sim.status == "failed"
    assert sim.record["intent"] == "failed"
    assert reason(sim).startswith("render-thumbnail: ")
    assert "injected failure" in reason(sim)
    assert stage_state(sim, "render-thumbnail") == "failed"
    assert "derive-fork" not in sim.snapshot().stages  # nothing after the failed stage started
    # the finaliser ran, told about the failure
    finaliser = [t for t in sim.tasks if t.body["stage"] == "finaliser:0"]
    assert len(finaliser) == 1
    assert finaliser[0].body["input"]["intent"] == "failed"
    assert finaliser[0].body["input"]["reason"] == reason(sim)
    assert sim.kinds()[-3:] == ["finaliser.dispatched", "finaliser.completed", "run.failed"]
    assert sim.finished[0].body["state"] == "failed"
    assert sim.finished[0].body["reason"] == reason(sim)


def test_failing_finaliser_turns_a_completed_intent_into_a_failed_run() -> None:
    sim = sim_for("model-ingest", {"modelId": "m-1"}, fail_stages=frozenset({"finaliser:0"}))
    sim.run()

    assert sim.record["intent"] == "completed"
    assert sim.record["finaliser_failed"] == "1"
    assert sim.status == "failed"
    assert len(sim.entries("finaliser.failed", "finaliser:0")) == 1
    assert "finaliser.completed" not in sim.kinds()
    assert sim.kinds()[-1] == "run.failed"
    assert sim.finished[0].body["state"] == "failed"


def test_failing_fork_branch_cancels_its_sibling_whose_later_result_is_late() -> None:
    sim = sim_for("model-ingest", {"modelId": "m-1"}, fail_stages=frozenset({"semantic-analysis"}))
    sim.deliver_at(0)
    sim.deliver_task("cache-lookup")
    sim.deliver_task("render-thumbnail")
    assert sorted(sim.pending_tasks()) == ["semantic-analysis", "technical-metadata"]

    # the failing branch reports first, while its sibling is still out
    sim.deliver_task("semantic-analysis")

    assert sim.record["intent"] == "failed"
    assert reason(sim).startswith("semantic-analysis: ")
    assert stage_state(sim, "semantic-analysis") == "failed"
    assert stage_state(sim, "technical-metadata") == "cancelled"
    (cancel,) = sim.entries("cancellation.requested")
    assert cancel["stage"] == "technical-metadata"
    assert cancel["detail"] == {"fence": "1.1"}
    assert [c.body for c in sim.cancels] == [
        {"run_id": "run-1", "stage": "technical-metadata", "fence": "1.1"}
    ]
    assert sim.cancels[0].route == ("events", "cancel.run-1")

    # the sibling's result arrives after all: late, recorded, no effect
    before = dict(sim.record)
    handled = sim.deliver_task("technical-metadata")
    assert late(handled)
    assert sim.record == before
    assert sim.history[-1]["kind"] == "callback.rejected"
    assert sim.history[-1]["detail"]["reason"] == "late"

    sim.run()
    assert sim.status == "failed"
    assert "join.released" not in sim.kinds()
    assert "publish" not in sim.snapshot().stages


@pytest.mark.parametrize("first", ["semantic-analysis", "technical-metadata"])
def test_join_releases_once_whichever_branch_arrives_last(first: str) -> None:
    sim = sim_for("model-ingest", {"modelId": "m-1"})
    sim.deliver_at(0)
    sim.deliver_task("cache-lookup")
    sim.deliver_task("render-thumbnail")
    other = "technical-metadata" if first == "semantic-analysis" else "semantic-analysis"

    one = sim.deliver_task(first)
    assert one is not None and one.detail == "1" and not one.published  # one branch still out
    two = sim.deliver_task(other)
    assert two is not None and two.detail == "0"
    # the last branch's own transition releases the join: the successor's task, no release message
    assert [(m.kind, m.body.get("stage")) for m in two.published] == [(Kind.TASK, "publish")]
    assert sim.kinds()[-3:] == ["branch.arrived", "join.released", "stage.dispatched"]
    sim.run()

    assert sim.status == "completed"
    assert len(sim.entries("join.released")) == 1
    assert [e["detail"]["branch"] for e in sim.entries("branch.arrived")] == [first, other]


NESTED_JOINS = """
    name: nested-joins
    version: "1.0.0"
    entry: outer
    stages:
      - name: outer
        type: fork
        branches: [inner, c]
      - name: inner
        type: fork
        branches: [a, b]
      - name: a
        type: worker
        queue: metadata
        worker: metadata.extract@2
        input: { modelId: "${context.modelId}" }
        on_success: ij
        on_failure: failed
      - name: b
        type: worker
        queue: analysis
        worker: semantic.analyse@4
        input: { modelId: "${context.modelId}" }
        on_success: ij
        on_failure: failed
      - name: ij
        type: join
        required: [a, b]
        on_success: oj
      - name: c
        type: worker
        queue: metadata
        worker: metadata.extract@2
        input: { modelId: "${context.modelId}" }
        on_success: oj
        on_failure: failed
      - name: oj
        type: join
        required: [inner, c]
        on_success: completed
"""


@pytest.mark.parametrize("order", [(0, 0, 0), (2, 1, 0), (1, 0, 0), (0, 1, 0)])
def test_a_join_leading_to_another_join_is_released_by_a_message_and_both_count_every_branch(
    order: tuple[int, ...],
) -> None:
    """A transition carries one arrival: the inner join's release enters the outer join, so the inner
    join's last branch must not release it in its own transition (its arrival would be replaced by the
    outer one's, and the inner count left at 1). The outer join, which leads nowhere but the end, is."""
    plan = compile_yaml(NESTED_JOINS)
    assert plan.typed.released_inline == frozenset({"oj"})
    sim = Sim(plan.plan, plan.digest)
    sim.start({"modelId": "m-1"})
    sim.deliver_at(0)
    for i in order:
        sim.deliver_at(min(i, len(sim.pending) - 1))
    sim.run()

    assert sim.status == "completed"
    assert (sim.record["b:ij"], sim.record["b:oj"]) == ("0", "0")
    members = sim.store.runs[sim.run_id].barriers
    assert (set(members["ij"]), set(members["oj"])) == ({"a", "b"}, {"inner", "c"})
    assert [e["stage"] for e in sim.entries("join.released")].count("ij") == 1
    assert [e["stage"] for e in sim.entries("join.released")].count("oj") == 1


# ---- map stages ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("count", [0, 1, 50])
def test_map_results_are_in_item_order_whatever_the_arrival_order(count: int) -> None:
    model_ids = [f"m-{i}" for i in range(count)]
    sim = sim_for("thumbnail-batch", {"modelIds": model_ids})
    sim.deliver_at(0)
    assert sorted(d.item for d in sim.pending if d.stage == "render-all") == list(range(count))  # type: ignore[type-var]

    for item in reversed(range(count)):  # the last item first
        sim.deliver_task("render-all", item)
    sim.run()

    expected = [handler_output("thumbnail.render@3", {"modelId": m}) for m in model_ids]
    assert sim.status == "completed"
    assert sim.snapshot().stages["render-all"].result == expected
    assert sim.output == {
        "count": count,
        "thumbnails": [{"thumbnailUri": f"thumbs/{m}.png"} for m in model_ids],
    }
    assert len(sim.entries("stage.completed", "render-all")) == 1
    assert sum(1 for m in sim.published if m.startswith("release-")) == (1 if count else 0)


def test_empty_map_completes_in_the_start_transition() -> None:
    sim = sim_for("thumbnail-batch", {"modelIds": []})
    handled = sim.deliver_at(0)

    assert handled is not None and handled.took_effect
    assert [m.body["stage"] for m in handled.published if m.kind == "task"] == ["finaliser:0"]
    assert sim.record["intent"] == "completed"
    (done,) = sim.entries("stage.completed", "render-all")
    assert done["detail"] == {"items": 0}
    assert sim.snapshot().stages["render-all"].result == []
    sim.run()
    assert sim.status == "completed"
    assert sim.output == {"count": 0, "thumbnails": []}


def test_map_dispatches_one_task_per_item_with_the_item_bound() -> None:
    sim = sim_for("thumbnail-batch", {"modelIds": ["a", "b", "c"]})
    sim.deliver_at(0)

    tasks = [t for t in sim.tasks if t.body["stage"] == "render-all"]
    assert [(t.body["item"], t.body["input"]) for t in tasks] == [
        (0, {"modelId": "a"}),
        (1, {"modelId": "b"}),
        (2, {"modelId": "c"}),
    ]
    assert len({t.message_id for t in tasks}) == 3
    assert all(t.route == ("task", "tasks.parallel") for t in tasks)
    (dispatched,) = sim.entries("stage.dispatched", "render-all")
    assert dispatched["detail"] == {"items": 3, "queue": "tasks.parallel"}
    assert sim.record["b:render-all"] == "3"


def test_a_map_item_that_keeps_failing_is_retried_alone_then_fails_the_map_and_the_run() -> None:
    sim = sim_for("thumbnail-batch", {"modelIds": ["a", "b", "c", "d"]}, fail_items=frozenset({2}))
    sim.deliver_at(0)
    sim.deliver_task("render-all", 0)
    first = sim.deliver_task("render-all", 2)
    # thumbnail-batch allows 2 attempts: only item 2 waits for its backoff, the map stays open
    assert first is not None and first.took_effect
    assert stage_state(sim, "render-all") == "dispatched"
    (scheduled,) = sim.entries("retry.scheduled", "render-all")
    assert scheduled["detail"]["item"] == 2 and scheduled["detail"]["next_attempt"] == 2
    sim.fire_next_timer()
    retried = [t for t in sim.tasks if t.body["item"] == 2]
    assert [t.body["attempt"] for t in retried] == [1, 2]
    assert retried[0].message_id != retried[1].message_id  # a new idempotency key for the new attempt
    failed = sim.deliver_task("render-all", 2)

    assert failed is not None and failed.took_effect
    assert stage_state(sim, "render-all") == "failed"
    assert sim.snapshot().stages["render-all"].error.startswith("item 2: InjectedFailure")  # type: ignore[union-attr]
    assert reason(sim).startswith("render-all: item 2: ")
    assert [e["detail"]["item"] for e in sim.entries("stage.failed", "render-all")] == [2, 2]

    # the remaining items report after the intent: late, and never released
    assert late(sim.deliver_task("render-all", 1))
    assert late(sim.deliver_task("render-all", 3))
    sim.run()
    assert sim.status == "failed"
    assert not any(m.startswith("release-") for m in sim.published)
    assert "stage.completed" not in sim.kinds()


def test_a_map_item_that_fails_once_is_retried_alone_and_the_map_completes_in_order() -> None:
    ids_ = ["a", "b", "c"]
    sim = sim_for("thumbnail-batch", {"modelIds": ids_}, fail_items=frozenset({1}))
    sim.deliver_at(0)
    sim.deliver_task("render-all", 1)  # attempt 1 of item 1 fails
    sim.fail_items = frozenset()  # the next one will pass
    stale = next(t for t in sim.tasks if t.body["item"] == 1)
    sim.run()
    assert sim.status == "completed"
    assert sim.output["thumbnails"] == [{"thumbnailUri": f"thumbs/{i}.png"} for i in ids_]  # type: ignore[index]
    # a late success of the failed attempt changes nothing
    report = sim.work(stale)
    assert sim.handle(report).verdict is not Verdict.APPLIED


def test_map_over_max_items_fails_to_start() -> None:
    sim = sim_of(
        """
        name: small-batch
        version: "1.0.0"
        class: fast
        entry: render-all
        context:
          type: object
          properties:
            modelIds: { type: array, items: { type: string, minLength: 1 } }
          required: [modelIds]
        stages:
          - name: render-all
            type: map
            worker: thumbnail.render@3
            queue: tasks.parallel
            items: "${context.modelIds}"
            max_items: 2
            input: { modelId: "${item}" }
            on_success: completed
            on_failure: failed
        """,
        {"modelIds": ["a", "b", "c"]},
    )
    sim.run()

    assert sim.status == "failed"
    assert "over max_items 2" in reason(sim)
    assert not sim.tasks


# ---- start, decisions and bindings -----------------------------------------------------------------


def test_invalid_start_context_creates_the_run_with_a_failed_intent() -> None:
    sim = sim_for("model-ingest", {"modelID": "typo"})
    handled = sim.deliver_at(0)

    assert handled is not None and handled.took_effect and handled.decision.create
    assert sim.record["intent"] == "failed"
    assert reason(sim).startswith("invalid context: ")
    assert "modelId" in reason(sim)
    assert not [t for t in sim.tasks if not str(t.body["stage"]).startswith("finaliser:")]
    assert sim.snapshot().stages == {}
    sim.run()
    assert sim.status == "failed"
    assert sim.kinds() == [
        "run.started",
        "intent.set",
        "finaliser.dispatched",
        "finaliser.completed",
        "run.failed",
    ]


DECISION_ERROR = """
name: decision-error
version: "1.0.0"
class: fast
entry: gate
context:
  type: object
  properties:
    modelId: { type: string, minLength: 1 }
    size: { type: number }
  required: [modelId]
stages:
  - name: gate
    type: decision
    on_evaluation_error: publish
    branches:
      - when: "context.size > 10.0"
        next: failed
      - when: "true"
        next: completed
  - name: publish
    type: action
    action: catalogue.publish@2
    input: { modelId: "${context.modelId}" }
    on_success: completed
    on_failure: failed
finalisers: [audit.run-terminal@1]
"""


def test_decision_evaluation_error_routes_to_on_evaluation_error() -> None:
    sim = sim_of(DECISION_ERROR, {"modelId": "m-1"})  # no size: the first branch cannot be evaluated
    sim.deliver_at(0)

    (failed,) = sim.entries("decision.failed", "gate")
    assert "size" in failed["detail"]["error"]
    assert "decision.taken" not in sim.kinds()
    assert sim.pending_tasks() == ["publish"]
    sim.run()
    assert sim.status == "completed"


def test_decision_without_an_evaluation_error_takes_its_branch() -> None:
    sim = sim_of(DECISION_ERROR, {"modelId": "m-1", "size": 3})
    sim.run()

    assert sim.status == "completed"
    assert [(e["stage"], e["detail"]) for e in sim.entries("decision.taken")] == [
        ("gate", {"branch": 1, "next": "completed"})
    ]
    assert "publish" not in sim.snapshot().stages


def test_binding_error_in_a_stage_input_fails_the_stage_without_dispatching_it() -> None:
    sim = sim_of(
        """
        name: binding-error
        version: "1.0.0"
        class: fast
        entry: lookup
        context:
          type: object
          properties:
            modelId: { type: string, minLength: 1 }
            other: { type: string, minLength: 1 }
          required: [modelId]
        stages:
          - name: lookup
            type: action
            action: cache.lookup@1
            input: { modelId: "${context.other}" }
            on_success: completed
            on_failure: publish
          - name: publish
            type: action
            action: catalogue.publish@2
            input: { modelId: "${context.modelId}" }
            on_success: completed
            on_failure: failed
        finalisers: [audit.run-terminal@1]
        """,
        {"modelId": "m-1"},
    )
    sim.deliver_at(0)

    lookup = sim.snapshot().stages["lookup"]
    assert lookup.status.value == "failed"
    assert "other" in (lookup.error or "")
    (entry,) = sim.entries("stage.failed", "lookup")
    assert entry["detail"]["reason"] == "binding"
    assert "stage.dispatched" not in [h["kind"] for h in sim.history if h["stage"] == "lookup"]
    assert sim.pending_tasks() == ["publish"]  # on_failure was followed; lookup never went out
    sim.run()
    assert "lookup" not in [t.body["stage"] for t in sim.tasks]
    assert sim.status == "completed"


def test_output_binding_failure_turns_the_completed_intent_into_failed() -> None:
    sim = sim_of(
        """
        name: output-error
        version: "1.0.0"
        class: fast
        entry: lookup
        context:
          type: object
          properties:
            modelId: { type: string, minLength: 1 }
            other: { type: string }
          required: [modelId]
        output:
          x: "${context.other}"
        stages:
          - name: lookup
            type: action
            action: cache.lookup@1
            input: { modelId: "${context.modelId}" }
            on_success: completed
            on_failure: failed
        finalisers: [audit.run-terminal@1]
        """,
        {"modelId": "m-1"},
    )
    sim.run()

    assert stage_state(sim, "lookup") == "completed"
    assert sim.record["intent"] == "failed"
    assert reason(sim).startswith("output binding failed: ")
    assert "output" not in sim.record
    assert sim.status == "failed"
    (intent,) = sim.entries("intent.set")
    assert intent["detail"]["intent"] == "failed"


# ---- rejected events --------------------------------------------------------------------------------


def test_digest_mismatch_in_a_result_is_invalid() -> None:
    sim = sim_for("model-ingest", {"modelId": "m-1"})
    sim.deliver_at(0)
    sim.deliver_at(0)  # the cache-lookup task: its result is pending
    (result,) = [d.event for d in sim.pending]
    assert isinstance(result, StageResult)

    forged = dataclasses.replace(result, message_id="result-other-plan", digest="sha256:" + "0" * 64)
    before = dict(sim.record)
    handled = sim.handle(forged)

    assert handled.verdict is Verdict.INVALID
    assert not handled.published
    assert sim.record == before
    rejected = sim.history[-1]
    assert rejected["kind"] == "callback.rejected"
    assert rejected["detail"]["reason"] == "invalid"
    assert "pinned to" in rejected["detail"]["detail"]
    # the genuine result is still accepted
    assert sim.handle(result).took_effect
    assert stage_state(sim, "cache-lookup") == "completed"


def test_result_for_an_unknown_run_is_invalid_and_writes_nothing() -> None:
    plan = compiled("model-ingest")
    event = StageResult("result-x", "cache-lookup", 1, "1.1", True, {}, None, None, plan.digest)

    decision = advance(plan.typed, plan.digest, None, event, 1)
    assert decision.verdict is Verdict.INVALID
    assert not decision.writes and not decision.outgoing and not decision.create

    store = MemoryStore()
    code, _ = store.apply("nobody", event.message_id, decision, list(plan.typed.barriers), 1)
    assert code == NO_RUN
    assert store.runs == {} and store.outbox == {}

    sim = sim_for("model-ingest")
    handled = sim.handle(event)
    assert handled.verdict is Verdict.INVALID and handled.code is None
    assert sim.store.runs == {} and sim.store.outbox == {}


def test_duplicate_start_is_a_duplicate() -> None:
    sim = sim_for("model-ingest", {"modelId": "m-1"})
    first = sim.deliver_at(0)
    assert first is not None and first.took_effect
    record = dict(sim.record)

    again = sim.handle(StartRun("start-1", "run-1", SHARD, {"modelId": "m-1"}))  # a redelivery
    other = sim.handle(StartRun("start-2", "run-1", SHARD, {"modelId": "other"}))  # a second start

    assert again.verdict is Verdict.DUPLICATE and again.code == DUPLICATE
    assert other.verdict is Verdict.DUPLICATE
    assert not again.published and not other.published
    assert sim.record == record
    assert sim.kinds().count("run.started") == 1
    assert [h["detail"]["reason"] for h in sim.history[-2:]] == ["duplicate", "duplicate"]


def test_duplicate_result_is_recorded_and_changes_nothing() -> None:
    sim = sim_for("model-ingest", {"modelId": "m-1"})
    sim.deliver_at(0)
    first = sim.deliver_task("cache-lookup")
    assert first is not None and first.took_effect
    record, published = dict(sim.record), dict(sim.published)

    again = sim.handle(first.event)

    assert again.verdict is Verdict.DUPLICATE
    assert not again.published
    assert sim.record == record and dict(sim.published) == published
    assert sim.history[-1]["kind"] == "callback.rejected"
    assert sim.history[-1]["detail"]["reason"] == "duplicate"


def test_stale_result_is_rejected_and_the_current_one_accepted() -> None:
    sim = sim_for("model-ingest", {"modelId": "m-1"})
    sim.deliver_at(0)
    sim.deliver_at(0)
    (result,) = [d.event for d in sim.pending]
    assert isinstance(result, StageResult)

    stale = dataclasses.replace(
        report(sim.run_id, result.stage, "0.9", True, result.result), digest=result.digest
    )
    handled = sim.handle(stale)
    assert handled.verdict is Verdict.STALE
    assert stage_state(sim, "cache-lookup") == "dispatched"
    assert sim.history[-1]["detail"]["reason"] == "stale"
    assert sim.handle(result).took_effect


def test_finaliser_result_after_the_run_finished_is_a_duplicate() -> None:
    sim = sim_for("catalogue-reindex", {"index": "products"})
    sim.run()
    assert sim.status == "completed"
    assert sim.output == {"index": "products", "lastStep": "swap"}
    finaliser = next(h.event for h in sim.handled if type(h.event).__name__ == "FinaliserResult")
    record = dict(sim.record)

    again = sim.handle(finaliser)

    assert again.verdict is Verdict.DUPLICATE
    assert sim.record == record
    assert not again.published


def test_ingest_triage_decides_without_dispatching_work() -> None:
    ok = sim_for("ingest-triage", {"sizeMb": 12.5, "format": "glb"})
    ok.run()
    assert ok.status == "completed" and ok.output == {"format": "glb"}
    assert not ok.tasks

    big = sim_for("ingest-triage", {"sizeMb": 4096, "format": "glb"})
    big.run()
    assert big.status == "failed"
    assert reason(big).startswith("size-gate: ")


# ---- bugs found while writing these tests (each asserts the correct behaviour) ---------------------


def test_result_naming_a_join_stage_is_invalid() -> None:
    """A join is completed only by its barrier's release, never by a worker's result: a result naming
    the join (with the join's fence) must not complete it while its branches are still out."""
    sim = sim_for("model-ingest", {"modelId": "m-1"})
    sim.deliver_at(0)
    sim.deliver_task("cache-lookup")
    sim.deliver_task("render-thumbnail")
    join = sim.snapshot().stages["derive-join"]
    plan = compiled("model-ingest")

    event = StageResult("result-forged", "derive-join", 1, join.fence, True, {}, None, None, plan.digest)
    handled = sim.handle(event)

    assert handled.verdict is Verdict.INVALID
    assert stage_state(sim, "derive-join") == "running"
    assert "publish" not in sim.pending_tasks()


def test_result_for_another_attempt_is_not_accepted() -> None:
    """Invariant 5: a callback is accepted only if stage, attempt AND fence match the current attempt."""
    sim = sim_for("model-ingest", {"modelId": "m-1"})
    sim.deliver_at(0)
    sim.deliver_at(0)
    (result,) = [d.event for d in sim.pending]
    assert isinstance(result, StageResult)

    wrong = dataclasses.replace(result, message_id="result-attempt-7", attempt=7)
    handled = sim.handle(wrong)

    assert handled.verdict is not Verdict.APPLIED
    assert stage_state(sim, "cache-lookup") == "dispatched"


def test_map_item_outside_the_bag_does_not_count() -> None:
    """Invariant 6: the barrier counts distinct arrivals of the map's own items. An item index the map
    never dispatched must not decrement the counter (it released the map early, with a wrong result)."""
    sim = sim_for("thumbnail-batch", {"modelIds": ["a", "b"]})
    sim.deliver_at(0)
    plan = compiled("thumbnail-batch")

    bogus = StageResult(
        "result-bogus", "render-all", 1, "1.1", True, {"thumbnailUri": "x"}, None, 99, plan.digest
    )
    handled = sim.handle(bogus)

    assert not handled.took_effect
    assert sim.record["b:render-all"] == "2"
    sim.run()
    assert sim.status == "completed"
    assert sim.output == {
        "count": 2,
        "thumbnails": [{"thumbnailUri": "thumbs/a.png"}, {"thumbnailUri": "thumbs/b.png"}],
    }


def test_failure_report_for_a_map_item_that_already_arrived_is_a_duplicate() -> None:
    """Invariant 10: a message whose id was already applied has no effect. A redelivered map task whose
    handler fails the second time reports under the SAME result id as the success that already arrived;
    it must not fail the map (and the run) after the item was counted."""
    sim = sim_for("thumbnail-batch", {"modelIds": ["a", "b"]})
    sim.deliver_at(0)
    arrived = sim.deliver_task("render-all", 0)
    assert arrived is not None and arrived.took_effect

    flaky = dataclasses.replace(arrived.event, ok=False, result=None, error="RuntimeError: flaky")
    handled = sim.handle(flaky)

    assert not handled.took_effect
    assert "intent" not in sim.record
    assert stage_state(sim, "render-all") == "dispatched"
    sim.run()
    assert sim.status == "completed"


def test_a_refused_report_is_refused_again_on_redelivery_and_its_id_is_not_remembered() -> None:
    """A result refused as late changes nothing; delivered again, it is refused again (the engine decides
    the same), so nothing depends on remembering refused ids."""
    sim = sim_for("model-ingest", {"modelId": "m-1"}, fail_stages=frozenset({"technical-metadata"}))
    sim.deliver_at(0)
    sim.deliver_task("cache-lookup")
    sim.deliver_task("render-thumbnail")
    sim.deliver_task("technical-metadata")
    handled = sim.deliver_task("semantic-analysis")
    assert late(handled) and handled is not None and handled.code == APPLIED
    record = dict(sim.record)

    again = sim.handle(handled.event)
    assert late(again) and sim.record == record
    assert handled.event.message_id not in sim.store.runs[sim.run_id].applied


def test_a_forgery_under_a_genuine_reports_id_does_not_block_that_report() -> None:
    """A signed message that names another attempt under the id of a report still to come (a single
    task's id does not carry its attempt: the fence does) is refused; the genuine report, when it comes,
    is applied (a remembered refusal would make it a duplicate). Found by the signed-garbage fuzzer."""
    sim = sim_for("model-ingest", {"modelId": "m-1"})
    sim.deliver_at(0)
    (task,) = [d.task for d in sim.pending if d.kind == "task"]
    assert task is not None
    genuine = report(sim.run_id, "cache-lookup", "1.1", True, {"modelId": "m-1", "hit": False})
    forged = dataclasses.replace(genuine, attempt=2)
    assert sim.handle(forged).verdict is Verdict.STALE
    sim.pending.clear()
    applied = sim.handle(dataclasses.replace(genuine, digest=str(task.body["digest"])))
    assert applied.took_effect and sim.record["s:cache-lookup:status"] == "completed"

"""The invariant checks catch what they claim to: a correct run passes, each kind of corruption is named.

A completed model-ingest run (cache miss) is written into Redis by hand, under a key prefix of its own,
with the plan the compiler makes of definitions/model-ingest.yaml; each test breaks one thing.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import pytest
import redis

from orchestrator.compiler import compile_text
from orchestrator.store.facets import static_facets, status_facets
from orchestrator.store.keys import ShardKeys, index_key, plan_key
from tests.conftest import DEMO_REGISTRY, ROOT
from tests.faults import invariants
from workers.demo.effects import demo_key

pytestmark = pytest.mark.services

SHARD = "fast.0"
Row = tuple[str, str, int | None, dict[str, object]]  # (kind, stage, attempt, detail) of a history event
# a model-ingest run that missed the cache and completed
HAPPY: list[Row] = [
    ("run.started", "", None, {"definition": "model-ingest"}),
    ("stage.dispatched", "cache-lookup", 1, {"queue": "tasks.actions"}),
    ("stage.completed", "cache-lookup", 1, {}),
    ("decision.taken", "cache-route", None, {"branch": 1, "next": "render-thumbnail"}),
    ("stage.dispatched", "render-thumbnail", 1, {"queue": "rendering"}),
    ("stage.completed", "render-thumbnail", 1, {}),
    ("fork.released", "derive-fork", None, {"branches": ["semantic-analysis", "technical-metadata"]}),
    ("stage.dispatched", "semantic-analysis", 1, {"queue": "analysis"}),
    ("stage.dispatched", "technical-metadata", 1, {"queue": "metadata"}),
    ("stage.completed", "semantic-analysis", 1, {}),
    ("branch.arrived", "derive-join", None, {"branch": "semantic-analysis", "outcome": "completed"}),
    ("stage.completed", "technical-metadata", 1, {}),
    ("branch.arrived", "derive-join", None, {"branch": "technical-metadata", "outcome": "completed"}),
    ("join.released", "derive-join", 1, {}),
    ("stage.dispatched", "publish", 1, {"queue": "tasks.actions"}),
    ("stage.completed", "publish", 1, {}),
    ("intent.set", "", None, {"intent": "completed", "reason": None}),
    ("finaliser.dispatched", "finaliser:0", None, {"contract": "audit.run-terminal@1"}),
    ("finaliser.completed", "finaliser:0", None, {}),
    ("run.completed", "", None, {}),
]
CONTRACTS = {
    "cache-lookup": "cache.lookup",
    "render-thumbnail": "thumbnail.render",
    "semantic-analysis": "semantic.analyse",
    "technical-metadata": "metadata.extract",
    "publish": "catalogue.publish",
}


class Fabricated:
    def __init__(self, r: redis.Redis, prefix: str) -> None:
        self.r, self.prefix = r, prefix
        self.run_id = uuid.uuid4().hex
        self.keys = ShardKeys(prefix, SHARD)
        plan = compile_text(
            (ROOT / "definitions" / "model-ingest.yaml").read_text(), "model-ingest.yaml", DEMO_REGISTRY
        )
        self.digest = plan.digest
        self.version = plan.version
        r.set(plan_key(prefix, plan.digest), json.dumps({"plan": plan.plan, "versions": {}}))

    def task(self, stage: str) -> str:
        return f"task-{self.run_id}-{stage}"  # the checks count effects per contract; keys are opaque

    def write(self, history: list[Row] = HAPPY) -> None:
        r, run = self.r, self.keys.run(self.run_id)
        r.set(index_key(self.prefix, self.run_id), SHARD)
        fields = {"run_id": self.run_id, "shard": SHARD, "digest": self.digest, "status": "completed"}
        fields |= {"definition": "model-ingest", "version": self.version}
        indexes = static_facets(self.keys, "model-ingest", self.version)
        for key in [*indexes, *status_facets(self.keys, "model-ingest", self.version, "completed")]:
            r.zadd(key, {self.run_id: 1})
        fields |= {"epoch": "1", "intent": "completed", "b:derive-join": "0"}
        fields |= {f"s:{stage}:status": "completed" for stage in [*CONTRACTS, "derive-join"]}
        r.hset(run, mapping=fields)
        r.hset(
            self.keys.barrier(self.run_id, "derive-join"),
            mapping={"semantic-analysis": "", "technical-metadata": ""},
        )
        for kind, stage, attempt, detail in history:
            attempt_field = "" if attempt is None else str(attempt)
            event = {"kind": kind, "stage": stage, "attempt": attempt_field, "at": "1"}
            r.xadd(self.keys.history(self.run_id), {**event, "detail": json.dumps(detail)})  # type: ignore[dict-item]
        ledger = {self.task(stage): contract for stage, contract in CONTRACTS.items()}
        ledger[self.task("finaliser:0")] = "audit.run-terminal"
        r.hset(demo_key(self.prefix, "effects"), mapping=ledger)
        for contract in ledger.values():
            r.hincrby(demo_key(self.prefix, "counts"), contract, 1)

    def check(self) -> list[str]:
        return invariants.check_runs(self.r, self.prefix, [self.run_id], all_runs=True)


@pytest.fixture
def run() -> Iterator[Fabricated]:
    r = redis.Redis("127.0.0.1", 6379, decode_responses=True)
    prefix = f"sagainvariants{uuid.uuid4().hex[:8]}"
    try:
        yield Fabricated(r, prefix)
    finally:
        keys = list(r.scan_iter(match=f"{prefix}:*", count=1000))
        if keys:
            r.delete(*keys)
        r.close()


def only(violations: list[str], *words: str) -> None:
    assert len(violations) == 1 and all(w in violations[0] for w in words), violations


def test_a_correct_run_has_no_violations(run: Fabricated) -> None:
    run.write()
    assert run.check() == []
    assert invariants.pending(run.r, run.prefix, [run.run_id]) == []


def test_a_run_counted_unfinished_after_it_ended(run: Fabricated) -> None:
    run.write()
    run.r.hincrby(run.keys.live(), run.digest, 1)
    only(run.check(), f"shard {SHARD}: unfinished runs counted", "but {} have not ended")


def test_a_run_missing_from_its_listing_index_or_left_in_another(run: Fabricated) -> None:
    run.write()
    status_key = run.keys.facet("ver", "model-ingest", run.version, "state", "completed")
    run.r.zrem(status_key, run.run_id)
    run.r.zadd(run.keys.facet("state", "running"), {run.run_id: 1})
    violations = run.check()
    assert len(violations) == 2, violations
    assert any(f"missing from listing index {status_key}" in v for v in violations)
    assert any(f"still in listing index {run.keys.facet('state', 'running')}" in v for v in violations)


def test_a_join_released_twice(run: Fabricated) -> None:
    run.write([*HAPPY[:14], HAPPY[13], *HAPPY[14:]])
    only(run.check(), "join derive-join released 2 times")


def test_two_accepted_results_for_one_attempt(run: Fabricated) -> None:
    run.write([*HAPPY[:6], ("stage.completed", "render-thumbnail", 1, {}), *HAPPY[6:]])
    violations = run.check()
    assert len(violations) == 2, violations
    assert "2 accepted results for ('render-thumbnail', 1, None)" in violations[0]
    assert "thumbnail.render: 2 successes accepted but 1 effects" in violations[1]  # the ledger agrees


def test_an_event_after_the_run_ended(run: Fabricated) -> None:
    run.write([*HAPPY, ("stage.dispatched", "publish", 2, {})])
    only(run.check(), "events after the run ended")


def test_a_barrier_counted_below_zero(run: Fabricated) -> None:
    run.write()
    run.r.hset(run.keys.run(run.run_id), "b:derive-join", "-1")
    assert any("below zero" in v for v in run.check()), run.check()


def test_a_succeeded_task_without_its_effect(run: Fabricated) -> None:
    run.write()
    run.r.hdel(demo_key(run.prefix, "effects"), run.task("publish"))
    run.r.hincrby(demo_key(run.prefix, "counts"), "catalogue.publish", -1)
    only(run.check(), "catalogue.publish: 1 successes accepted but 0 effects")


def test_an_effect_nothing_dispatched(run: Fabricated) -> None:
    run.write()
    run.r.hset(demo_key(run.prefix, "effects"), "task-never-dispatched", "thumbnail.render")
    run.r.hincrby(demo_key(run.prefix, "counts"), "thumbnail.render", 1)
    only(run.check(), "thumbnail.render: 2 effects recorded but 1 tasks dispatched")


def test_a_miscounted_ledger(run: Fabricated) -> None:
    run.write()
    run.r.hincrby(demo_key(run.prefix, "counts"), "semantic.analyse", 1)
    only(run.check(), "semantic.analyse: the ledger counts 2 effects but holds 1")


def test_a_redriven_run_starts_its_attempts_again_but_not_its_barriers(run: Fabricated) -> None:
    failed: list[Row] = [
        *HAPPY[:6],
        ("stage.failed", "semantic-analysis", 1, {}),
        ("intent.set", "", None, {"intent": "failed"}),
        ("run.failed", "", None, {}),
    ]
    redriven: list[Row] = [("run.redriven", "", None, {"epoch": 2}), *HAPPY[1:]]
    run.write([*failed, *redriven])
    assert invariants.check_runs(run.r, run.prefix, [run.run_id], effects=False) == []
    # ... while a join released twice within one epoch is still caught
    run.r.delete(run.keys.history(run.run_id))
    run.write([*failed, *redriven[:14], redriven[13], *redriven[14:]])
    only(
        invariants.check_runs(run.r, run.prefix, [run.run_id], effects=False),
        "join derive-join released 2 times",
        "epoch 2",
    )


def test_an_unsent_outbox_entry_is_pending_and_a_violation(run: Fabricated) -> None:
    run.write()
    entry = json.dumps({"id": "task-x", "kind": "task", "run_id": run.run_id})
    run.r.hset(run.keys.outbox(), "task-x", entry)
    only(run.check(), "never published", "task-x")
    only(invariants.pending(run.r, run.prefix, [run.run_id]), "1 unsent", "task-x")


def test_an_unfinished_and_a_never_created_run_are_pending(run: Fabricated) -> None:
    run.write(HAPPY[:8])
    run.r.hset(run.keys.run(run.run_id), "status", "running")
    ghost = uuid.uuid4().hex
    pending = invariants.pending(run.r, run.prefix, [run.run_id, ghost])
    assert len(pending) == 2 and ghost in pending[0] and run.run_id in pending[1], pending
    violations = invariants.check_runs(run.r, run.prefix, [run.run_id, ghost])
    assert any("not terminal: running" in v for v in violations), violations
    assert any(ghost in v and "no run record" in v for v in violations), violations


def test_dead_letters_are_named() -> None:
    depths = {
        "saga.shard.fast.0": 3,
        "saga.shard.fast.0.dlq": 1,
        "saga.rejected": 2,
        "saga.task.tasks.serial.dlq": 0,
    }
    assert invariants.dead_letters(depths) == [
        "queue saga.rejected holds 2 messages",
        "queue saga.shard.fast.0.dlq holds 1 messages",
    ]


def test_a_run_whose_plan_is_missing_is_not_waved_through(run: Fabricated) -> None:
    """Without its plan the join and bag checks would have nothing to check: that is a violation itself."""
    run.write()
    run.r.delete(plan_key(run.prefix, run.digest))
    assert any("plan" in v and "not found" in v for v in run.check()), run.check()

"""Failure handling on the real services: retries with fencing, the three clocks, cancellation.

Each test publishes a small probe definition of its own (one worker stage around the demo's
``thumbnail.render@3``, whose faults are set per model id) and drives real orchestrator and worker
processes. What the tests read is the durable history: every assertion is about what was recorded.
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from orchestrator.client import SyncClient
from orchestrator.compiler import compile_text
from orchestrator.provision import publish_plans
from orchestrator.store.keys import ShardKeys
from orchestrator.wire import ids
from tests.faults.invariants import assert_no_violations, check_runs
from tests.integration.stack import REGISTRY, Stack, poll, running
from workers.demo.effects import demo_key

pytestmark = pytest.mark.services

PROBE = """
name: {name}
version: "1.0.0"
class: fast
entry: render
context:
  type: object
  properties:
    modelId: {{ type: string, minLength: 1 }}
  required: [modelId]
{run_deadline}
stages:
  - name: render
    type: worker
    queue: rendering
    worker: thumbnail.render@3
    input: {{ modelId: "${{context.modelId}}" }}
{stage_extra}
    on_success: completed
    on_failure: failed
finalisers: [audit.run-terminal@1]
terminals: [completed, failed]
"""


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with running("failures") as s:
        yield s


@pytest.fixture(scope="module")
def client(stack: Stack) -> Iterator[SyncClient]:
    with SyncClient(stack.settings) as c:
        yield c


def probe(stack: Stack, name: str, *stage_lines: str, run_deadline_ms: int | None = None) -> str:
    """Publish (and activate) a one-stage probe definition; returns its name."""
    text = PROBE.format(
        name=name,
        run_deadline=f"run_deadline_ms: {run_deadline_ms}" if run_deadline_ms else "",
        stage_extra="\n".join(f"    {line}" for line in stage_lines),
    )
    plan = compile_text(text, f"{name}.yaml", REGISTRY)
    asyncio.run(publish_plans(stack.settings, [plan]))
    return name


def history(stack: Stack, run_id: str) -> list[dict[str, Any]]:
    """The run's history as ``saga history --json`` shows it: detail fields beside kind and stage."""
    return [
        {
            **e["detail"],
            "kind": e["kind"],
            "stage": e["stage"] or None,
            "attempt": int(e["attempt"]) if e["attempt"] else None,
            "at": int(e["at"]),
        }
        for e in stack.history(run_id)
    ]


def events(stack: Stack, run_id: str, kind: str) -> list[dict[str, Any]]:
    return [e for e in history(stack, run_id) if e["kind"] == kind]


def outcomes_per_attempt(stack: Stack, run_id: str) -> Counter[tuple[str, int]]:
    """(stage, attempt) -> how many outcomes were recorded for it: completed, failed or timed out."""
    kinds = ("stage.completed", "stage.failed", "stage.timed_out")
    return Counter((e["stage"], e["attempt"]) for e in history(stack, run_id) if e["kind"] in kinds)


def at_least(n: int, found: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    return found if len(found) >= n else None


def test_transient_failures_are_retried_with_new_attempts_fences_and_backoff(
    stack: Stack, client: SyncClient
) -> None:
    name = probe(stack, "probe-retry", "retry: { max_attempts: 3, initial_backoff_ms: 300, jitter: 0.5 }")
    stack.world.set_fault("retry-1", "thumbnail.render", fail_times=2)
    run_id = client.start(name, {"modelId": "retry-1"})
    result = client.wait(run_id, timeout_s=30)
    assert result.state == "completed", result
    # three attempts, each with its own fence; the first two failed as retryable, the third completed
    dispatched = events(stack, run_id, "stage.dispatched")
    assert [e["attempt"] for e in dispatched] == [1, 2, 3]
    record = stack.record(run_id)
    assert record["s:render:fence"] == "1.3" and record["s:render:attempt"] == "3"
    failed = events(stack, run_id, "stage.failed")
    assert [(e["attempt"], e["retryable"]) for e in failed] == [(1, True), (2, True)]
    # each retry waited its backoff (exponential, minus at most half of it as jitter) on a durable timer
    scheduled = events(stack, run_id, "retry.scheduled")
    assert [e["next_attempt"] for e in scheduled] == [2, 3]
    for retry, nominal in zip(scheduled, (300, 600), strict=True):
        assert nominal * 0.5 <= retry["delay_ms"] <= nominal
        next_dispatch = next(e for e in dispatched if e["attempt"] == retry["next_attempt"])
        assert next_dispatch["at"] - retry["at"] >= retry["delay_ms"]
    assert all(n == 1 for n in outcomes_per_attempt(stack, run_id).values())
    assert stack.redis.zcard(f"{stack.prefix}:{{{record['shard']}}}:timers") == 0


def test_a_queue_deadline_fences_attempts_nobody_took_and_their_late_work_is_recorded(
    stack: Stack, client: SyncClient
) -> None:
    name = probe(
        stack,
        "probe-queue-deadline",
        "queue_deadline_ms: 400",
        "retry: { max_attempts: 2, initial_backoff_ms: 50 }",
    )
    stack.stop("worker")  # nobody consumes the task queue
    try:
        run_id = client.start(name, {"modelId": "queue-1"})
        poll(lambda: stack.record(run_id).get("intent") == "failed", 30, what="the failed intent")
    finally:
        stack.start_worker()
    result = client.wait(run_id, timeout_s=30)  # the finaliser needed a worker
    # both attempts timed out on their queue clock, the run failed (its finaliser still ran)
    assert result.state == "failed"
    assert result.reason is not None and "queue deadline of 400 ms passed" in result.reason
    timed_out = events(stack, run_id, "stage.timed_out")
    assert [(e["attempt"], e["clock"]) for e in timed_out] == [(1, "queue"), (2, "queue")]
    assert events(stack, run_id, "finaliser.completed")
    # the worker, back, starts neither stale task: each carries its queue deadline, which has passed, so
    # it settles each without running it or reporting (the queue clock already timed the attempt out)
    poll(
        lambda: stack.log("worker").count(f"of run {run_id} not started: its queue deadline") >= 2,
        30,
        what="both stale tasks left unstarted",
    )
    assert not events(stack, run_id, "stage.accepted")  # no handler ran: none was accepted
    assert not [e for e in events(stack, run_id, "callback.rejected") if e["stage"] == "render"]
    assert stack.record(run_id)["status"] == "failed"
    assert all(n == 1 for n in outcomes_per_attempt(stack, run_id).values())


def test_a_quick_handler_lets_its_result_stand_for_its_acceptance_a_slower_one_reports_it(
    stack: Stack, client: SyncClient
) -> None:
    name = probe(stack, "probe-acceptance", "execution_deadline_ms: 20000")  # no queue clock
    # Handlers that return well within the task's accept_after_ms (50): their results alone (three runs,
    # so that one handler slowed past it by a busy machine cannot decide the test)
    quick = [client.start(name, {"modelId": f"accept-quick-{i}"}) for i in range(3)]
    for run_id in quick:
        assert client.wait(run_id, timeout_s=30).state == "completed"
    accepted = [run_id for run_id in quick if events(stack, run_id, "stage.accepted")]
    assert len(accepted) < len(quick), "every quick handler still sent an acceptance"
    # A handler still running after it: accepted first (its execution clock set), then completed
    stack.world.set_fault("accept-slow", "thumbnail.render", delay_ms=600)
    slow = client.start(name, {"modelId": "accept-slow"})
    assert client.wait(slow, timeout_s=30).state == "completed"
    kinds = [e["kind"] for e in history(stack, slow) if e["stage"] == "render"]
    assert kinds.index("stage.accepted") < kinds.index("stage.completed"), kinds
    assert not events(stack, slow, "callback.rejected")
    every = [*quick, slow]
    assert_no_violations(check_runs(stack.redis, stack.prefix, every), "the shared invariants")


def test_a_heartbeat_timeout_fences_a_stalled_attempt_and_the_retry_completes(
    stack: Stack, client: SyncClient
) -> None:
    name = probe(
        stack,
        "probe-heartbeat",
        "heartbeat_timeout_ms: 900",
        "retry: { max_attempts: 2, initial_backoff_ms: 50 }",
    )
    stack.world.set_fault("hb-1", "thumbnail.render", delay_ms=2500)
    # a worker of its own, so stopping it stalls only this test's attempt
    stack.stop("worker")
    stack.start_worker("stalling")
    run_id = client.start(name, {"modelId": "hb-1"})
    poll(lambda: events(stack, run_id, "stage.accepted"), 20, what="the attempt accepted")
    stalled = stack.processes["stalling"]
    stalled.send_signal(signal.SIGSTOP)  # alive but silent: no heartbeat, no result
    try:
        poll(lambda: events(stack, run_id, "stage.timed_out"), 20, what="the heartbeat timeout")
    finally:
        stalled.send_signal(signal.SIGCONT)
    stack.start_worker()
    result = client.wait(run_id, timeout_s=30)
    stack.stop("stalling")
    # attempt 1 was fenced by its heartbeat clock; attempt 2 (a new fence) completed the stage
    assert result.state == "completed", result
    timed_out = events(stack, run_id, "stage.timed_out")
    assert [(e["attempt"], e["clock"]) for e in timed_out] == [(1, "heartbeat")]
    completed = events(stack, run_id, "stage.completed")
    assert [e["attempt"] for e in completed] == [2]
    assert stack.record(run_id)["s:render:fence"] == "1.2"
    assert all(n == 1 for n in outcomes_per_attempt(stack, run_id).values())


def test_results_racing_their_execution_deadline_have_exactly_one_outcome(
    stack: Stack, client: SyncClient
) -> None:
    # the handler takes about as long as the deadline allows: some results win, some timeouts do
    name = probe(stack, "probe-race", "execution_deadline_ms: 300")
    run_ids = []
    for i in range(24):
        model = f"race-{i}"
        stack.world.set_fault(model, "thumbnail.render", delay_ms=240 + 10 * (i % 12))
        run_ids.append(client.start(name, {"modelId": model}))
    states = {run_id: client.wait(run_id, timeout_s=60).state for run_id in run_ids}
    for run_id, state in states.items():
        counts = outcomes_per_attempt(stack, run_id)
        assert counts == Counter({("render", 1): 1}), (run_id, counts)
        won = bool(events(stack, run_id, "stage.completed"))
        assert (state == "completed") == won, (run_id, state)
        assert not won or "s:render:result" in stack.record(run_id)
        assert won or stack.record(run_id)["s:render:status"] == "timed-out"


def test_the_run_deadline_fails_the_run_and_stops_its_running_stage(stack: Stack, client: SyncClient) -> None:
    name = probe(stack, "probe-run-deadline", run_deadline_ms=700)
    stack.world.set_fault("deadline-1", "thumbnail.render", delay_ms=5000)
    run_id = client.start(name, {"modelId": "deadline-1"})
    result = client.wait(run_id, timeout_s=30)
    assert result.state == "failed"
    assert result.reason == "run deadline of 700 ms passed"
    assert [e["stage"] for e in events(stack, run_id, "cancellation.requested")] == ["render"]
    acknowledged = poll(
        lambda: events(stack, run_id, "cancellation.acknowledged"), 10, what="the worker stopping"
    )
    assert acknowledged[0]["stage"] == "render"
    assert stack.record(run_id)["s:render:status"] == "cancelled"
    assert events(stack, run_id, "finaliser.completed")


def test_saga_cancel_cancels_a_running_run(stack: Stack, client: SyncClient) -> None:
    name = probe(stack, "probe-cancel")
    stack.world.set_fault("cancel-1", "thumbnail.render", delay_ms=5000)
    run_id = client.start(name, {"modelId": "cancel-1"})
    poll(lambda: stack.record(run_id).get("s:render:status") == "dispatched", 10, what="render dispatched")
    done = stack.saga("cancel", run_id, "--reason", "operator says stop", "--wait", "20")
    assert done.returncode == 0, done.stderr
    assert "the run is failed (cancelled: operator says stop)" in done.stdout
    requested = events(stack, run_id, "cancel.requested")
    assert len(requested) == 1 and requested[0]["why"] == "operator says stop" and requested[0]["by"]
    poll(lambda: events(stack, run_id, "cancellation.acknowledged"), 10, what="the worker stopping")
    # a second request for a run that already ended is refused before anything is sent
    again = stack.saga("cancel", run_id, "--reason", "again")
    assert again.returncode == 1 and "it has ended, so there is nothing to cancel" in again.stderr
    assert len(events(stack, run_id, "cancel.requested")) == 1
    assert stack.record(run_id)["reason"] == "cancelled: operator says stop"


def test_a_failed_model_ingest_discards_its_rendered_thumbnail_once_before_its_finaliser(
    stack: Stack, client: SyncClient
) -> None:
    stack.world.set_fault("undo-1", "metadata.extract", fail=True)
    run_id = client.start("model-ingest", {"modelId": "undo-1"})
    result = client.wait(run_id, timeout_s=30)
    assert result.state == "failed"
    kinds = [e["kind"] for e in history(stack, run_id)]
    assert [e["stage"] for e in events(stack, run_id, "compensation.dispatched")] == [
        "compensate:render-thumbnail"
    ]
    assert kinds.index("compensation.completed") < kinds.index("finaliser.dispatched")
    assert stack.record(run_id)["s:render-thumbnail:status"] == "compensated"
    # the undo's effect is recorded under this run's compensation task (once: keyed by idempotency key)
    key = ids.message_id("task", run_id, "compensate:render-thumbnail", "1.c0")
    assert stack.world.effects().get(key) == "thumbnail.discard"


def test_saga_redrive_resumes_failed_runs_in_a_new_epoch_keeping_what_completed(
    stack: Stack, client: SyncClient
) -> None:
    models = ["redrive-1", "redrive-2", "redrive-3"]
    for model in models:
        stack.world.set_fault(model, "metadata.extract", fail=True)
    runs = [client.start("model-ingest", {"modelId": model}) for model in models]
    assert all(client.wait(run_id, timeout_s=30).state == "failed" for run_id in runs)
    for model in models:  # the fault is fixed
        stack.redis.delete(demo_key(stack.prefix, "faults", model))
    # one run by id (waiting for its new epoch to end), the other two in bulk
    single = stack.saga("redrive", runs[0], "--reason", "metadata fixed", "--wait", "30")
    assert single.returncode == 0, single.stderr
    assert single.stdout.strip() == f"{runs[0]} redriven (epoch 2): completed"
    bulk = stack.saga("redrive", "--all", "--definition", "model-ingest", "--json")
    assert bulk.returncode == 0, bulk.stderr
    reports = {r["run_id"]: r for r in json.loads(bulk.stdout)["runs"]}
    assert all(reports[run]["redriven"] and reports[run]["epoch"] == 2 for run in runs[1:])
    for run_id in runs:
        assert client.wait(run_id, timeout_s=30).state == "completed"
        record = stack.record(run_id)
        assert record["epoch"] == "2" and record["s:render-thumbnail:fence"] == "2.1"
        trail = history(stack, run_id)
        kinds = [e["kind"] for e in trail]
        assert kinds.count("run.redriven") == 1 and kinds.count("finaliser.completed") == 2
        # what completed in epoch 1 and was not undone is reused, never dispatched again
        cut = kinds.index("run.redriven")
        done = {e["stage"] for e in trail[:cut] if e["kind"] == "stage.completed"} - {"render-thumbnail"}
        again = {e["stage"] for e in trail[cut:] if e["kind"] == "stage.dispatched"}
        assert "cache-lookup" in done and not done & again, (done, again)
        assert {e["stage"] for e in events(stack, run_id, "stage.reused")} == done
        assert stack.redis.ttl(ShardKeys(stack.prefix, record["shard"]).run(run_id)) > 0  # ended again
    assert [e["why"] for e in events(stack, runs[0], "run.redriven")] == ["metadata fixed"]
    # a run that is not failed is refused by the client: the CLI says why and exits 1, and nothing is
    # sent, so its history has nothing to record (the shard's own refusal: tests/unit/test_engine_redrive)
    refused = stack.saga("redrive", runs[0])
    assert refused.returncode == 1
    assert "refused" in refused.stderr and "only a failed run can be re-driven" in refused.stderr
    assert f"run {runs[0]} is completed" in refused.stderr
    assert not [e for e in events(stack, runs[0], "callback.rejected") if "request" in e]
    assert stack.record(runs[0])["epoch"] == "2"


def test_a_bag_item_that_fails_once_is_retried_alone_and_the_bag_joins_once(
    stack: Stack, client: SyncClient
) -> None:
    models = [f"bag-retry-{i}" for i in range(50)]
    stack.world.set_fault(models[7], "thumbnail.render", fail_times=1)
    run_id = client.start("thumbnail-batch", {"modelIds": models})
    result = client.wait(run_id, timeout_s=60)
    assert result.state == "completed", result
    assert result.output["thumbnails"] == [{"thumbnailUri": f"thumbs/{m}.png"} for m in models]
    (retry,) = events(stack, run_id, "retry.scheduled")
    assert retry["item"] == 7 and retry["next_attempt"] == 2
    assert [(e["item"], e["attempt"]) for e in events(stack, run_id, "item.dispatched")] == [(7, 2)]
    assert len(events(stack, run_id, "stage.completed")) == 1  # the bag joined once

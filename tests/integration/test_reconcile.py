"""The reconciler on the real services: a run whose task vanished from its queue is nudged and
completes; a claim without a run is dropped; an unsent outbox entry is re-published; a dry run repairs
nothing."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from orchestrator.bus.names import Names
from orchestrator.client import SyncClient
from orchestrator.store.keys import ShardKeys, index_key
from tests.faults import invariants
from tests.integration.stack import Stack, poll, rabbitmqctl, running

pytestmark = pytest.mark.services


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with running("reconcile") as s:
        yield s


# where the stranded tasks wait: their task queue's queue for their contract version
CACHE_LOOKUP_QUEUE = Names().task_queue("tasks.actions", "cache.lookup@1")
RENDER_QUEUE = Names().task_queue("tasks.parallel", "thumbnail.render@3")


def reconcile(stack: Stack, *extra: str) -> dict[str, Any]:
    done = stack.saga("reconcile", "--json", "--min-age-s", "0", *extra)
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


def test_a_run_whose_task_vanished_is_found_nudged_and_completes(stack: Stack) -> None:
    with SyncClient(stack.settings) as client:
        stack.stop("worker")
        run_id = client.start("model-ingest", {"modelId": "stranded-1"})
        poll(lambda: stack.record(run_id).get("s:cache-lookup:status") == "dispatched", 20, what="dispatched")
        poll(lambda: not stack.outbox(stack.record(run_id)["shard"]), 20, what="the dispatch confirmed")
        rabbitmqctl("purge_queue", "-p", stack.vhost, CACHE_LOOKUP_QUEUE)  # the task is gone
        time.sleep(1.1)  # history quiet for a second
        found = reconcile(stack, "--dry-run", "--stranded-after-s", "1")
        assert run_id in found["stranded"] and found["nudged"] == []
        repaired = reconcile(stack, "--stranded-after-s", "1")
        assert run_id in repaired["nudged"]
        stack.start_worker()
        assert client.wait(run_id, timeout_s=30).state == "completed"
    nudged = [e for e in stack.history(run_id) if e["kind"] == "run.nudged"]
    assert len(nudged) == 1 and len(nudged[0]["detail"]["resent"]) == 1


def test_a_claim_without_a_run_is_dropped_and_a_real_claim_kept(stack: Stack) -> None:
    with SyncClient(stack.settings) as client:
        real = client.start("ingest-triage", {"sizeMb": 1, "format": "glb"})
        assert client.wait(real, timeout_s=30).state == "completed"
    orphan = "orphan-claim-1"
    stack.redis.set(index_key(stack.prefix, orphan), "fast.0")
    found = reconcile(stack, "--dry-run")
    assert orphan in found["orphan_claims"] and real not in found["orphan_claims"]
    assert stack.redis.exists(index_key(stack.prefix, orphan))
    repaired = reconcile(stack)
    assert orphan in repaired["dropped_claims"]
    assert not stack.redis.exists(index_key(stack.prefix, orphan))
    assert stack.redis.exists(index_key(stack.prefix, real))


def test_an_unsent_outbox_entry_is_republished_and_marked_sent(stack: Stack) -> None:
    shard = "fast.1"
    entry = {
        "id": "event-reconcile-probe",
        "kind": "run.finished",
        "route": ["events", "run.completed.probe"],
        "body": {"run_id": "probe-run", "state": "completed", "definition": "probe", "output": None},
        "run_id": "probe-run",
        "at": int(time.time() * 1000),
    }
    outbox = ShardKeys(stack.prefix, shard).outbox()
    stack.stop("orchestrator")  # its own relay would re-publish the entry too: this tests the reconciler
    try:
        stack.redis.hset(outbox, entry["id"], json.dumps(entry))
        repaired = reconcile(stack)
    finally:
        stack.start_orchestrator()
    assert "event-reconcile-probe" in repaired["unsent"]
    assert "event-reconcile-probe" in repaired["republished"]
    assert not stack.redis.hexists(outbox, "event-reconcile-probe")


def test_an_outbox_entry_too_large_to_send_is_not_sent_and_its_step_fails_with_why(stack: Stack) -> None:
    # Given a task committed under a 1 MiB limit and left unsent (the orchestrator died after the commit)
    stack.stop("orchestrator")
    stack.start_orchestrator("crashing", extra_env={"SAGA_CRASH_POINTS": "after-commit"})
    with SyncClient(stack.settings) as client:
        run_id = client.start("model-ingest", {"modelId": "m" * 40_000})
    stack.wait_exit("crashing", timeout_s=30)
    shard = poll(lambda: stack.shard_of(run_id), 10, what="the run's shard")
    (task_id,) = stack.outbox(shard)
    # When the reconciler runs where messages are limited to 32 KiB (the limit was lowered since)
    small = {"SAGA_MAX_MESSAGE_BYTES": "32768"}
    done = stack.saga("reconcile", "--json", "--min-age-s", "0", extra_env=small)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    # Then it is not sent: it is reported, removed, and its run nudged, which failed the step with why
    assert report["undeliverable"] == [task_id] and task_id not in report["republished"]
    assert task_id not in stack.outbox(shard)
    record = stack.record(run_id)
    assert record["s:cache-lookup:status"] == "failed"
    assert "the task cannot be sent" in record["reason"] and "32,768" in record["reason"]
    # nothing sent: a worker would have acted on it (its effect is recorded under the task's id, its
    # idempotency key) within this second; the queue's depth would count other runs' tasks in flight
    time.sleep(1.0)
    assert task_id not in stack.world.effects()
    assert stack.queue_depths().get(Names().task_dead_letters("tasks.actions"), 0) == 0  # nor parked
    stack.start_orchestrator()
    assert stack.wait_finished(run_id)["status"] == "failed"


def test_a_bag_whose_item_tasks_vanished_is_nudged_and_only_its_missing_items_are_sent_again(
    stack: Stack,
) -> None:
    with SyncClient(stack.settings) as client:
        stack.stop("worker")
        models = [f"bag-stranded-{i}" for i in range(5)]
        run_id = client.start("thumbnail-batch", {"modelIds": models})
        poll(lambda: stack.record(run_id).get("s:render-all:status") == "dispatched", 20, what="dispatched")
        poll(lambda: not stack.outbox(stack.record(run_id)["shard"]), 20, what="the dispatch confirmed")
        rabbitmqctl("purge_queue", "-p", stack.vhost, RENDER_QUEUE)  # every item task is gone
        time.sleep(1.1)  # history quiet for a second
        repaired = reconcile(stack, "--stranded-after-s", "1")
        assert run_id in repaired["nudged"]
        stack.start_worker()
        result = client.wait(run_id, timeout_s=30)
    assert result.state == "completed" and result.output["count"] == 5
    (nudged,) = [e for e in stack.history(run_id) if e["kind"] == "run.nudged"]
    assert len(nudged["detail"]["resent"]) == 5


# ---- after every scenario above ----------------------------------------------------------------------


def test_the_shared_invariants_hold_over_every_run_the_reconciler_repaired(stack: Stack) -> None:
    """The fault suite's checks over every run of this module (completed, or failed with the reason
    where a step could no longer be sent), the demo's effect ledger, and no dead letters."""
    run_ids = [str(k).rsplit("{", 1)[1].rstrip("}") for k in stack.redis.scan_iter(f"{stack.prefix}:index:*")]
    assert run_ids, "no runs to check: run the scenarios above with this test"
    pending = invariants.wait_for_convergence(stack.redis, stack.prefix, run_ids, 30)
    invariants.assert_no_violations(pending, "liveness")
    violations = invariants.check_runs(stack.redis, stack.prefix, run_ids, expect_state=None, all_runs=True)
    depths = stack.queue_depths()
    invariants.assert_no_violations(violations + invariants.dead_letters(depths), "the reconciler's repairs")

"""End-to-end runs on the real RabbitMQ and Redis: orchestrator and worker as real processes."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from orchestrator.bus.envelope import Envelope
from orchestrator.bus.names import Names
from orchestrator.client import SyncClient, run_id_for
from orchestrator.compiler import compile_text
from orchestrator.provision import publish_plans
from orchestrator.wire import ids
from orchestrator.wire.kinds import Kind
from tests.faults.invariants import assert_no_violations, check_runs
from tests.integration.stack import REGISTRY, ROOT, Stack, now_ms, poll, running

NAMES = Names()  # the stack runs in the default namespace, on a vhost of its own

pytestmark = pytest.mark.services


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with running("e2e") as s:
        yield s


@pytest.fixture(scope="module")
def client(stack: Stack) -> Iterator[SyncClient]:
    with SyncClient(stack.settings) as c:
        yield c


def kinds(stack: Stack, run_id: str) -> list[str]:
    return [e["kind"] for e in stack.history(run_id)]


def test_model_ingest_cache_miss_completes_with_output(stack: Stack, client: SyncClient) -> None:
    # Given a published model-ingest and running processes
    # When a service starts a run for a model the cache does not hold
    run_id = client.start("model-ingest", {"modelId": "miss-1"})
    result = client.wait(run_id, timeout_s=30)
    # Then it completes with its output, through render, both branches, the join and publish
    assert result.state == "completed", result
    assert result.output == {"modelId": "miss-1", "catalogueId": "cat-miss-1"}
    history = kinds(stack, run_id)
    for kind in (
        "run.started",
        "stage.dispatched",
        "decision.taken",
        "fork.released",
        "join.released",
        "intent.set",
        "finaliser.completed",
        "run.completed",
    ):
        assert kind in history, (kind, history)
    assert history.count("join.released") == 1
    status = client.status(run_id)
    assert status["stages"]["render-thumbnail"] == {"state": "completed", "attempt": 1}


def test_model_ingest_cache_hit_skips_rendering(stack: Stack, client: SyncClient) -> None:
    run_id = client.start("model-ingest", {"modelId": "cached-7"})
    result = client.wait(run_id, timeout_s=30)
    assert result.state == "completed"
    assert result.output == {"modelId": "cached-7", "catalogueId": "cat-cached-7"}
    stages = client.status(run_id)["stages"]
    assert "render-thumbnail" not in stages and "derive-join" not in stages
    assert stages["publish"]["state"] == "completed"


def test_failing_worker_stage_fails_the_run_and_runs_the_finaliser(stack: Stack, client: SyncClient) -> None:
    # Given render fails for this model
    stack.world.set_fault("broken-1", "thumbnail.render", fail=True)
    run_id = client.start("model-ingest", {"modelId": "broken-1"})
    result = client.wait(run_id, timeout_s=30)
    # Then the run is failed, with the reason, and the audit finaliser still ran
    assert result.state == "failed"
    assert "render-thumbnail" in (result.reason or "")
    history = kinds(stack, run_id)
    assert "stage.failed" in history and "finaliser.completed" in history and history[-1] == "run.failed"
    assert "publish" not in client.status(run_id)["stages"]


def test_failing_finaliser_turns_a_completed_intent_into_failed(stack: Stack, client: SyncClient) -> None:
    key = "finaliser-fails"
    run_id = run_id_for("model-ingest", key)
    stack.world.set_fault(run_id, "audit.run-terminal", fail=True)  # the audit finaliser keys faults by run
    client.start("model-ingest", {"modelId": "fine-1"}, idempotency_key=key)
    result = client.wait(run_id, timeout_s=30)
    assert result.state == "failed"
    record = stack.record(run_id)
    assert record["intent"] == "completed"  # the intent was completed ...
    assert "finaliser.failed" in kinds(stack, run_id)  # ... but the finaliser failed, and that is retained


def test_fork_branch_failure_cancels_the_sibling_and_records_its_late_completion(
    stack: Stack, client: SyncClient
) -> None:
    # Given semantic analysis fails at once while technical metadata is still working
    run_id = failed_while_metadata_works(stack, client, "fork-1")
    # Then cancellation of the active sibling was requested, and the worker stopped it and said so
    history = stack.history(run_id)
    requested = [e for e in history if e["kind"] == "cancellation.requested"]
    assert [e["stage"] for e in requested] == ["technical-metadata"]
    acknowledged = poll(
        lambda: [e for e in stack.history(run_id) if e["kind"] == "cancellation.acknowledged"],
        10,
        what="the worker's acknowledgement of the cancellation",
    )
    assert [e["stage"] for e in acknowledged] == ["technical-metadata"]
    # When a straggler completion of the cancelled attempt arrives anyway (the same task run again by
    # another worker, so under the same report id), it is recorded as late and changes nothing
    record = stack.record(run_id)
    straggler = metadata_straggler(record, run_id, {"faces": 1, "vertices": 1}, shard=record["shard"])
    stack.publish_envelope(straggler, NAMES.runs_exchange, record["shard"])
    late = late_reports(stack, run_id, "the late completion")
    assert late[0]["stage"] == "technical-metadata"
    assert stack.record(run_id)["s:technical-metadata:status"] == "cancelled"
    assert stack.record(run_id)["s:technical-metadata:status"] == "cancelled"
    assert "s:technical-metadata:result" not in stack.record(run_id)
    assert not any(e["kind"] == "join.released" for e in stack.history(run_id))


def test_a_message_passed_on_to_its_runs_shard_arrives_as_its_sender_signed_it(
    stack: Stack, client: SyncClient
) -> None:
    # Given a run whose technical metadata was cancelled while it was still working
    run_id = failed_while_metadata_works(stack, client, "pass-on-1")
    record = stack.record(run_id)
    # When a straggler report that names no shard reaches another shard's queue, signed over text an
    # earlier release wrote (the standard library writes 1e-05 where this release writes 0.00001)
    result = {"faces": 1, "vertices": 1, "ratio": 1e-05}
    straggler = metadata_straggler(record, run_id, result, key_id=stack.signer.key_for(Kind.RESULT).key_id)
    text = json.dumps(
        straggler.model_dump(mode="json", exclude={"signature"}),
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
    ).encode()
    mac = stack.signer.mac(straggler.key_id, text)
    other = next(s for s in ("fast.0", "fast.1") if s != record["shard"])
    stack.publish_raw(NAMES.runs_exchange, other, text[:-1] + b',"signature":"' + mac.encode() + b'"}')
    # Then that shard passes it on as it came, and the run's own shard verifies it and records it late
    late = late_reports(stack, run_id, "the straggler passed on to the run's shard")
    assert late[0]["stage"] == "technical-metadata"
    assert "s:technical-metadata:result" not in stack.record(run_id)
    assert_no_violations(
        check_runs(stack.redis, stack.prefix, [run_id], expect_state="failed"), "the shared invariants"
    )


def failed_while_metadata_works(stack: Stack, client: SyncClient, model_id: str) -> str:
    """A model-ingest run whose semantic analysis fails at once while its technical metadata still
    works (3 s): the run fails and the metadata attempt is cancelled. Returns the run's id."""
    stack.world.set_fault(model_id, "semantic.analyse", fail=True)
    stack.world.set_fault(model_id, "metadata.extract", delay_ms=3000)
    run_id = client.start("model-ingest", {"modelId": model_id})
    assert client.wait(run_id, timeout_s=30).state == "failed"
    return run_id


def metadata_straggler(
    record: dict[str, str], run_id: str, result: dict[str, Any], **fields: str
) -> Envelope:
    """A report of the run's first technical-metadata attempt under its genuine id, as a worker running
    that task again would send it."""
    fence = record["s:technical-metadata:fence"]
    task = ids.stage_task_id(run_id, "technical-metadata", fence, None, 1)
    return Envelope(
        kind=Kind.RESULT,
        message_id=ids.result_id(task),
        run_id=run_id,
        stage="technical-metadata",
        attempt=1,
        fence=fence,
        digest=record["digest"],
        issued_at_ms=now_ms(),
        body={"ok": True, "result": result},
        **fields,
    )


def late_reports(stack: Stack, run_id: str, what: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = poll(
        lambda: [
            e
            for e in stack.history(run_id)
            if e["kind"] == "callback.rejected" and e["detail"].get("reason") == "late"
        ],
        10,
        what=what,
    )
    return found


@pytest.mark.parametrize("width", [1000, 2500])
def test_a_bag_joins_once_with_results_in_order(stack: Stack, client: SyncClient, width: int) -> None:
    """A bag of 1,000 items is sent at once; one of 2,500 a window of 1,000 at a time (two refills)."""
    before = stack.world.effect_counts().get("thumbnail.render", 0)
    ids = [f"item-{width}-{i:04d}" for i in range(width)]
    run_id = client.start("thumbnail-batch", {"modelIds": ids})
    result = client.wait(run_id, timeout_s=180)
    assert result.state == "completed"
    assert result.output["count"] == width
    assert result.output["thumbnails"] == [{"thumbnailUri": f"thumbs/{i}.png"} for i in ids]
    history = kinds(stack, run_id)
    assert history.count("stage.completed") == 1  # the map completed exactly once
    assert history.count("items.dispatched") == -(-width // 1000) - 1
    assert stack.world.effect_counts().get("thumbnail.render", 0) - before >= width


def test_same_idempotency_key_starts_one_run(stack: Stack, client: SyncClient) -> None:
    first = client.start("ingest-triage", {"sizeMb": 1, "format": "glb"}, idempotency_key="once")
    second = client.start("ingest-triage", {"sizeMb": 1, "format": "glb"}, idempotency_key="once")
    assert first == second
    assert client.wait(first, timeout_s=30).state == "completed"
    history = kinds(stack, first)
    assert history.count("run.started") == 1
    poll(lambda: kinds(stack, first).count("callback.rejected") == 1, 10, what="the duplicate start recorded")


def test_forged_and_oversized_messages_never_touch_a_live_run(stack: Stack, client: SyncClient) -> None:
    # Given a run waiting on a slow render
    stack.world.set_fault("forged-1", "thumbnail.render", delay_ms=600)
    run_id = client.start("model-ingest", {"modelId": "forged-1"})
    poll(
        # dispatched, or running once a worker accepted it (the stage has an execution deadline)
        lambda: stack.record(run_id).get("s:render-thumbnail:status") in ("dispatched", "running"),
        10,
        what="render dispatched",
    )
    record = stack.record(run_id)
    shard = record["shard"]
    fence = record["s:render-thumbnail:fence"]
    # When an attacker publishes a completion signed with the wrong key, and an oversized one
    forged = Envelope(
        kind=Kind.RESULT,
        message_id="forged",
        run_id=run_id,
        shard=shard,
        stage="render-thumbnail",
        attempt=1,
        fence=fence,
        key_id="dev",
        body={"ok": True, "result": {"thumbnailUri": "evil"}},
        signature="0" * 64,
    )
    stack.publish_raw(NAMES.runs_exchange, shard, forged.model_dump_json().encode())
    stack.publish_raw(NAMES.runs_exchange, shard, b"{" + b" " * 2_000_000 + b"}")
    stack.publish_raw(NAMES.runs_exchange, shard, b"not json at all")
    # Then the run completes normally with the worker's real result
    assert client.wait(run_id, timeout_s=30).state == "completed"
    result = json.loads(stack.record(run_id)["s:render-thumbnail:result"])
    assert result == {"thumbnailUri": "thumbs/forged-1.png"}
    assert all(e["kind"] != "callback.rejected" for e in stack.history(run_id))  # no write at all
    depths = poll(
        lambda: (d := stack.queue_depths()).get(NAMES.rejected_queue, 0) >= 3 and d,
        10,
        what="rejections parked",
    )
    assert depths[NAMES.rejected_queue] >= 3


def test_duplicate_stale_and_reordered_completions_change_nothing(stack: Stack, client: SyncClient) -> None:
    # Given a live run whose join has released and whose publish is still working
    stack.world.set_fault("storm-1", "catalogue.publish", delay_ms=1500)
    run_id = client.start("model-ingest", {"modelId": "storm-1"})
    poll(lambda: stack.record(run_id).get("s:publish:status") == "dispatched", 20, what="publish dispatched")
    before = stack.record(run_id)
    shard = before["shard"]

    def result(stage: str, fence: str, value: object, mid: str | None = None) -> Envelope:
        """A report of (stage, fence): under its task's report id unless ``mid`` says otherwise."""
        return Envelope(
            kind=Kind.RESULT,
            message_id=mid or ids.result_id(ids.stage_task_id(run_id, stage, fence, None, 1)),
            run_id=run_id,
            shard=shard,
            stage=stage,
            attempt=1,
            fence=fence,
            digest=before["digest"],
            issued_at_ms=now_ms(),
            body={"ok": True, "result": value},
        )

    # When completions are replayed straight onto the shard queue: reordered, duplicated (re-sent under
    # their own ids), one from a stale fence, and one under an id that answers no task
    storm = [
        result("technical-metadata", "1.1", {"faces": 1, "vertices": 1}),
        result("semantic-analysis", "1.1", {"tags": ["x"]}),
        result("semantic-analysis", "1.1", {"tags": ["y"]}),
        result("render-thumbnail", "0.9", {"thumbnailUri": "old"}),
        result("technical-metadata", "1.1", {"faces": 2, "vertices": 2}, "replay-under-a-new-id"),
    ]
    for envelope in reversed(storm):
        stack.publish_envelope(envelope, NAMES.runs_exchange, shard)
    rejected = poll(
        lambda: (
            [e for e in stack.history(run_id) if e["kind"] == "callback.rejected"]
            if sum(e["kind"] == "callback.rejected" for e in stack.history(run_id)) >= 5
            else None
        ),
        15,
        what="all five recorded as rejected",
    )
    reasons = sorted(e["detail"]["reason"] for e in rejected)
    assert reasons == ["duplicate", "duplicate", "duplicate", "invalid", "stale"], reasons
    # Then no result changed and the join released once; the run completes normally
    after = stack.record(run_id)
    for stage in ("technical-metadata", "semantic-analysis", "render-thumbnail"):
        assert after[f"s:{stage}:result"] == before[f"s:{stage}:result"]
    assert client.wait(run_id, timeout_s=30).state == "completed"
    assert kinds(stack, run_id).count("join.released") == 1


def test_many_concurrent_runs_complete_with_one_effect_per_stage(stack: Stack, client: SyncClient) -> None:
    before = stack.world.effect_counts()
    with ThreadPoolExecutor(8) as pool:
        run_ids = list(
            pool.map(
                lambda i: SyncClient(stack.settings).start("model-ingest", {"modelId": f"c-{i}"}), range(200)
            )
        )
    for run_id in run_ids:
        assert client.wait(run_id, timeout_s=120).state == "completed"
    after = stack.world.effect_counts()
    for contract in (
        "cache.lookup",
        "thumbnail.render",
        "semantic.analyse",
        "metadata.extract",
        "catalogue.publish",
        "audit.run-terminal",
    ):
        assert after.get(contract, 0) - before.get(contract, 0) == 200, contract


def test_kill_9_between_commit_and_publish_loses_nothing(stack: Stack, client: SyncClient) -> None:
    # Given the orchestrator will die right after its first Lua commit that causes messages
    stack.stop("orchestrator")
    stack.start_orchestrator("crashing", extra_env={"SAGA_CRASH_POINTS": "after-commit"})
    run_id = client.start("model-ingest", {"modelId": "crash-1"})
    assert stack.wait_exit("crashing", timeout_s=30) == -signal.SIGKILL
    # The transition committed, its messages sit unsent in the outbox
    shard = poll(lambda: stack.shard_of(run_id), 10, what="the run's shard")
    assert stack.outbox(shard), "the committed transition's messages are in the outbox"
    # When a healthy orchestrator starts, its relay re-publishes them and the redelivered start is a duplicate
    stack.start_orchestrator()
    assert client.wait(run_id, timeout_s=60).state == "completed"
    poll(lambda: not stack.outbox(shard), 15, what="the outbox to drain")
    assert kinds(stack, run_id).count("run.started") == 1


def test_sigterm_drains_and_a_restart_finishes_the_work(stack: Stack, client: SyncClient) -> None:
    # Given a bag of 300 items under way
    run_id = client.start("thumbnail-batch", {"modelIds": [f"drain-{i}" for i in range(300)]})
    poll(lambda: stack.record(run_id).get("s:render-all:status") == "dispatched", 20, what="bag dispatched")
    # When the orchestrator gets SIGTERM mid-way, it finishes its batch and exits cleanly
    assert stack.stop("orchestrator", signal.SIGTERM) == 0
    assert "Traceback" not in stack.log("orchestrator")
    # Then a new orchestrator finishes the run: every item counted once, one release
    stack.start_orchestrator()
    result = client.wait(run_id, timeout_s=120)
    assert result.state == "completed"
    assert result.output["count"] == 300
    assert kinds(stack, run_id).count("stage.completed") == 1


def test_a_running_run_stays_pinned_to_its_plan_when_a_new_version_is_activated(
    stack: Stack, client: SyncClient
) -> None:
    # Given a run of model-ingest 2.3.0 that is still rendering
    stack.world.set_fault("pin-1", "thumbnail.render", delay_ms=800)
    old_run = client.start("model-ingest", {"modelId": "pin-1"})
    poll(
        lambda: stack.record(old_run).get("s:render-thumbnail:status") in ("dispatched", "running"),
        10,
        what="render dispatched",
    )
    old_digest = stack.record(old_run)["digest"]
    # When version 2.4.0 (another meaning: a shorter render deadline) is activated
    text = (
        (ROOT / "definitions" / "model-ingest.yaml")
        .read_text()
        .replace('version: "2.3.0"', 'version: "2.4.0"')
    )
    text = text.replace("execution_deadline_ms: 300000", "execution_deadline_ms: 200000")
    new_plan = compile_text(text, "model-ingest-2.4.0.yaml", REGISTRY)
    assert new_plan.digest != old_digest
    asyncio.run(publish_plans(stack.settings, [new_plan]))
    with SyncClient(stack.settings) as fresh:  # clients cache the active version for a couple of seconds
        new_run = fresh.start("model-ingest", {"modelId": "pin-2"})
    # Then the old run finishes on its own plan, and new runs use the new one
    assert client.wait(old_run, timeout_s=30).state == "completed"
    assert client.wait(new_run, timeout_s=30).state == "completed"
    assert client.status(old_run)["digest"] == old_digest and client.status(old_run)["version"] == "2.3.0"
    assert (
        client.status(new_run)["digest"] == new_plan.digest and client.status(new_run)["version"] == "2.4.0"
    )
    started = next(e for e in stack.history(old_run) if e["kind"] == "run.started")
    assert started["detail"]["digest"] == old_digest


def test_a_standby_orchestrator_takes_over_when_the_active_one_dies(stack: Stack, client: SyncClient) -> None:
    # Given a second orchestrator on the same shards: single active consumer keeps it standing by
    stack.start_orchestrator("standby")
    poll(lambda: "serving" in stack.log("standby"), 10, what="the standby to start")
    run_ids = [client.start("model-ingest", {"modelId": f"failover-{i}"}) for i in range(40)]
    # When the active one is killed mid-load
    assert stack.stop("orchestrator", signal.SIGKILL) == -signal.SIGKILL
    # Then the standby finishes every run, each join released once
    for run_id in run_ids:
        assert client.wait(run_id, timeout_s=60).state == "completed", run_id
        assert kinds(stack, run_id).count("join.released") == 1
    stack.processes["orchestrator"] = stack.processes.pop("standby")  # later tests find an orchestrator


def test_sigterm_drains_a_worker_without_losing_or_repeating_its_task(
    stack: Stack, client: SyncClient
) -> None:
    # Given a worker in the middle of a slow render
    stack.world.set_fault("wdrain-1", "thumbnail.render", delay_ms=1000)
    before = stack.world.effect_counts().get("thumbnail.render", 0)
    run_id = client.start("model-ingest", {"modelId": "wdrain-1"})
    poll(
        lambda: stack.world.effect_counts().get("thumbnail.render", 0) > before,
        10,
        what="the render to start",
    )
    # When it gets SIGTERM, it finishes and reports the task in hand, then exits cleanly
    assert stack.stop("worker", signal.SIGTERM) == 0
    poll(
        lambda: stack.record(run_id).get("s:render-thumbnail:status") == "completed",
        10,
        what="the drained task's result applied, with no worker running",
    )
    # Then a new worker finishes the run, and the render ran exactly once
    stack.start_worker()
    assert client.wait(run_id, timeout_s=30).state == "completed"
    assert stack.world.effect_counts()["thumbnail.render"] == before + 1

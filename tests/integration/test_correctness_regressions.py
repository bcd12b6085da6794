"""The reported invariant violations, reproduced against real processes, RabbitMQ and Redis, one test each.

1. A re-drive whose walk reaches a terminal without dispatching work (a finaliser-only failure, a
   decision-only flow, a context the definition refuses) was dead-lettered as poison.
2. A start just under the message limit created a run whose first task was too large for its worker: the
   run waited for ever, and the reconciler parked copy after copy.
3. A validly signed result labelled ``finaliser:²`` (or fenced ``1.c²``) failed a live run as poison.
4. After a re-drive, a stage that had completed and was not compensated ran a second time.

Also: a cancellation reaches every running item of a map in a worker process, and a run id that would
overflow an AMQP short string is refused at the door.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from orchestrator.bus.envelope import encode, signed_message
from orchestrator.bus.names import Names
from orchestrator.client import StartRefused, SyncClient, run_id_for, start_envelope
from orchestrator.wire import ids
from tests.faults import invariants
from tests.integration.stack import Stack, now_ms, poll, running
from workers.demo.effects import demo_key

NAMES = Names()  # the stack runs in the default namespace, on a vhost of its own

pytestmark = pytest.mark.services


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with running("regressions") as s:
        yield s


@pytest.fixture(scope="module")
def client(stack: Stack) -> Iterator[SyncClient]:
    with SyncClient(stack.settings) as c:
        yield c


def events(stack: Stack, run_id: str, kind: str) -> list[dict[str, Any]]:
    return [e for e in stack.history(run_id) if e["kind"] == kind]


def no_poison_anywhere(stack: Stack, run_id: str) -> None:
    assert not events(stack, run_id, "message.poisoned")
    depths = stack.queue_depths()
    assert all(depths.get(q, 0) == 0 for q in depths if q.endswith(".dlq")), depths
    assert "conflicting writes" not in stack.log("orchestrator")


def raw_start(stack: Stack, run_id: str, definition: str, context: dict[str, Any]) -> bytes:
    """The wire bytes of a signed start that skips the client's checks, as another client might send."""
    digest = stack.active_digest(definition) or ""
    return encode(start_envelope(stack.signer, run_id, definition, str(digest), context))


def start_raw(stack: Stack, run_id: str, definition: str, context: dict[str, Any]) -> None:
    stack.publish_raw(NAMES.start_exchange("fast"), run_id, raw_start(stack, run_id, definition, context))


# ---- 1. a re-drive that reaches a terminal without dispatching work ----------------------------------


def test_redrive_of_a_finaliser_only_failure_applies_and_completes(stack: Stack, client: SyncClient) -> None:
    # Given a model-ingest run that failed only because its finaliser failed
    run_id = run_id_for("model-ingest", f"fin-{uuid.uuid4().hex}")
    stack.world.set_fault(run_id, "audit.run-terminal", fail=True)
    start_raw(stack, run_id, "model-ingest", {"modelId": "fin-only"})
    assert stack.wait_finished(run_id)["status"] == "failed"
    assert stack.record(run_id)["intent"] == "completed"
    stack.redis.delete(demo_key(stack.prefix, "faults", run_id))  # the fault is fixed
    # When it is re-driven
    done = stack.saga("redrive", run_id, "--wait", "30")
    # Then the CLI says what happened, and the run completed, every work stage reused
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{run_id} redriven (epoch 2): completed"
    assert {e["stage"] for e in events(stack, run_id, "stage.reused")} == {
        "cache-lookup",
        "render-thumbnail",
        "semantic-analysis",
        "technical-metadata",
        "publish",
    }
    no_poison_anywhere(stack, run_id)


def test_redrive_of_a_decision_only_failure_applies_and_fails_again_as_a_fresh_run_would(
    stack: Stack, client: SyncClient
) -> None:
    run_id = client.start("ingest-triage", {"sizeMb": 12000, "format": "glb"})
    assert client.wait(run_id, timeout_s=30).state == "failed"
    done = stack.saga("redrive", run_id, "--wait", "30", "--json")
    assert done.returncode == 1, done.stderr  # applied, but the run failed again
    (report,) = json.loads(done.stdout)["runs"]
    assert report["redriven"] and report["epoch"] == 2 and report["state"] == "failed"
    assert "size-gate: branch 0 (context.sizeMb > 2048.0) was taken" in report["reason"]
    no_poison_anywhere(stack, run_id)


def test_redrive_of_a_run_whose_context_is_refused_is_refused_with_why(stack: Stack) -> None:
    run_id = uuid.uuid4().hex
    start_raw(stack, run_id, "model-ingest", {"modelID": "wrong-case"})
    record = stack.wait_finished(run_id)
    assert record["status"] == "failed" and record["reason"].startswith("invalid context")
    done = stack.saga("redrive", run_id)
    assert done.returncode == 1
    assert f"re-drive of {run_id} refused" in done.stderr and "context" in done.stderr
    assert stack.record(run_id)["epoch"] == "1"
    no_poison_anywhere(stack, run_id)


# ---- 2. a start just under the message limit ---------------------------------------------------------


def test_a_start_whose_task_cannot_fit_is_refused_by_the_client_and_failed_by_the_shard(
    stack: Stack, client: SyncClient
) -> None:
    # a start of 1,048,556 bytes (the reported one): it fits SAGA_MAX_MESSAGE_BYTES, its first task not
    run_id = uuid.uuid4().hex
    probe = len(raw_start(stack, run_id, "model-ingest", {"modelId": ""}))
    context = {"modelId": "m" * (1_048_556 - probe)}
    assert len(raw_start(stack, run_id, "model-ingest", context)) == 1_048_556
    # Given the client: refused before anything is sent, saying why
    with pytest.raises(StartRefused) as refused:
        client.start("model-ingest", context)
    assert any("stage cache-lookup: the task cannot be sent" in p for p in refused.value.problems)
    # And a start that skipped the client: the shard fails the run at once, with the reason
    parked_before = stack.queue_depths().get(NAMES.rejected_queue, 0)
    start_raw(stack, run_id, "model-ingest", context)
    record = stack.wait_finished(run_id, timeout_s=30)
    assert record["status"] == "failed"
    assert "stage cache-lookup: the task cannot be sent" in record["reason"]
    assert not events(stack, run_id, "stage.dispatched")  # nothing was sent that nobody can read
    assert stack.queue_depths().get(NAMES.rejected_queue, 0) == parked_before
    # and the reconciler has nothing to re-send
    report = stack.saga_json("reconcile", "--min-age-s", "0", "--stranded-after-s", "0")
    assert run_id not in report["stranded"] and not report["undeliverable"]


def test_the_cli_refuses_a_start_too_large_for_the_limit_and_says_why(stack: Stack) -> None:
    context = json.dumps({"modelId": "m" * 70_000})
    small = {"SAGA_MAX_MESSAGE_BYTES": "65536"}
    refused = stack.saga("start", "model-ingest", "--context", context, extra_env=small)
    assert refused.returncode == 1
    assert "refused; nothing was sent" in refused.stderr and "SAGA_MAX_MESSAGE_BYTES 65,536" in refused.stderr
    assert stack.saga("start", "model-ingest", "--context", context).returncode == 0  # the default fits


# ---- 3. a validly signed, malformed result -------------------------------------------------------------


@pytest.mark.parametrize(
    ("stage", "fence"), [("finaliser:²", "1.f0"), ("compensate:render-thumbnail", "1.c²")]
)
def test_a_signed_result_with_a_superscript_digit_is_parked_and_the_run_completes(
    stack: Stack, client: SyncClient, stage: str, fence: str
) -> None:
    model = f"sup-{uuid.uuid4().hex[:6]}"
    stack.world.set_fault(model, "thumbnail.render", delay_ms=1500)
    run_id = client.start("model-ingest", {"modelId": model})
    poll(lambda: stack.record(run_id).get("s:render-thumbnail:status"), 20, what="render dispatched")
    record = stack.record(run_id)
    parked_before = stack.queue_depths().get(NAMES.rejected_queue, 0)
    body = signed_message(
        stack.signer,
        kind="result",
        message_id=f"result-{uuid.uuid4().hex}",
        run_id=run_id,
        shard=record["shard"],
        stage=stage,
        attempt=1,
        fence=fence,
        digest=record["digest"],
        issued_at_ms=now_ms(),  # fresh: what refuses it must be the check this test is about
        body={"ok": True, "result": {"recorded": True}},
    )
    stack.publish_raw(NAMES.runs_exchange, record["shard"], body)
    poll(lambda: stack.queue_depths().get(NAMES.rejected_queue, 0) > parked_before, 20, what="parked")
    result = client.wait(run_id, timeout_s=30)
    assert result.state == "completed", result
    no_poison_anywhere(stack, run_id)


# ---- 4. a re-drive never runs again what completed and was not compensated ----------------------------


def test_after_a_redrive_a_stage_that_completed_and_was_not_undone_does_not_run_again(
    stack: Stack, client: SyncClient
) -> None:
    # Given semantic analysis fails after technical metadata completed (and render is undone)
    model = f"twice-{uuid.uuid4().hex[:6]}"
    stack.world.set_fault(model, "semantic.analyse", fail=True, delay_ms=1500)
    run_id = client.start("model-ingest", {"modelId": model})
    assert client.wait(run_id, timeout_s=30).state == "failed"
    assert stack.record(run_id)["s:technical-metadata:status"] == "completed"
    assert stack.record(run_id)["s:render-thumbnail:status"] == "compensated"
    metadata_before = stack.world.effect_counts().get("metadata.extract", 0)
    stack.redis.delete(demo_key(stack.prefix, "faults", model))
    # When it is re-driven
    done = stack.saga("redrive", run_id, "--wait", "30")
    assert done.returncode == 0, done.stderr
    # Then render ran again (it was undone), technical metadata did not (one effect, one dispatch)
    trail = stack.history(run_id)
    cut = next(i for i, e in enumerate(trail) if e["kind"] == "run.redriven")
    again = [e["stage"] for e in trail[cut:] if e["kind"] == "stage.dispatched"]
    assert "render-thumbnail" in again and "semantic-analysis" in again
    assert "technical-metadata" not in again and "cache-lookup" not in again
    assert stack.world.effect_counts().get("metadata.extract", 0) == metadata_before
    key = ids.stage_task_id(run_id, "technical-metadata", "1.1", None, 1)
    assert stack.world.effects().get(key) == "metadata.extract"  # the one effect, of epoch 1
    no_poison_anywhere(stack, run_id)


# ---- and the fragile spots ---------------------------------------------------------------------------


def test_cancelling_a_run_reaches_every_running_item_of_its_map(stack: Stack, client: SyncClient) -> None:
    # Given a bag of six slow items, all running in the one worker process (concurrency 16)
    models = [f"slow-{uuid.uuid4().hex[:6]}-{i}" for i in range(6)]
    for model in models:
        stack.world.set_fault(model, "thumbnail.render", delay_ms=30_000)
    run_id = client.start("thumbnail-batch", {"modelIds": models})
    poll(
        lambda: all(stack.world.effects().get(_item_task(stack, run_id, i)) for i in range(6)),
        20,
        what="every item running",
    )
    # When the run is cancelled
    done = stack.saga("cancel", run_id, "--reason", "enough", "--wait", "30")
    assert done.returncode == 0, done.stderr
    # Then every item was stopped and said so, long before its 30 s delay was over
    acknowledged = poll(
        lambda: len(a := events(stack, run_id, "cancellation.acknowledged")) == 6 and a,
        10,
        what="six acknowledgements",
    )
    assert sorted(e["detail"]["item"] for e in acknowledged) == list(range(6))
    assert client.wait(run_id, timeout_s=10).state == "failed"


def _item_task(stack: Stack, run_id: str, item: int) -> str:
    return ids.stage_task_id(run_id, "render-all", "1.1", item, 1)


def test_a_run_id_too_long_for_an_amqp_short_string_is_refused_at_the_door(stack: Stack) -> None:
    parked_before = stack.queue_depths().get(NAMES.rejected_queue, 0)
    body = signed_message(
        stack.signer,
        kind="start",
        message_id="start-" + "é" * 150,
        run_id="é" * 150,
        issued_at_ms=now_ms(),
        body={"definition": "model-ingest", "context": {"modelId": "m-1"}},
    )
    stack.publish_raw(NAMES.start_exchange("fast"), "any", body)
    poll(lambda: stack.queue_depths().get(NAMES.rejected_queue, 0) > parked_before, 20, what="parked")
    assert stack.processes["orchestrator"].poll() is None
    assert "struct.error" not in stack.log("orchestrator")


# ---- after every scenario above ----------------------------------------------------------------------


def test_the_shared_invariants_hold_over_every_run_of_these_scenarios(stack: Stack) -> None:
    """The fault suite's checks over every run this module made (they end completed or failed, as each
    scenario meant), the demo's effect ledger, and no dead letters (parked refusals on saga.rejected
    are what some scenarios expect)."""
    run_ids = [str(k).rsplit("{", 1)[1].rstrip("}") for k in stack.redis.scan_iter(f"{stack.prefix}:index:*")]
    assert run_ids, "no runs to check: run the scenarios above with this test"
    pending = invariants.wait_for_convergence(stack.redis, stack.prefix, run_ids, 30)
    invariants.assert_no_violations(pending, "liveness")
    violations = invariants.check_runs(stack.redis, stack.prefix, run_ids, expect_state=None, all_runs=True)
    depths = {q: n for q, n in stack.queue_depths().items() if q.endswith(".dlq")}
    invariants.assert_no_violations(violations + invariants.dead_letters(depths), "the regression scenarios")

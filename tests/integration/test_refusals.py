"""What the ``saga`` command refuses against a real stack, and that a refusal sends nothing: a start the
door refuses, a misspelt definition, an idempotency key reused with another context, a cancel or re-drive
of a run that has ended, errors as the ``--json`` error document; ``definitions publish`` with a user's
own contracts module; ``dead-letters list`` and ``purge`` scoped to the namespace.

Two stacks of their own (vhost and key prefix): an idle one, where no orchestrator consumes, so a start
that was published is still counted on its shard queue; and a served one, for runs that must end.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aio_pika
import pytest

from orchestrator.bus.names import Names, parse_shards
from orchestrator.client import IdempotencyConflict, SyncClient, context_digest, run_id_for
from orchestrator.store.keys import idempotency_key
from tests.integration.stack import Stack, running
from workers.demo.effects import demo_key

pytestmark = pytest.mark.services

NAMES = Names()  # the stacks run in the default namespace, each on a vhost of its own
PARALLEL_DLQ = NAMES.task_dead_letters("tasks.parallel")
OTHER_DLQ = Names("other").task_dead_letters("tasks.parallel")  # another namespace on the same vhost


@pytest.fixture(scope="module")
def idle() -> Iterator[Stack]:
    stack = Stack("refusals-idle")
    stack.setup()
    try:
        yield stack
    finally:
        stack.teardown()


@pytest.fixture(scope="module")
def served() -> Iterator[Stack]:
    with running("refusals") as stack:
        yield stack


def error_of(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """The ``--json`` error document, which must be all of stdout."""
    document = json.loads(done.stdout)
    assert set(document) == {"error"} and set(document["error"]) == {"code", "message", "ids"}, document
    error: dict[str, Any] = document["error"]
    return error


def depths(stack: Stack, *queues: str) -> dict[str, int]:
    """Ready messages per queue, from the queues themselves (rabbitmqctl's counts lag by seconds)."""

    async def go() -> dict[str, int]:
        connection = await aio_pika.connect(stack.settings.amqp_url)
        try:
            channel = await connection.channel()
            found = {}
            for queue in queues:
                declared = await channel.declare_queue(queue, passive=True)
                found[queue] = declared.declaration_result.message_count or 0
            return found
        finally:
            await connection.close()

    return asyncio.run(go())


def starts_sent(stack: Stack) -> int:
    """Start messages waiting on the shard queues (nobody consumes them on the idle stack)."""
    settings = stack.settings
    shards = parse_shards("", settings.shard_classes, settings.shard_count)
    return sum(depths(stack, *(NAMES.shard_queue(shard) for shard in shards)).values())


def requests_recorded(stack: Stack, run_id: str) -> list[dict[str, Any]]:
    """What the run's history says of operator requests: applied, or refused with the request's id."""
    return [
        e
        for e in stack.history(run_id)
        if e["kind"] in ("cancel.requested", "run.redriven") or "request" in e["detail"]
    ]


# ---- 1. one error shape -----------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["status", "history", "cancel", "redrive"])
def test_an_unknown_run_under_json_is_the_error_document(idle: Stack, command: str) -> None:
    done = idle.saga(command, "0" * 32, "--json")
    assert done.returncode == 1, done.stderr
    error = error_of(done)
    assert error["code"] == "run_not_found" and error["ids"] == {"run_id": "0" * 32}
    assert done.stderr == ""
    # text stays 'error: ...' on stderr
    text = idle.saga(command, "0" * 32)
    assert text.returncode == 1 and text.stderr.startswith("error: run 00000000") and text.stdout == ""


# ---- 2. the door ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("context", "says"),
    [
        ('{"modelID": "m-1"}', "'modelId' is a required property"),
        ('{"modelId": 5}', "modelId: 5 is not of type 'string'"),
        (None, "'modelId' is a required property"),
    ],
    ids=["misspelt-field", "wrong-type", "no-context"],
)
def test_a_context_the_schema_refuses_is_refused_before_anything_is_sent(
    idle: Stack, context: str | None, says: str
) -> None:
    before = starts_sent(idle)
    args = ["--context", context] if context is not None else []
    done = idle.saga("start", "model-ingest", *args, "--idempotency-key", f"door-{context}")
    assert done.returncode == 1, done.stdout
    assert "refused; nothing was sent" in done.stderr and says in done.stderr
    run_id = run_id_for("model-ingest", f"door-{context}")
    assert idle.redis.get(idempotency_key(idle.prefix, run_id)) is None  # not even the key was claimed
    assert starts_sent(idle) == before


def test_a_context_with_several_problems_lists_every_one(idle: Stack) -> None:
    done = idle.saga("start", "ingest-triage", "--context", '{"sizeMb": -1, "format": 3}', "--json")
    assert done.returncode == 1
    error = error_of(done)
    assert error["code"] == "start_refused" and error["ids"] == {"definition": "ingest-triage"}
    problems = [line for line in error["message"].splitlines() if line.startswith("  - ")]
    assert len(problems) == 2, error["message"]


def test_a_misspelt_definition_gets_the_closest_published_name(idle: Stack) -> None:
    before = starts_sent(idle)
    done = idle.saga("start", "model-ingets", "--context", '{"modelId": "m-1"}')
    assert done.returncode == 1
    assert "'model-ingets' is not published (did you mean 'model-ingest'?)" in done.stderr
    document = idle.saga("start", "model-ingets", "--context", '{"modelId": "m-1"}', "--json")
    error = error_of(document)
    assert error["code"] == "definition_not_found"
    assert error["ids"] == {"definition": "model-ingets", "did_you_mean": "model-ingest"}
    # nothing close: no guess
    far = error_of(idle.saga("start", "zzz", "--json"))
    assert far["ids"] == {"definition": "zzz"} and "did you mean" not in far["message"]
    assert starts_sent(idle) == before


# ---- 3. idempotency keys ----------------------------------------------------------------------------------


def test_an_idempotency_key_with_another_context_is_refused_with_both_digests(idle: Stack) -> None:
    key, first, other = "upload-42", {"modelId": "m-1"}, {"modelId": "m-2"}
    started = idle.saga_json(
        "start", "model-ingest", "--context", json.dumps(first), "--idempotency-key", key
    )
    run_id = started["run_id"]
    claim = idempotency_key(idle.prefix, run_id)
    assert idle.redis.get(claim) == context_digest(first)
    assert 0 < idle.redis.pttl(claim) <= idle.settings.retention_ms  # kept as long as a run is
    sent = starts_sent(idle)

    # the same key and context: the same run, as before (the start is sent again; the shard makes one run)
    again = idle.saga_json("start", "model-ingest", "--context", json.dumps(first), "--idempotency-key", key)
    assert again["run_id"] == run_id
    assert starts_sent(idle) == sent + 1

    # the same key, another context: refused, with both digests, and nothing sent
    done = idle.saga(
        "start", "model-ingest", "--context", json.dumps(other), "--idempotency-key", key, "--json"
    )
    assert done.returncode == 1
    error = error_of(done)
    assert error["code"] == "idempotency_conflict"
    assert error["ids"] == {
        "definition": "model-ingest",
        "idempotency_key": key,
        "run_id": run_id,
        "claimed_digest": context_digest(first),
        "context_digest": context_digest(other),
    }
    assert context_digest(first) in error["message"] and context_digest(other) in error["message"]
    assert starts_sent(idle) == sent + 1

    # a service's client refuses it the same way
    with SyncClient(idle.settings) as client, pytest.raises(IdempotencyConflict) as caught:
        client.start("model-ingest", other, idempotency_key=key)
    assert caught.value.run_id == run_id and caught.value.claimed_digest == context_digest(first)
    with SyncClient(idle.settings) as client:
        assert client.start("model-ingest", {"modelId": "m-1"}, idempotency_key=key) == run_id
    assert idle.redis.get(claim) == context_digest(first)


# ---- 4. cancel and re-drive of a run that has ended -------------------------------------------------------


def test_a_start_that_could_not_be_sent_gives_its_idempotency_key_back(idle: Stack) -> None:
    # Given a start whose publish fails: its namespace has no start exchange on this broker
    key = "upload-unsent"
    nowhere = {"SAGA_NAMESPACE": "nowhere", "SAGA_KEY_PREFIX": idle.prefix}
    lost = idle.saga(
        "start", "model-ingest", "--context", '{"modelId": "m-1"}', "--idempotency-key", key,
        extra_env=nowhere,
    )  # fmt: skip
    assert lost.returncode == 2, lost.stderr  # RabbitMQ refused it: a configuration error
    run_id = run_id_for("model-ingest", key)
    assert idle.redis.get(idempotency_key(idle.prefix, run_id)) is None  # the claim went back
    # When the key is used again with a corrected context, in the right namespace
    sent = idle.saga_json(
        "start", "model-ingest", "--context", '{"modelId": "m-2"}', "--idempotency-key", key
    )
    # Then it is not refused as a conflict with a start that never left
    assert sent["run_id"] == run_id


def test_cancel_and_redrive_of_a_completed_run_are_refused_with_its_state(served: Stack) -> None:
    started = served.saga_json("start", "model-ingest", "--context", '{"modelId": "ended-1"}', "--wait", "30")
    run_id = started["run_id"]
    assert started["state"] == "completed"

    done = served.saga("cancel", run_id)
    assert done.returncode == 1 and done.stdout == ""
    assert f"run {run_id} is completed" in done.stderr and "nothing was sent" in done.stderr
    error = error_of(served.saga("cancel", run_id, "--json"))
    assert error["code"] == "cancel_refused"
    assert error["ids"] == {"run_id": run_id, "state": "completed", "intent": "completed"}

    done = served.saga("redrive", run_id)
    assert done.returncode == 1
    assert f"re-drive of {run_id} refused" in done.stderr and f"run {run_id} is completed" in done.stderr
    done = served.saga("redrive", run_id, "--json")
    assert done.returncode == 1
    (report,) = json.loads(done.stdout)["runs"]
    assert report["redriven"] is False and report["request"] is None
    assert "only a failed run can be re-driven" in report["refused"] and "is completed" in report["refused"]

    # nothing was sent: the run's history has no cancel and no refused request
    assert requests_recorded(served, run_id) == []


def test_cancel_of_a_failed_run_is_refused_and_redrive_still_applies(served: Stack) -> None:
    served.world.set_fault("ended-2", "cache.lookup", fail=True)
    done = served.saga(
        "start", "model-ingest", "--context", '{"modelId": "ended-2"}', "--wait", "30", "--json"
    )
    run_id = json.loads(done.stdout)["run_id"]
    assert json.loads(done.stdout)["state"] == "failed"

    done = served.saga("cancel", run_id, "--reason", "too late")
    assert done.returncode == 1
    assert f"run {run_id} is failed" in done.stderr and "nothing to cancel" in done.stderr
    assert requests_recorded(served, run_id) == []

    # a failed run is what a re-drive is for: the client lets it through
    served.redis.delete(demo_key(served.prefix, "faults", "ended-2"))
    done = served.saga("redrive", run_id, "--wait", "30")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{run_id} redriven (epoch 2): completed"


# ---- 5. a user's own contracts module ---------------------------------------------------------------------

OWN_CONTRACTS = """\
from workers.demo.models import CacheLookupOutput, ModelRef
from workers.sdk import action


@action("own.thing", version=7, input=ModelRef, output=CacheLookupOutput, queue="own")
def own_thing(payload: ModelRef) -> CacheLookupOutput:
    return CacheLookupOutput(modelId=payload.modelId, hit=True)
"""
OWN_FLOW = """\
name: own-flow
version: "1.0.0"
class: fast
entry: thing
context:
  type: object
  properties:
    modelId: { type: string }
  required: [modelId]
stages:
  - name: thing
    type: action
    action: own.thing@7
    input: { modelId: "${context.modelId}" }
    on_success: completed
"""


def test_definitions_publish_compiles_against_a_users_own_contracts_module(
    idle: Stack, tmp_path: Path
) -> None:
    (tmp_path / "own_contracts.py").write_text(OWN_CONTRACTS)
    flow = tmp_path / "own-flow.yaml"
    flow.write_text(OWN_FLOW)
    env = {"PYTHONPATH": str(tmp_path)}
    # Without it, the definition's contract is unknown, and the error names an option publish has
    done = idle.saga("definitions", "publish", str(flow), extra_env=env)
    assert done.returncode == 1
    assert "'own.thing@7' is not registered" in done.stderr and "passed with --contracts" in done.stderr
    # With it, the plan is published and new runs use it
    done = idle.saga(
        "definitions", "publish", "--contracts", "own_contracts", str(flow), "--json", extra_env=env
    )
    assert done.returncode == 0, done.stderr
    (published,) = json.loads(done.stdout)
    assert published["definition"] == "own-flow"
    assert published["state"] == "published" and idle.active_digest("own-flow") is None
    # A module that cannot be imported says what would make it importable
    done = idle.saga("definitions", "publish", "--contracts", "own_contracts", str(flow))
    assert done.returncode == 2
    assert "must be importable" in done.stderr and "PYTHONPATH=. from the directory holding it" in done.stderr


# ---- 6. dead letters of the namespace ---------------------------------------------------------------------


def put(stack: Stack, queue: str, *bodies: bytes, declare: bool = False) -> None:
    """Publish straight to ``queue`` through the default exchange (``declare``: a plain queue first)."""

    async def go() -> None:
        connection = await aio_pika.connect(stack.settings.amqp_url)
        try:
            channel = await connection.channel(publisher_confirms=True)
            if declare:
                await channel.declare_queue(queue, durable=True)
            for body in bodies:
                await channel.default_exchange.publish(
                    aio_pika.Message(body, delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
                    routing_key=queue,
                    mandatory=True,
                )
        finally:
            await connection.close()

    asyncio.run(go())


def test_dead_letters_list_and_purge_keep_to_the_namespace(idle: Stack) -> None:
    # Given two dead letters on one queue, one on the rejected queue, and one in another namespace
    put(idle, PARALLEL_DLQ, b"one", b"two")
    put(idle, NAMES.rejected_queue, b"three")
    put(idle, OTHER_DLQ, b"not ours", declare=True)

    # When they are listed: only the namespace's queues, and the summary counts the queues holding some
    listed = idle.saga("dead-letters", "list")
    assert listed.returncode == 0, listed.stderr
    assert "3 dead letters in 2 queues" in listed.stderr, listed.stderr
    assert OTHER_DLQ not in listed.stdout
    queues = {q["queue"]: q["count"] for q in idle.saga_json("dead-letters", "list")["queues"]}
    assert all(NAMES.is_dead_letter_queue(q) for q in queues) and OTHER_DLQ not in queues
    assert queues[PARALLEL_DLQ] == 2 and queues[NAMES.rejected_queue] == 1

    # A purge without --yes is refused and removes nothing
    done = idle.saga("dead-letters", "purge")
    assert done.returncode == 2 and "--yes" in done.stderr
    assert depths(idle, PARALLEL_DLQ)[PARALLEL_DLQ] == 2

    # One queue, then the rest: each says how many went
    one = idle.saga_json("dead-letters", "purge", "--yes", "--queue", NAMES.rejected_queue)
    assert one == {"queues": [{"queue": NAMES.rejected_queue, "exists": True, "purged": 1}]}
    rest = idle.saga("dead-letters", "purge", "--yes")
    assert rest.returncode == 0, rest.stderr
    assert rest.stdout.splitlines() == [f"purged 2 messages from {PARALLEL_DLQ}"]
    assert "purged 2 dead letters from 1 queue" in rest.stderr

    # Then the namespace's queues are empty, and the other namespace's letter is where it was
    assert depths(idle, PARALLEL_DLQ, NAMES.rejected_queue, OTHER_DLQ) == {
        PARALLEL_DLQ: 0,
        NAMES.rejected_queue: 0,
        OTHER_DLQ: 1,
    }
    done = idle.saga("dead-letters", "purge", "--yes", "--queue", OTHER_DLQ, "--json")
    assert done.returncode == 2 and error_of(done)["code"] == "not_a_dead_letter_queue"


def test_publish_with_one_invalid_file_publishes_none(idle: Stack) -> None:
    # Given a valid definition not yet published, and an invalid one, in one publish
    apps = ["tests.integration.probe_apps.a", "tests.integration.probe_apps.b"]
    contracts = [arg for app in apps for arg in ("--contracts", app)]
    valid = "tests/integration/probe_apps/probe-chain.yaml"
    done = idle.saga("definitions", "publish", valid, "docs/examples/broken-model-ingest.yaml", *contracts)
    # Then it exits 1 with the problems, and the valid one did not become active either
    assert done.returncode == 1 and "broken-model-ingest.yaml" in done.stderr, done.stderr
    assert idle.active_digest("probe-chain") is None
    assert idle.saga("definitions", "list", "probe-chain").returncode == 1  # not even published

"""Freshness against the real services (orchestrator/wire/freshness.py): a genuine message replayed after its
window, or issued beyond the clock skew in the future, is refused before any write and parked on
saga.rejected with the reason; one replayed inside its window is a recognised duplicate; a start replayed
after its run's records expired is refused, and an operator's dead-letter replay, which issues it again
(orchestrator/bus/reissue.py), still works.

The stack keeps runs 10 s after they end and takes messages for 4 s, so a replay outlives both quickly."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from orchestrator.bus.envelope import encode
from orchestrator.bus.names import Names
from orchestrator.client import RunNotFound, SyncClient, start_envelope
from tests.faults.invariants import assert_sound
from tests.integration.refusals import parked_at_least, parked_one, publish_result, run_keys
from tests.integration.stack import Stack, now_ms, poll, running

NAMES = Names()
RETENTION_MS, WINDOW_MS, SKEW_MS = 10_000, 4_000, 1_000

pytestmark = pytest.mark.services


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    windows = {"RETENTION_MS": RETENTION_MS, "MESSAGE_WINDOW_MS": WINDOW_MS, "CLOCK_SKEW_MS": SKEW_MS}
    with running("freshness", {f"SAGA_{name}": str(ms) for name, ms in windows.items()}) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack: Stack) -> Iterator[SyncClient]:
    with SyncClient(stack.settings) as c:
        yield c


def test_a_result_replayed_late_or_from_the_future_is_parked_and_changes_nothing(
    stack: Stack, client: SyncClient
) -> None:
    # Given a completed run
    run_id = client.start("model-ingest", {"modelId": "fresh-1"})
    assert client.wait(run_id, timeout_s=30).state == "completed"
    record = stack.record(run_id)
    before = run_keys(stack, run_id)
    # When its publish result is sent again: once long after it was issued, once dated in the future
    stale = publish_result(stack, record, run_id, now_ms() - WINDOW_MS - 2_000)
    future = publish_result(stack, record, run_id, now_ms() + SKEW_MS + 60_000)
    # Then both are parked on saga.rejected with their reason, naming the message
    first, second = poll(lambda: parked_at_least(stack, 2), 15, what="two refusals parked")
    # (the same message id: both are copies of one genuine result, as a replay is)
    assert first["message_id"] == second["message_id"] == stale.message_id == future.message_id
    assert first["reason"] == "stale" and "beyond its 4000 ms window" in first["detail"]
    assert second["reason"] == "future-dated" and "SAGA_CLOCK_SKEW_MS" in second["detail"]
    # And nothing of the run changed: not even a refusal record in its history
    assert run_keys(stack, run_id) == before
    # When the same result is sent again inside its window, it is a recognised duplicate: one refusal record
    publish_result(stack, record, run_id, now_ms())
    poll(
        lambda: any(e["kind"] == "callback.rejected" for e in stack.history(run_id)),
        15,
        what="the duplicate recorded",
    )
    after = run_keys(stack, run_id)
    history_key = next(k for k in after if k.endswith(":history"))
    added = after[history_key][len(before[history_key]) :]
    assert [fields["kind"] for _, fields in added] == ["callback.rejected"]
    assert {k: v for k, v in after.items() if k != history_key} == {
        k: v for k, v in before.items() if k != history_key
    }
    assert_sound(stack.redis, stack.prefix, [run_id])


def test_a_start_replayed_after_its_run_expired_is_refused_and_an_operator_can_replay_it(
    stack: Stack, client: SyncClient
) -> None:
    # Given a start as a client signs it, and the run it made, finished and expired
    digest = stack.active_digest("model-ingest")
    assert digest is not None
    run_id = f"fresh-start-{now_ms()}"
    start = start_envelope(stack.signer, run_id, "model-ingest", digest, {"modelId": "fresh-2"})
    shard_class = "fast"  # model-ingest's
    stack.publish_raw(NAMES.start_exchange(shard_class), run_id, encode(start))
    assert client.wait(run_id, timeout_s=30).state == "completed"
    shard = stack.shard_of(run_id)
    poll(
        lambda: not stack.redis.exists(f"{stack.prefix}:{{{shard}}}:run:{run_id}"),
        30,
        what="its records to expire",
    )
    # When the captured start is sent again
    stack.publish_raw(NAMES.start_exchange(shard_class), run_id, encode(start))
    # Then it is parked as stale, and no run is made again
    letter = poll(lambda: parked_one(stack, start.message_id), 15, what="the replayed start parked")
    assert letter["reason"] == "stale"
    with pytest.raises(RunNotFound):
        client.status(run_id)
    # When an operator replays it on purpose: issued again under the operator's key, it starts the run
    done = stack.saga("dead-letters", "replay", start.message_id)
    assert done.returncode == 0, done.stderr
    assert client.wait(run_id, timeout_s=30).state == "completed"
    assert parked_one(stack, start.message_id) is None
    assert_sound(stack.redis, stack.prefix, [run_id])

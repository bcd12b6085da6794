"""What tests of refused messages share: a run's keys to compare before and after, what saga.rejected
holds, and a genuine result of a run's publish stage to replay or forge from."""

from __future__ import annotations

from typing import Any

from orchestrator.bus.envelope import Envelope, Signer, encode
from orchestrator.bus.names import Names
from orchestrator.wire import ids
from orchestrator.wire.kinds import Kind
from tests.integration.stack import Stack

NAMES = Names()


def run_keys(stack: Stack, run_id: str) -> dict[str, Any]:
    """Every key of the run, with what it holds: compared before and after a refusal."""
    shard = stack.shard_of(run_id)
    found: dict[str, Any] = {}
    for key in sorted(stack.redis.scan_iter(match=f"{stack.prefix}:{{{shard}}}:run:{run_id}*", count=1000)):
        kind = stack.redis.type(key)
        if kind == "hash":
            found[key] = stack.redis.hgetall(key)
        elif kind == "stream":
            found[key] = stack.redis.xrange(key)
        elif kind == "set":
            found[key] = sorted(stack.redis.smembers(key))
        else:
            found[key] = kind
    return found


def parked(stack: Stack) -> list[dict[str, Any]]:
    """What saga.rejected holds, oldest first."""
    listing = stack.saga_json("dead-letters", "list", "--queue", NAMES.rejected_queue)
    [queue] = listing["queues"]
    return list(queue["messages"])


def parked_at_least(stack: Stack, count: int) -> list[dict[str, Any]] | None:
    found = parked(stack)
    return found if len(found) >= count else None


def parked_one(stack: Stack, message_id: str) -> dict[str, Any] | None:
    return next((m for m in parked(stack) if m["message_id"] == message_id), None)


def publish_result(
    stack: Stack, record: dict[str, str], run_id: str, issued_at_ms: int, signer: Signer | None = None
) -> Envelope:
    """The genuine report of the run's publish stage, as its worker signed it (with ``signer``, else the
    stack's), issued at ``issued_at_ms``."""
    envelope = (signer or stack.signer).sign(publish_report(record, run_id, issued_at_ms))
    stack.publish_raw(NAMES.runs_exchange, record["shard"], encode(envelope))
    return envelope


def publish_report(record: dict[str, str], run_id: str, issued_at_ms: int) -> Envelope:
    """The run's publish stage's report, unsigned."""
    fence = record["s:publish:fence"]
    return Envelope(
        kind=Kind.RESULT,
        message_id=ids.result_id(ids.stage_task_id(run_id, "publish", fence, None, 1)),
        run_id=run_id,
        shard=record["shard"],
        stage="publish",
        attempt=1,
        fence=fence,
        digest=record["digest"],
        issued_at_ms=issued_at_ms,
        body={"ok": True, "result": {"catalogueId": "cat-x", "published": True}},
        contract="catalogue.publish@2",
    )

"""Durable timers: how they are named, when they are due, and the retry backoff. Pure.

Every timer of a shard is a member of one sorted set (score: due time in ms). A member names exactly one
clock of one attempt, ``<run>|<clock>|<stage>|<fence>``, so setting it again moves it (a heartbeat) and a
timer of an older attempt can never act on a newer one: the engine compares its fence with the stage's.
"""

from __future__ import annotations

import hashlib

from orchestrator.engine.model import Clock
from orchestrator.engine.plan import Retry

SEPARATOR = "|"

WHAT_EXPIRED = {
    Clock.QUEUE: "queue deadline of {ms} ms passed: no worker accepted the task",
    Clock.EXECUTION: "execution deadline of {ms} ms passed: no result from the worker",
    Clock.HEARTBEAT: "no heartbeat from the worker for {ms} ms",
    Clock.RUN: "run deadline of {ms} ms passed",
}


def member(run_id: str, clock: Clock, stage: str, fence: str) -> str:
    return SEPARATOR.join((run_id, clock.value, stage, fence))


def parse_member(text: str) -> tuple[str, Clock, str, str] | None:
    """(run id, clock, stage, fence) of a timer member; None if it is not one of ours."""
    parts = text.rsplit(SEPARATOR, 3)
    if len(parts) != 4 or parts[1] not in Clock.__members__.values():
        return None
    return parts[0], Clock(parts[1]), parts[2], parts[3]


def backoff_ms(policy: Retry, run_id: str, stage: str, failed_attempt: int) -> int:
    """Exponential backoff before attempt ``failed_attempt + 1``, capped, minus a jitter fraction.

    The jitter is drawn from a hash of (run, stage, attempt), not a random source, so the engine stays
    pure and a replayed history schedules the same retry at the same time."""
    base = policy.initial_backoff_ms * policy.backoff_multiplier ** (failed_attempt - 1)
    delay = min(float(policy.max_backoff_ms), base)
    digest = hashlib.sha256(f"{run_id}\x1f{stage}\x1f{failed_attempt}".encode()).digest()
    draw = int.from_bytes(digest[:8], "big") / 2**64  # uniform in [0, 1)
    return int(delay * (1.0 - policy.jitter * draw))

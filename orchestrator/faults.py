"""Named crash points for the fault-injection tests: die like ``kill -9`` at the worst moments.

Enabled only through ``SAGA_CRASH_POINTS`` (comma-separated names). Each point sits where a crash is the
hardest to survive, so the tests can prove nothing is lost or done twice:

* ``after-consume``: the orchestrator took a batch off its shard queue and decided nothing yet;
* ``after-commit``: the Lua transitions committed, nothing was published or acked;
* ``before-confirm``: the outbox messages were handed to the broker, their confirms not seen;
* ``after-confirm``: the broker confirmed them, the outbox entries are not marked sent;
* ``worker-after-effect``: a worker's handler did its effect, the result was not published.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Iterable

log = logging.getLogger(__name__)

ORCHESTRATOR_POINTS = frozenset({"after-consume", "after-commit", "before-confirm", "after-confirm"})
WORKER_POINTS = frozenset({"worker-after-effect"})
CRASH_POINTS = ORCHESTRATOR_POINTS | WORKER_POINTS


def unknown_points(points: Iterable[str]) -> list[str]:
    return sorted(set(points) - CRASH_POINTS)


#: What the log line of a crash says about the batch it killed, for a point reached by more than one kind.
TIMER_BATCH = "a batch of due timers"


def crash(enabled: frozenset[str], point: str, batch: str = "") -> None:
    """Kill this process at once (SIGKILL: no cleanup, no flush) if ``point`` is enabled. ``batch``: what
    was being processed, where a point is reached on more than one path (said in the log line)."""
    if point in enabled:
        log.error("crash point %s reached%s: killing this process", point, f" in {batch}" if batch else "")
        os.kill(os.getpid(), signal.SIGKILL)

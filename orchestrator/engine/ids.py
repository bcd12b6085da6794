"""Deterministic message ids and fencing tokens.

A message's id is a pure function of what it is (kind, run, stage, fence, item), so a relay re-publishing
an outbox entry, or a worker re-running a redelivered task, produces the same id and consumers recognise
the duplicate.
"""

from __future__ import annotations

import hashlib


def message_id(kind: str, run_id: str, *parts: object) -> str:
    text = "\x1f".join([kind, run_id, *(str(p) for p in parts)])
    return f"{kind}-{hashlib.sha256(text.encode()).hexdigest()[:32]}"


def stage_fence(epoch: int, attempt: int) -> str:
    """A stage attempt's fencing token: unique per (epoch, attempt) of one stage of one run."""
    return f"{epoch}.{attempt}"


def run_fence(epoch: int) -> str:
    """The fence of a run-wide timer (the run deadline): one per epoch."""
    return f"{epoch}.run"


def compensation_fence(epoch: int, index: int) -> str:
    return f"{epoch}.c{index}"


def finaliser_fence(epoch: int, index: int) -> str:
    return f"{epoch}.f{index}"


def result_id(dispatch_id: str) -> str:
    """The id of a worker's report for a dispatch: the same however often the task is redelivered."""
    return f"result-{dispatch_id.split('-', 1)[-1]}"

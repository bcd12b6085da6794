"""The kinds of message saga sends, and who sends each to whom."""

from __future__ import annotations

from enum import StrEnum


class Kind(StrEnum):
    START = "start"  # service -> shard: create a run
    TASK = "task"  # shard -> worker: run one attempt of a stage (or one map item, or a finaliser)
    RESULT = "result"  # worker -> shard: the attempt's outcome
    RELEASE = "barrier.released"  # shard -> shard: a join or map barrier released its successor
    REFILL = "bag.refill"  # shard -> shard: a bag's window of items in flight may take the next chunk
    FINISHED = "run.finished"  # shard -> saga.events: the run reached completed or failed
    CANCEL = "cancel"  # shard -> saga.events: cooperative cancellation of an attempt
    ACCEPTED = "accepted"  # worker -> shard: an attempt with deadlines started (stops its queue clock)
    HEARTBEAT = "heartbeat"  # worker -> shard: the attempt's handler is alive
    CANCEL_RUN = "cancel.run"  # service or operator -> shard: cancel the whole run
    REDRIVE = "redrive"  # operator -> shard: resume a failed run in a new epoch

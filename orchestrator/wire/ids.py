"""Deterministic message ids, fencing tokens and stage labels, and their strict parsers.

A message's id is a pure function of what it is (kind, run, stage, fence, item), so a relay re-publishing
an outbox entry, or a worker re-running a redelivered task, produces the same id and consumers recognise
the duplicate. It also binds a report to the task it answers: a worker's report carries the id derived
from its task's, so the orchestrator can tell a report of the task it dispatched from a message that only
names the right stage and fence.

The parsers accept ASCII digits only (``str.isdigit`` also accepts ``'²'``, which ``int`` refuses), so a
label or fence that parses can always be converted.
"""

from __future__ import annotations

import hashlib
import re

FINALISER_PREFIX = "finaliser:"
COMPENSATION_PREFIX = "compensate:"
_NUMBER = r"(0|[1-9][0-9]{0,8})"
_FINALISER_LABEL = re.compile(re.escape(FINALISER_PREFIX) + _NUMBER)
_COMPENSATION_FENCE = re.compile(_NUMBER + r"\.c" + _NUMBER)
_ITEM_LABEL = re.compile(r"(.+)#" + _NUMBER)
_HEARTBEAT_ID = re.compile(r"heartbeat-([1-9][0-9]{0,8})-[0-9a-f]{32}")


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


# ---- labels ------------------------------------------------------------------------------------------


def finaliser_label(index: int) -> str:
    return f"{FINALISER_PREFIX}{index}"


def compensation_label(stage: str) -> str:
    return f"{COMPENSATION_PREFIX}{stage}"


def item_label(stage: str, item: int) -> str:
    """The label of one map item's retry timer."""
    return f"{stage}#{item}"


def parse_finaliser_label(label: str) -> int | None:
    """The index in ``finaliser:<index>``; None if ``label`` is not exactly that."""
    match = _FINALISER_LABEL.fullmatch(label)
    return int(match.group(1)) if match else None


def parse_compensation_fence(fence: str) -> int | None:
    """The compensation index in ``<epoch>.c<index>``; None if ``fence`` is not exactly that."""
    match = _COMPENSATION_FENCE.fullmatch(fence)
    return int(match.group(2)) if match else None


def fence_epoch(fence: str) -> int | None:
    """The epoch a fence was issued in (``<epoch>.<...>``); None if ``fence`` names none."""
    head = fence.partition(".")[0]
    return int(head) if re.fullmatch(_NUMBER, head) else None


def parse_item_label(label: str) -> tuple[str, int] | None:
    """(map stage, item) of ``<stage>#<item>``; None if ``label`` is not exactly that."""
    match = _ITEM_LABEL.fullmatch(label)
    return (match.group(1), int(match.group(2))) if match else None


# ---- the ids of tasks and of the messages that answer them ----------------------------------------------


def task_id(run_id: str, label: str, fence: str, *parts: object) -> str:
    """The id of a task (it is also the task's idempotency key)."""
    return message_id("task", run_id, label, fence, *parts)


def item_part(item: int | None, attempt: int) -> str:
    """The id part that tells a map's tasks apart: the item, and its attempt once it is retried (a map
    keeps its fence while its items retry). Empty for a single task."""
    if item is None:
        return ""
    return str(item) if attempt == 1 else f"{item}@{attempt}"


def stage_task_id(run_id: str, stage: str, fence: str, item: int | None, attempt: int) -> str:
    return task_id(run_id, stage, fence, item_part(item, attempt))


def result_id(dispatch_id: str) -> str:
    """The id of a worker's report for a dispatch: the same however often the task is redelivered."""
    return f"result-{dispatch_id.split('-', 1)[-1]}"


def acceptance_id(run_id: str, stage: str, fence: str) -> str:
    return message_id("accepted", run_id, stage, fence)


def heartbeat_id(run_id: str, stage: str, fence: str, beat: int) -> str:
    return message_id(f"heartbeat-{beat}", run_id, stage, fence)


def is_heartbeat_id(candidate: str, run_id: str, stage: str, fence: str) -> bool:
    """Whether ``candidate`` is one of the heartbeat ids of this attempt."""
    match = _HEARTBEAT_ID.fullmatch(candidate)
    return match is not None and candidate == heartbeat_id(run_id, stage, fence, int(match.group(1)))


def release_id(run_id: str, stage: str, fence: str) -> str:
    """The id of the continuation a barrier emits when its last member arrives."""
    return message_id("release", run_id, stage, fence)


def refill_id(run_id: str, stage: str, fence: str, sent: int) -> str:
    """The id of the continuation a bag emits once half the items it sent beyond ``sent`` - window
    arrived: it sends the next chunk, once (a bag sends each chunk under its own id)."""
    return message_id("refill", run_id, stage, fence, str(sent))

"""Whose cancellation is it? aiormq cancels every future that waits on a channel when the channel closes,
so a ``CancelledError`` caught around a broker call is either the task's own (someone called ``cancel()``
on it: it must propagate) or the broker call's failure (the channel dropped: a failure to handle like any
other)."""

from __future__ import annotations

import asyncio


def cancelled_from_outside() -> bool:
    """Whether the ``CancelledError`` being handled cancels the running task itself."""
    task = asyncio.current_task()
    return task is None or task.cancelling() > 0

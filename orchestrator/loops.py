"""The event loop the long-running processes (orchestrator, worker) run on.

uvloop where it is installed: a single model-ingest run, one message at a time through both processes,
took 0.3-0.5 ms less with it on this project's bench, and both processes spent 0.5-0.6 ms less CPU on it
(``bench/ab_latency.py``, both orders), with model-ingest throughput unchanged. ``SAGA_EVENT_LOOP``
chooses: ``auto`` (uvloop if importable, else asyncio's own), ``uvloop`` (refuse to start without it),
``asyncio``.
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Callable, Coroutine
from typing import Any, Literal

EventLoopChoice = Literal["auto", "uvloop", "asyncio"]


class EventLoopUnavailable(RuntimeError):
    """``SAGA_EVENT_LOOP=uvloop`` on a machine without uvloop."""


def loop_factory(choice: EventLoopChoice) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """What makes the process's loop for ``choice`` (None: asyncio's default)."""
    if choice == "asyncio":
        return None
    try:
        uvloop = importlib.import_module("uvloop")
    except ImportError as exc:
        if choice == "auto":
            return None
        raise EventLoopUnavailable(
            f"SAGA_EVENT_LOOP=uvloop, but uvloop cannot be imported ({exc}): install it (pip install "
            "uvloop; it has no Windows build), or set SAGA_EVENT_LOOP=auto or asyncio"
        ) from exc
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def run(main: Coroutine[Any, Any, None], choice: EventLoopChoice) -> None:
    """Run ``main`` to its end on a new loop of ``choice``, as ``asyncio.run`` does."""
    try:
        factory = loop_factory(choice)
    except EventLoopUnavailable:
        main.close()  # never awaited: said here, not as a warning at exit
        raise
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main)

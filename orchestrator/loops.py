"""The event loop the long-running processes (orchestrator, worker, ``saga server``) run on.

uvloop where it is installed: a single run's messages go through each process one at a time, and on
uvloop both processes spend less CPU on each (``bench/ab_latency.py`` compares two trees run by run;
``bench/README.md`` has the figures). ``SAGA_EVENT_LOOP`` chooses: ``auto`` (uvloop if importable, else
asyncio's own), ``uvloop`` (refuse to start without it), ``asyncio``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, Literal

EventLoopChoice = Literal["auto", "uvloop", "asyncio"]
LoopFactory = Callable[[], asyncio.AbstractEventLoop]


class EventLoopUnavailable(RuntimeError):
    """``SAGA_EVENT_LOOP=uvloop`` on a machine without uvloop."""


def loop_factory(choice: EventLoopChoice) -> LoopFactory | None:
    """What makes the process's loop for ``choice`` (None: asyncio's default). Called before a process
    does anything else, so that a loop it cannot have stops it at once."""
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError as exc:
        if choice == "auto":
            return None
        raise EventLoopUnavailable(
            f"SAGA_EVENT_LOOP=uvloop, but uvloop cannot be imported ({exc}): install it (pip install "
            "uvloop; it has no Windows build), or set SAGA_EVENT_LOOP=auto or asyncio"
        ) from exc
    factory: LoopFactory = uvloop.new_event_loop
    return factory


def uvicorn_loop(factory: LoopFactory | None) -> Literal["uvloop", "asyncio"]:
    """uvicorn's name for the loop ``factory`` makes (uvicorn builds its loop itself)."""
    return "asyncio" if factory is None else "uvloop"


def run(main: Coroutine[Any, Any, None], factory: LoopFactory | None) -> None:
    """Run ``main`` to its end on a new loop from ``factory``, as ``asyncio.run`` does."""
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main)

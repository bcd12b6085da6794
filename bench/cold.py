"""What precedes a timed call to make it meet what a single run's message meets: a processor that sat idle
and caches that other processes wrote over (the broker, Redis and the worker run between two messages of
one run). ``bench/engine.py`` and ``bench/processor.py`` time their calls after it."""

from __future__ import annotations

import time
from collections.abc import Callable


def before_each(idle_ms: float, sweep_mb: int) -> Callable[[], None]:
    """A call that writes to ``sweep_mb`` of memory, one write per cache line, then sleeps ``idle_ms``
    (with both 0, it does nothing)."""
    sweep = bytearray(sweep_mb * 1024 * 1024)

    def prepare() -> None:
        for i in range(0, len(sweep), 64):
            sweep[i] ^= 1
        if idle_ms:
            time.sleep(idle_ms / 1000)  # blocking: the caller has nothing else to do meanwhile

    return prepare

"""The garbage collector's pace in the orchestrator process (``saga orchestrator``).

A transition allocates hundreds of short-lived containers (its snapshot, decision, spec and JSON), none of
them in reference cycles that outlive it. With CPython's default threshold (a young-generation pass every
700 net allocations of containers) the collector ran a pass every few transitions, and a full pass over
everything the process holds (its kept run records, compiled plans) far more often than its garbage calls
for: ``bench/processor.py`` spent 15-20 % of its CPU in it. Young passes now come every 50,000
allocations (older generations keep their default ratios), and what a process holds once started
(modules, settings, connections, compiled plans) is frozen out of every pass. Cyclic garbage is still
collected; it waits a little longer. Workers keep CPython's pace: a task's payload can be large and
held by a reference cycle (an exception's traceback), which a slower pace would keep for longer, and their
CPU is mostly the broker's and the handlers'.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 50_000


def tune() -> None:
    """Call once a service has started, before it takes work."""
    gc.collect()  # what start-up left behind is freed, not frozen
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)

"""The engine's decision per message, hot and after idle: what a single run's messages pay that a loaded
orchestrator's do not.

Drives ``--runs`` model-ingest runs through the engine and the in-memory store (the property tests'
``Sim``, no services), keeps every ``advance`` call they make (eight a run: the start, five results, the
join's release and the finaliser's result), then times those same calls three ways:

* **hot**: back to back, as a busy orchestrator makes them (the median of ``--repeat`` passes' medians);
* **after a sleep**: each after ``--idle-ms`` of sleep, as a shard waits between the messages of one run;
* **after a sleep and a sweep**: each after writing to ``--sweep-mb`` of memory, then the sleep, as a run's
  message finds the caches after the broker, Redis and the worker ran in between.

The engine does the same work in all three; only the state the processor is in when it starts differs:
its caches above all, and after a sleep also whatever the idle time changed (a busy wait of the same
length instead of the sleep leaves part of the sleep's cost out). So the ratios say how much of a single
run's per-message time is the reach of the code and data a message touches (its footprint), not the
work itself. For comparison, the same three timings of what the protocol's skeleton
(``bench/skeleton.py``) does with a message in Python: parse a task-sized JSON body and write its result.
Prints one JSON line per figure (microseconds, p50 over the calls).

    .venv/bin/python bench/engine.py --runs 30
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.cold import before_each
from orchestrator.engine import advance
from tests.unit import engine_sim
from tests.unit.test_engine import sim_for

Call = tuple[tuple[Any, ...], dict[str, Any]]
TASK = json.dumps(
    {"run": "r" * 32, "stage": "render-thumbnail", "input": {"modelId": "m" * 16}, "pad": "x" * 600}
)


def skeleton_work() -> None:
    """What the skeleton's worker does with a task, in Python: the body parsed, the result written."""
    body = json.loads(TASK)
    json.dumps({"run": body["run"], "stage": body["stage"], "result": {"ok": True}})


def captured_calls(runs: int) -> list[Call]:
    """Every ``advance`` call of ``runs`` model-ingest runs driven to their end."""
    calls: list[Call] = []

    def recording(*args: Any, **kwargs: Any) -> Any:
        calls.append((args, kwargs))
        return advance(*args, **kwargs)

    # the simulator calls the engine through its own module's name for it
    setattr(engine_sim, "advance", recording)  # noqa: B010
    try:
        for i in range(runs):
            sim = sim_for("model-ingest", {"modelId": f"bench-{i}"}, run_id=f"bench-{i}")
            sim.run()
            if sim.status != "completed":
                raise SystemExit(f"run bench-{i} ended {sim.status}: the bench's workload is broken")
    finally:
        setattr(engine_sim, "advance", advance)  # noqa: B010
    return calls


def timed(work: Callable[[], Any], before: Callable[[], None]) -> float:
    before()
    started = time.perf_counter()
    work()
    return (time.perf_counter() - started) * 1e6


def three_ways(
    works: list[Callable[[], Any]], repeat: int, idle_ms: float, sweep_mb: int
) -> list[tuple[str, float, dict[str, Any]]]:
    """p50 of ``works`` hot (the median of ``repeat`` passes' medians), after a sleep each, after a sweep
    and a sleep: each with its figure's name and conditions."""
    hot = statistics.median(
        statistics.median([timed(work, lambda: None) for work in works]) for _ in range(repeat)
    )
    idle, swept = before_each(idle_ms, 0), before_each(idle_ms, sweep_mb)
    after_idle = statistics.median([timed(work, idle) for work in works])
    after_sweep = statistics.median([timed(work, swept) for work in works])
    asleep = {"idle_ms": idle_ms}
    return [
        ("hot", hot, {}),
        ("after a sleep", after_idle, {**asleep, "over_hot": round(after_idle / hot, 2)}),
        (
            "after a sleep and a sweep",
            after_sweep,
            {**asleep, "sweep_mb": sweep_mb, "over_hot": round(after_sweep / hot, 2)},
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=30, help="model-ingest runs whose calls are timed")
    p.add_argument("--repeat", type=int, default=15, help="hot passes over the calls (their median counts)")
    p.add_argument("--idle-ms", type=float, default=2.0, help="sleep before each idle call")
    p.add_argument("--sweep-mb", type=int, default=16, help="memory written before each swept call")
    args = p.parse_args(argv)
    calls = captured_calls(args.runs)
    decisions: list[Callable[[], Any]] = [functools.partial(advance, *a, **kw) for a, kw in calls]
    gc.disable()  # a collection inside one timed call would be charged to it
    skeleton: list[Callable[[], Any]] = [skeleton_work] * len(calls)
    for what, works in (("engine decision", decisions), ("skeleton's work", skeleton)):
        for how, value, conditions in three_ways(works, args.repeat, args.idle_ms, args.sweep_mb):
            figure = {"figure": f"{what} p50, {how}", "value": round(value, 1), **conditions}
            print(
                json.dumps({"peer": "saga", "unit": "us", "calls": len(calls), "runs": args.runs, **figure})
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())

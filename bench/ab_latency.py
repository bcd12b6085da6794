"""Two source trees' model-ingest latency, run by run in turn: is a change faster, on a noisy machine?

    python bench/ab_latency.py A_DIR B_DIR [--runs 400] [--python-a PY] [--python-b PY]

This machine's speed drifts by a third within minutes, so two benches run one after the other compare
the minutes more than the code. Here each tree gets a stack of its own (one orchestrator, one worker,
no-op handlers, as ``bench/run.py``), both running at once, and single runs alternate between them (A
then B, then B then A, ...), each timed as ``bench/run.py`` times its single runs. Pairs of runs a few
milliseconds apart see the same machine. It prints each side's p25 / p50 / p75, the median of the paired
differences (B - A) and the ratio of the medians; then the CPU time each side's orchestrator and worker
spent on its runs (every thread's, read right before and after each run, as ``bench/latency.py`` reads
it), per run, and the paired median of the two processes' sum: whether a difference in latency is work
done or waiting. Both have noise of their own (an A/A comparison here has shown paired medians of about
0.35 ms in each): a difference smaller than that, run both ways (``A B``, then ``B A``), says nothing.

Each tree runs its own code: ``bench/ab_latency.py serve`` is started with this interpreter (or the
side's ``--python-a`` / ``--python-b``: the same tree twice compares two interpreters) and the tree as its
working directory, which goes first on its import path (and its stack's processes run from the
tree too). A change shows: a 0.3 ms sleep before each result a worker publishes measured +8.77 ms a run
(five results on a run's critical path, each sleep costing far more than it asks: the event loop's
timers wake at 1 ms resolution, and the worker then wakes from idle).
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

READY = "ready"
PROCESSES = ("orchestrator", "worker")


def serve() -> None:
    """This tree's stack; one model-ingest run for each line on stdin, its latency in ms on stdout. The
    tree's own code: its folder (the working directory) goes first on the import path."""
    sys.path.insert(0, str(Path.cwd()))
    from bench.run import Watcher
    from bench.stack import BenchStack
    from orchestrator.client import Client

    async def answer(stack: BenchStack) -> None:
        watcher = Watcher(stack.settings.redis_url, stack.prefix)
        # a tree from before waits were announced runs' ends timed its runs with a 1 ms poll of its own
        polled = "poll_s" in inspect.signature(watcher.time_one).parameters

        async def time_one(client: Client, name: str) -> Any:
            if polled:
                return await watcher.time_one(client, name, 0.001, 30)  # type: ignore[call-arg]
            return await watcher.time_one(client, name, 30)

        reader = asyncio.StreamReader()
        loop = asyncio.get_running_loop()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        try:
            async with Client(stack.settings) as client:
                for i in range(3):  # warm-up
                    await time_one(client, f"w{i}")
                pids = [stack.processes[f"{name}-0"].pid for name in PROCESSES]
                print(READY, *pids, flush=True)
                i = 0
                while await reader.readline():
                    i += 1
                    run = await time_one(client, f"ab{i}")
                    print(f"{run.ms:.3f} {run.state}", flush=True)
        finally:
            await watcher.close()

    stack = BenchStack(4)
    try:
        stack.setup()
        stack.start(orchestrators=1, workers=1, concurrency=16)
        stack.wait_consuming()
        asyncio.run(answer(stack))
    finally:
        stack.teardown()


def compare(a: Path, b: Path, runs: int, pythons: tuple[str, str]) -> None:
    # imported here, in the parent alone: a side's stack imports its own tree's code, never this one's
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench.stack import cpu_ns

    here = Path(__file__).resolve()
    sides = [
        subprocess.Popen(
            [python, str(here), "serve"],
            cwd=tree,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        for tree, python in zip((a, b), pythons, strict=True)
    ]
    pids: list[list[int]] = []
    try:
        for tree, side in zip((a, b), sides, strict=True):
            assert side.stdout is not None
            line = side.stdout.readline()
            word, *numbers = line.split() or [""]
            if word != READY:
                raise SystemExit(f"the stack of {tree} did not start (it said {line.strip()!r})")
            pids.append([int(n) for n in numbers])
        latencies: list[list[float]] = [[], []]
        cpu_ms: list[list[list[float]]] = [[], []]  # by side, then run: each process's CPU on it
        for i in range(runs):
            for k in (0, 1) if i % 2 == 0 else (1, 0):
                side = sides[k]
                assert side.stdin is not None and side.stdout is not None
                before = [cpu_ns(pid) for pid in pids[k]]
                side.stdin.write("run\n")
                ms, state = side.stdout.readline().split()
                cpu_ms[k].append([(cpu_ns(pid) - b) / 1e6 for pid, b in zip(pids[k], before, strict=True)])
                if state != "completed":
                    raise SystemExit(f"a run of {(a, b)[k]} ended {state}")
                latencies[k].append(float(ms))
    finally:
        for side in sides:
            if side.stdin is not None:
                side.stdin.close()
            side.wait()
    for tree, values in zip((a, b), latencies, strict=True):
        q = sorted(values)
        p25, p50, p75 = q[len(q) // 4], statistics.median(q), q[3 * len(q) // 4]
        print(f"{tree}: p25 {p25:.2f}  p50 {p50:.2f}  p75 {p75:.2f} ms")
    paired = statistics.median(y - x for x, y in zip(*latencies, strict=True))
    ratio = statistics.median(latencies[1]) / statistics.median(latencies[0])
    print(f"B - A, paired median: {paired:+.2f} ms; B / A p50: {ratio:.3f} ({runs} runs each)")
    report_cpu((a, b), cpu_ms)


def report_cpu(trees: tuple[Path, Path], cpu_ms: list[list[list[float]]]) -> None:
    """Each side's CPU a run by process (medians over its runs), and the paired median of the sums."""
    if not all(cpu_ms):
        return
    for tree, runs in zip(trees, cpu_ms, strict=True):
        by_process = ", ".join(
            f"{name} {statistics.median(run[j] for run in runs):.2f}" for j, name in enumerate(PROCESSES)
        )
        print(f"{tree}: cpu a run (median): {by_process} ms")
    totals = [[sum(run) for run in runs] for runs in cpu_ms]
    paired = statistics.median(y - x for x, y in zip(*totals, strict=True))
    ratio = statistics.median(totals[1]) / statistics.median(totals[0])
    print(f"cpu a run (orchestrator + worker), B - A paired median: {paired:+.2f} ms; B / A: {ratio:.3f}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["serve"]:
        serve()
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("a", type=Path, help="tree A (the baseline)")
    p.add_argument("b", type=Path, help="tree B (the change)")
    p.add_argument("--runs", type=int, default=400, help="runs of each tree")
    p.add_argument(
        "--python-a", default=sys.executable, help="the interpreter of tree A's stack (default: this one)"
    )
    p.add_argument(
        "--python-b",
        default=sys.executable,
        help="the interpreter of tree B's stack (another Python version, say; default: this one)",
    )
    args = p.parse_args(argv)
    compare(args.a.resolve(), args.b.resolve(), args.runs, (args.python_a, args.python_b))
    return 0


if __name__ == "__main__":
    sys.exit(main())

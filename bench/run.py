"""The saga benchmark: the peers' workloads (../shared/bench/peers/) on an isolated saga stack.

    python bench/run.py [--runs 1000] [--wide 1000,5000] [--latency 20] [--orchestrators 1] [--workers 1]
                        [--worker-concurrency 16] [--keep]

Prints one JSON line per figure, in the shape of the peers' ``emit``:
{"peer": "saga", "figure": ..., "value": ..., "unit": ..., <extra keys>}, then one "environment" line.

  model-ingest latency p50 / max   ms, ``--latency`` single runs one after another (after one warm-up run)
  model-ingest throughput          runs/s, ``--runs`` runs started at once, until all have finished
  wide join                        branches/s, one thumbnail-batch run over W model ids, for each W
  redis bytes per completed run    MEMORY USAGE of every key of a completed model-ingest run
  redis bytes per completed bag run  the same for the bag run of width 1000 (or the smallest width)
  redis bookkeeping per live bag item  that bag's bitmap and results list once half its items arrived,
                                     less the results' bytes, per arrived item (and the outbox then)

Figures carry ``cpu_s``: CPU seconds the orchestrators, workers, this client, RabbitMQ and Redis spent on
that workload, and "other": what the rest of the machine spent meanwhile (high means a noisy figure).
See bench/README.md for the targets and the results so far.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.stack import (  # noqa: E402
    BenchStack,
    cpu_seconds,
    machine_busy_seconds,
    rabbitmqctl,
    service_pids,
)
from orchestrator.bus.batch import DEFAULT_PACK_TASKS  # noqa: E402
from orchestrator.client import Client, WaitTimeout  # noqa: E402
from orchestrator.store.connect import async_client  # noqa: E402
from orchestrator.store.keys import ShardKeys, index_key  # noqa: E402

PEER = "saga"
TERMINAL = frozenset({"completed", "failed"})
BATCH_POLL_S = 0.02  # many runs: one pipelined read every 20 ms
WIDE_POLL_S = 0.01
# Runs read per batch poll: the oldest pending ones (runs finish roughly in start order). A window that
# has all finished is followed at once by the next, so a small window adds no lag at the end.
WINDOW = 128
BYTES_SAMPLE = 10  # completed model-ingest runs whose keys are measured


def emit(figure: str, value: float, unit: str, **extra: Any) -> None:
    print(
        json.dumps({"peer": PEER, "figure": figure, "value": round(value, 2), "unit": unit, **extra}),
        flush=True,
    )


@dataclass(frozen=True)
class SingleRun:
    """A model-ingest run started on its own: its id, how it ended, and its latency in ms."""

    run_id: str
    state: str
    ms: float


class Unfinished(Exception):
    """Runs still going when the bench gave up waiting: a hang, worth a bug report."""

    def __init__(self, message: str, run_ids: list[str]) -> None:
        super().__init__(message)
        self.run_ids = run_ids


# ---- measuring -------------------------------------------------------------------------------------


class Meter:
    """CPU seconds spent between two points by the stack's processes, this client, RabbitMQ, Redis, and
    everything else on the machine ("other": other developers' tests make the figures noisy)."""

    def __init__(self, stack: BenchStack) -> None:
        self.stack = stack
        self.services = service_pids()
        self.start = self._now()

    def _now(self) -> dict[str, float]:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        now = {**self.stack.cpu_by_role(), "client": usage.ru_utime + usage.ru_stime}
        for service, pids in self.services.items():
            now[service] = sum(cpu_seconds(pid) for pid in pids)
        now["busy"] = machine_busy_seconds()
        return now

    def lap(self) -> dict[str, float]:
        now = self._now()
        spent = {role: now[role] - self.start.get(role, 0.0) for role in now}
        self.start = now
        busy = spent.pop("busy")
        spent["other"] = max(0.0, busy - sum(spent.values()))
        return {role: round(seconds, 2) for role, seconds in spent.items()}


class Watcher:
    """Times single runs as a user's client waits for them; reads many runs' states from Redis with one
    pipeline per poll."""

    def __init__(self, redis_url: str, prefix: str) -> None:
        self.redis = async_client(redis_url, decode_responses=True)
        self.prefix = prefix
        self.shards: dict[str, str] = {}

    async def close(self) -> None:
        await self.redis.aclose()

    def run_key(self, run_id: str) -> str:
        return ShardKeys(self.prefix, self.shards[run_id]).run(run_id)

    async def statuses(self, run_ids: Iterable[str]) -> dict[str, str | None]:
        """One round trip: the shard of runs not located yet, the status of the others."""
        run_ids = list(run_ids)
        pipe = self.redis.pipeline(transaction=False)
        for run_id in run_ids:
            if run_id in self.shards:
                pipe.hget(self.run_key(run_id), "status")
            else:
                pipe.get(index_key(self.prefix, run_id))
        out: dict[str, str | None] = {}
        for run_id, reply in zip(run_ids, await pipe.execute(), strict=True):
            if run_id in self.shards:
                out[run_id] = reply
            elif reply is not None:
                self.shards[run_id] = reply
        return out

    async def time_one(self, client: Client, model_id: str, timeout_s: float) -> SingleRun:
        """One model-ingest run, timed from the start's publish until the client's wait returns with
        the run finished: how every bench times a single run. The wait is announced the run's end
        (``orchestrator/run_ends.py``), as a user's ``Client.wait`` is."""
        started = time.perf_counter()
        run_id = await client.start("model-ingest", {"modelId": model_id})
        try:
            result = await client.wait(run_id, timeout_s=timeout_s)
        except WaitTimeout as exc:
            raise Unfinished(f"run {run_id} did not finish within {timeout_s:g} s", [run_id]) from exc
        return SingleRun(run_id, result.state, (time.perf_counter() - started) * 1000)

    async def wait_all(
        self, run_ids: list[str], poll_s: float, timeout_s: float
    ) -> tuple[dict[str, str], float]:
        """Poll many runs in batches until all finish; returns their states and when the last was seen."""
        pending, done = list(run_ids), {}
        deadline = time.monotonic() + timeout_s
        while True:
            window = pending[:WINDOW]
            found = await self.statuses(window)
            finished = {r: s for r, s in found.items() if s in TERMINAL}
            done.update(finished)
            pending = [r for r in pending if r not in finished]
            if not pending:
                return done, time.perf_counter()
            if time.monotonic() > deadline:
                raise Unfinished(await self._describe(pending, len(run_ids), timeout_s), pending)
            if len(finished) < len(window):  # a window all finished: read the next one at once
                await asyncio.sleep(poll_s)

    async def _describe(self, pending: list[str], total: int, timeout_s: float) -> str:
        states: dict[str, int] = {}
        for i in range(0, len(pending), WINDOW):
            for status in (await self.statuses(pending[i : i + WINDOW])).values():
                states[str(status)] = states.get(str(status), 0) + 1
        unlocated = sum(1 for r in pending if r not in self.shards)
        return (
            f"{len(pending)} of {total} runs unfinished after {timeout_s:g} s: states {states}, "
            f"{unlocated} never created; e.g. {pending[:3]}"
        )

    async def run_bytes(self, run_id: str) -> tuple[int, dict[str, int], int]:
        """MEMORY USAGE of every key of one run (found by SCAN on its prefix), by key; and its index key."""
        if run_id not in self.shards:
            await self.statuses([run_id])
        base = self.run_key(run_id)
        keys = [k async for k in self.redis.scan_iter(match=f"{base}*", count=1000)]
        pipe = self.redis.pipeline(transaction=False)
        for key in [*keys, index_key(self.prefix, run_id)]:
            pipe.memory_usage(key, samples=0)
        *sizes, index_bytes = await pipe.execute()
        by_key = {(k[len(base) + 1 :] or "run"): int(n or 0) for k, n in zip(keys, sizes, strict=True)}
        return sum(by_key.values()), dict(sorted(by_key.items())), int(index_bytes or 0)

    async def live_bag(self, run_id: str, stage: str, width: int, timeout_s: float) -> dict[str, Any] | None:
        """Once half of a bag's items arrived: the Redis its barrier keeps per arrived item, beside the
        results themselves (MEMORY USAGE of its bitmap and results list, less the results' bytes), and
        the shard's outbox entries at that moment (its dispatch's burst, until confirmed)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if run_id in self.shards:
                left = await self.redis.hget(self.run_key(run_id), f"b:{stage}")  # type: ignore[misc]
                if left is not None and int(left) <= width // 2:
                    break
            else:
                await self.statuses([run_id])
            await asyncio.sleep(0.005)
        else:
            return None
        keys = ShardKeys(self.prefix, self.shards[run_id])
        arrived, results = keys.bag_arrived(run_id, stage), keys.bag_results(run_id, stage)
        pipe = self.redis.pipeline(transaction=False)
        pipe.memory_usage(arrived, samples=0)
        pipe.memory_usage(results, samples=0)
        pipe.lrange(results, 0, -1)
        pipe.hlen(keys.outbox())
        bitmap, listed, entries, outbox = await pipe.execute()
        payload = sum(len(e.partition(":")[2].encode()) for e in entries)
        count = len(entries)
        return {
            "per_item": round((int(bitmap or 0) + int(listed or 0) - payload) / max(count, 1), 2),
            "arrived": count,
            "bitmap_bytes": int(bitmap or 0),
            "results_bytes": int(listed or 0),
            "results_payload_bytes": payload,
            "outbox_entries": int(outbox),
        }


# ---- workloads -------------------------------------------------------------------------------------


async def bench_latency(client: Client, watcher: Watcher, meter: Meter, args: argparse.Namespace) -> None:
    await watcher.time_one(client, "warm-0", args.timeout)
    meter.lap()
    runs = [await watcher.time_one(client, f"s{i}", args.timeout) for i in range(args.latency)]
    lat = sorted(run.ms for run in runs)
    extra = {
        "runs": args.latency,
        "failed": sum(run.state != "completed" for run in runs),
        "cpu_s": meter.lap(),
    }
    emit("model-ingest latency p50", lat[len(lat) // 2], "ms", **extra)
    emit("model-ingest latency max", lat[-1], "ms", **extra)


async def bench_throughput(
    client: Client, watcher: Watcher, meter: Meter, args: argparse.Namespace
) -> list[str]:
    gate = asyncio.Semaphore(args.start_concurrency)

    async def start(i: int) -> str:
        async with gate:
            return await client.start("model-ingest", {"modelId": f"m{i}"})

    meter.lap()
    t = time.perf_counter()
    run_ids = await asyncio.gather(*(start(i) for i in range(args.runs)))
    started_s = time.perf_counter() - t
    states, seen = await watcher.wait_all(run_ids, BATCH_POLL_S, args.timeout)
    emit(
        "model-ingest throughput",
        args.runs / (seen - t),
        "runs/s",
        runs=args.runs,
        seconds=round(seen - t, 2),
        start_s=round(started_s, 2),
        failed=sum(s != "completed" for s in states.values()),
        cpu_s=meter.lap(),
    )
    return [r for r in run_ids if states[r] == "completed"]


async def bench_run_bytes(watcher: Watcher, run_ids: list[str]) -> None:
    if not run_ids:
        return
    step = max(1, len(run_ids) // BYTES_SAMPLE)
    measured = sorted(
        [await watcher.run_bytes(r) for r in run_ids[::step][:BYTES_SAMPLE]], key=lambda m: m[0]
    )
    total, by_key, index_bytes = measured[len(measured) // 2]
    emit(
        "redis bytes per completed run",
        total,
        "bytes",
        keys=by_key,
        runs_sampled=len(measured),
        min=measured[0][0],
        max=measured[-1][0],
        index_key_bytes=index_bytes,
    )


def items_per_message(args: argparse.Namespace) -> int:
    """How many item tasks the bag packs per message: as asked, else as its definition says."""
    if args.items_per_message is not None:
        return int(args.items_per_message)
    source = yaml.safe_load((ROOT / "definitions" / "thumbnail-batch.yaml").read_text(encoding="utf-8"))
    bag = next(s for s in source["stages"] if s["name"] == "render-all")
    return int(bag.get("items_per_message", 1))


async def bench_wide(client: Client, watcher: Watcher, meter: Meter, args: argparse.Namespace) -> None:
    bag_width, bag_measured = (1000 if 1000 in args.wide else min(args.wide)), False
    for width in args.wide:
        ids = [f"w{width}-{i}" for i in range(width)]
        meter.lap()
        t = time.perf_counter()
        run_id = await client.start("thumbnail-batch", {"modelIds": ids})
        live = None
        if width == bag_width and not bag_measured:
            live = await watcher.live_bag(run_id, "render-all", width, args.timeout)
        _, seen = await watcher.wait_all([run_id], WIDE_POLL_S, args.timeout)
        cpu = meter.lap()
        document = await client.status(run_id)
        emit(
            "wide join",
            width / (seen - t),
            "branches/s",
            width=width,
            seconds=round(seen - t, 2),
            state=document["state"],
            count=(document["output"] or {}).get("count"),
            items_per_message=items_per_message(args),
            pack_tasks=int(os.environ.get("SAGA_PACK_TASKS", DEFAULT_PACK_TASKS))
            if args.pack_tasks is None
            else args.pack_tasks,
            cpu_s=cpu,
        )
        if live is not None:
            emit("redis bookkeeping per live bag item", live.pop("per_item"), "bytes", width=width, **live)
        if width == bag_width and not bag_measured:
            bag_measured = True
            total, by_key, index_bytes = await watcher.run_bytes(run_id)
            emit(
                "redis bytes per completed bag run",
                total,
                "bytes",
                width=width,
                keys=by_key,
                index_key_bytes=index_bytes,
            )


# ---- the command -----------------------------------------------------------------------------------


async def workloads(stack: BenchStack, args: argparse.Namespace) -> dict[str, float]:
    """Run every workload; returns the CPU seconds each role spent over all of them."""
    watcher = Watcher(stack.settings.redis_url, stack.prefix)
    total = Meter(stack)
    try:
        async with Client(stack.settings) as client:
            meter = Meter(stack)
            if args.latency:
                await bench_latency(client, watcher, meter, args)
            if args.runs:
                completed = await bench_throughput(client, watcher, meter, args)
                await bench_run_bytes(watcher, completed)
            if args.wide:
                await bench_wide(client, watcher, meter, args)
    finally:
        await watcher.close()
    return total.lap()


def git_state() -> dict[str, Any]:
    """The commit under test, and files of the code under test changed since (others edit concurrently)."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
        return done.stdout.rstrip("\n")  # not strip(): a status line may start with a space

    changed = git("status", "--porcelain", "--", "orchestrator", "workers", "definitions").splitlines()
    return {"commit": git("rev-parse", "--short", "HEAD"), "changed": [line[3:] for line in changed]}


def environment(
    stack: BenchStack,
    args: argparse.Namespace,
    load_before: float,
    git: dict[str, Any],
    cpu: dict[str, float],
) -> None:
    info = stack.redis.info("server")
    problems = stack.log_problems()
    line = {
        "peer": PEER,
        "figure": "environment",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "rabbitmq": rabbitmqctl("version").strip(),
        "git": git,
        "redis": info.get("redis_version"),  # type: ignore[union-attr]
        "orchestrators": args.orchestrators,
        "workers": args.workers,
        "worker_concurrency": args.worker_concurrency,
        "shard_count": args.shard_count,
        "shard_classes": list(stack.settings.shard_classes),
        "pack_tasks": int(stack.env.get("SAGA_PACK_TASKS", DEFAULT_PACK_TASKS)),
        "loadavg_1m_before": round(load_before, 2),
        "loadavg_1m_after": round(os.getloadavg()[0], 2),
        "cpu_s": cpu,
        "dead_letters": stack.dead_letters(),
        "log_problems": len(problems),
        "vhost": stack.vhost,
        "logs": str(stack.logs),
    }
    print(json.dumps(line), flush=True)
    if problems:
        print(
            f"{len(problems)} warning/error lines in {stack.logs}:", *problems[:30], sep="\n", file=sys.stderr
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    def widths(text: str) -> list[int]:
        found = [int(x) for x in text.split(",") if x]
        if any(w < 1 for w in found):  # an empty bag never opens the barrier the bench watches
            raise argparse.ArgumentTypeError(
                f"bag widths are 1 or more, not {text!r}; '' skips the wide join"
            )
        return found

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=1000, help="model-ingest runs started at once (0: skip)")
    p.add_argument("--wide", type=widths, default=[1000, 5000], help="bag widths, comma-separated")
    p.add_argument(
        "--items-per-message",
        type=int,
        default=None,
        help="the bag's items_per_message (1-100; default: as definitions/thumbnail-batch.yaml has it)",
    )
    p.add_argument(
        "--pack-tasks",
        type=int,
        default=None,
        help="the orchestrators' SAGA_PACK_TASKS (1: every task alone, as the peers send them; default: "
        "the setting's default, or the environment's)",
    )
    p.add_argument("--latency", type=int, default=20, help="single runs one after another (0: skip)")
    p.add_argument("--orchestrators", type=int, default=1, help="orchestrator processes")
    p.add_argument("--workers", type=int, default=1, help="worker processes")
    p.add_argument("--worker-concurrency", type=int, default=16, help="tasks at once per worker")
    p.add_argument("--shard-count", type=int, default=4, help="shards per class (SAGA_SHARD_COUNT)")
    p.add_argument("--start-concurrency", type=int, default=64, help="starts in flight at once")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for any workload")
    p.add_argument("--keep", action="store_true", help="leave the vhost, keys and logs for inspection")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_before = os.getloadavg()[0]
    git = git_state()  # before the processes start: the code they load
    stack = BenchStack(args.shard_count, args.items_per_message, args.pack_tasks)
    print(f"bench stack: vhost {stack.vhost}, key prefix {stack.prefix}, logs {stack.logs}", file=sys.stderr)
    try:
        stack.setup()
        stack.start(args.orchestrators, args.workers, args.worker_concurrency)
        stack.wait_consuming()
        cpu = asyncio.run(workloads(stack, args))
        environment(stack, args, load_before, git, cpu)
    except Unfinished as exc:
        report = [f"runs never finished: {exc}", f"code under test: {json.dumps(git)}"]
        for run_id in exc.run_ids[:3]:
            report += stack.describe_run(run_id)
        report += stack.queue_report() + stack.log_problems()[:30]
        print(*report, sep="\n", file=sys.stderr)
        return 1
    finally:
        stack.teardown(keep=args.keep)
        if args.keep:
            print(f"kept: vhost {stack.vhost}, keys {stack.prefix}:*, logs {stack.logs}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

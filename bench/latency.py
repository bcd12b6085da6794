"""Where a model-ingest run's latency goes: per hop kind, per processing step, against the bare hop.

    python bench/latency.py [--plain-runs 200] [--runs 20] [--pings 200] [--idle-ms 3] [--keep]

First the latency itself, untraced: one orchestrator and one worker (no-op handlers, as ``bench/run.py``)
and ``--plain-runs`` model-ingest runs (after one warm-up run), each timed as ``bench/run.py``
times its single runs (the client's publish of the start until its wait returns, announced the run's end).
Tracing writes a line for every step of every message and slows each hop it measures, so the figures
the targets are judged by come from runs it is off for. In turn with them, as many runs of the protocol's
skeleton (``bench/skeleton.py``: the same hops and commits, none of saga's own work), its two processes
beside saga's on the same vhost, timed the same way; half the bare hops right before these runs, half
right after. Then the breakdown: a second stack with tracing on (``SAGA_TRACE_DIR``,
``orchestrator/trace.py``), the client in this process tracing too, and ``--runs`` model-ingest runs one
after another, each after 50 ms of idle time. Then, on the same broker and vhost,
the bare hop: a persistent message published with a confirm to a quorum queue and delivered to a consumer
on another connection, ``--pings`` times one after another, and again each after ``--idle-ms`` (3) of
idle time; and a Redis round trip (a PING through redis-py) both ways. It prints JSON lines, as
``bench/run.py`` does:

- ``latency p50``: the untraced runs' latency; ``traced latency p50``: the traced runs', from the
  client's publish of the start to the end of the transition that ended the run (its finaliser's result
  applied), on the machine's one clock;
- ``hop p50`` per hop kind (traced): ``start`` (client -> shard), ``task`` (shard -> worker), ``result``
  (worker -> shard): from the sender's publish to the receiver's delivery; ``bare hop p50`` beside them,
  and ``bare hop after idle p50`` (a run's hops follow idle time: on this kind of machine waking the
  processes up costs a few tenths of a millisecond per hop), ``redis round trip p50`` and ``... after
  idle p50`` (a transition's commit is one such round trip);
- ``step p50`` per process and step (traced): orchestrator ``inbox`` (delivered, waiting for its batch),
  ``decode`` (decode and verify), ``snapshot`` (the runs' read), ``engine``, ``lua`` (the transitions'
  call: their specs built, the round trip, the records kept), ``fcall`` (the round trip alone, inside
  ``lua``), ``local`` (barrier releases applied in-process), ``ack``, ``publish`` (publish and confirm),
  ``mark_sent``; worker ``inbox``, ``decode``, ``handler``, ``publish`` (the result, to its confirm),
  ``ack``; the client's ``publish``;
- ``own time per hop``: (latency - critical-path hops x bare hop - handler time) / hops, the time that is
  saga's own, with its ``latency_over_floor``; ``traced own time per hop`` the same of the traced runs;
  ``skeleton latency p50`` and ``skeleton own time per hop``, the same of the skeleton's runs (what the
  protocol costs in Python on this machine before any of saga's work), and ``own time per hop beyond the
  skeleton``: (latency - skeleton latency) / hops.
  The critical path of model-ingest is 11 hops (the start, then a task and its result for cache-lookup,
  render, the fork's branches in parallel, publish and the finaliser; the join is released by its last
  branch's transition);

and on stderr the timeline of the median run: every hop and step, in order, from the start's publish.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import aio_pika  # noqa: E402

from bench import skeleton  # noqa: E402
from bench.run import SingleRun, Watcher, emit  # noqa: E402
from bench.stack import BenchStack, cpu_ns  # noqa: E402
from orchestrator.bus.connect import connect_once  # noqa: E402
from orchestrator.client import Client  # noqa: E402
from orchestrator.store.connect import async_client  # noqa: E402
from orchestrator.trace import TRACE  # noqa: E402

CRITICAL_HOPS = 11
HOP_KINDS = {"start": "start", "task": "task", "result": "result"}
MS = 1e-6  # nanoseconds to milliseconds


# ---- the bare hop ----------------------------------------------------------------------------------


async def bare_hop(amqp_url: str, pings: int, idle_ms: float = 0.0) -> tuple[list[float], list[float]]:
    """``pings`` persistent messages, one after another, published with a confirm to a quorum queue and
    delivered to a consumer on another connection: (publish -> delivery, publish -> confirm) in ms.
    ``idle_ms``: each publish follows that much idle time, as a run's hops follow one another (back to
    back, the processes never sleep between hops; after a pause each wakes up first)."""
    sender, receiver = await connect_once(amqp_url), await connect_once(amqp_url)
    try:
        out = await sender.channel(publisher_confirms=True)
        inbound = await receiver.channel()
        queue = await inbound.declare_queue(
            "bench.bare-hop", durable=True, arguments={"x-queue-type": "quorum"}
        )
        arrived: asyncio.Queue[int] = asyncio.Queue()

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            await arrived.put(time.time_ns())
            await message.ack()

        await queue.consume(on_message)
        hops, confirms = [], []
        for i in range(pings + 10):  # the first ten warm the path up
            if idle_ms:
                await asyncio.sleep(idle_ms / 1000)
            body = aio_pika.Message(b"x" * 600, delivery_mode=aio_pika.DeliveryMode.PERSISTENT)
            sent = time.time_ns()
            await out.default_exchange.publish(body, routing_key=queue.name)
            confirmed = time.time_ns()
            delivered = await arrived.get()
            if i >= 10:
                hops.append((delivered - sent) * MS)
                confirms.append((confirmed - sent) * MS)
        await queue.delete(if_unused=False, if_empty=False)
        return hops, confirms
    finally:
        await sender.close()
        await receiver.close()


async def redis_round_trips(redis_url: str, pings: int, idle_ms: float) -> list[float]:
    """``pings`` PINGs through the orchestrator's Redis client, each after ``idle_ms`` of idle time (a
    transition commits with one such round trip): their round trips in ms."""
    client = async_client(redis_url)
    try:
        times = []
        for i in range(pings + 10):
            if idle_ms:
                await asyncio.sleep(idle_ms / 1000)
            started = time.perf_counter()
            await client.ping()
            if i >= 10:
                times.append((time.perf_counter() - started) * 1000)
        return times
    finally:
        await client.aclose()


@dataclass
class Floors:
    """The transport's and Redis's own times, measured in the same sitting as the runs."""

    hops: list[float]
    confirms: list[float]
    hops_after_idle: list[float]
    redis: list[float]
    redis_after_idle: list[float]


async def floors(stack: BenchStack, pings: int, idle_ms: float) -> Floors:
    hops, confirms = await bare_hop(stack.settings.amqp_url, pings)
    idle_hops, _ = await bare_hop(stack.settings.amqp_url, pings, idle_ms)
    redis = await redis_round_trips(stack.settings.redis_url, pings, 0.0)
    redis_idle = await redis_round_trips(stack.settings.redis_url, pings, idle_ms)
    return Floors(hops, confirms, idle_hops, redis, redis_idle)


# ---- reading the traces ----------------------------------------------------------------------------


@dataclass
class Message:
    sent: int | None = None
    confirmed: int | None = None
    received: int | None = None
    sender: str = ""
    receiver: str = ""
    kind: str = ""
    run: str = ""
    stage: str = ""


@dataclass
class Traces:
    messages: dict[str, Message] = field(default_factory=lambda: defaultdict(Message))
    # (role, step) -> [(t0, t1, message ids)]
    spans: dict[tuple[str, str], list[tuple[int, int, list[str]]]] = field(
        default_factory=lambda: defaultdict(list)
    )


def read_traces(folder: Path) -> Traces:
    traces = Traces()
    for path in sorted(folder.glob("*.jsonl")):
        role = path.stem.rsplit("-", 1)[0]
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if "s" in record:
                traces.spans[(role, record["s"])].append((record["t0"], record["t1"], record["ms"]))
                continue
            message = traces.messages[record["m"]]
            what, at = record["e"], record["t"]
            if what == "sent" and message.sent is None:
                message.sent, message.sender = at, role
            elif what == "confirmed" and message.confirmed is None:
                message.confirmed = at
            elif what == "received" and message.received is None:
                message.received, message.receiver = at, role
            elif what == "decoded":
                message.kind, message.run, message.stage = record["k"], record["r"], record.get("st") or ""
    return traces


def p50(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def step_durations(traces: Traces, runs: set[str]) -> dict[tuple[str, str], list[float]]:
    """Every step's durations (ms) over the spans that touched a message of ``runs``, plus each
    process's inbox wait (delivered until its batch's decode began) and the worker's and client's
    publish (to the confirm)."""
    ours = {m for m, msg in traces.messages.items() if msg.run in runs}
    steps: dict[tuple[str, str], list[float]] = defaultdict(list)
    for (role, step), spans in traces.spans.items():
        for t0, t1, ids in spans:
            if ours.intersection(ids):
                steps[(role, step)].append((t1 - t0) * MS)
    for t0, _, ids in traces.spans.get(("orchestrator", "decode"), []) + traces.spans.get(
        ("worker", "decode"), []
    ):
        for message_id in ids:
            message = traces.messages.get(message_id)
            if message and message.run in runs and message.received is not None:
                steps[(message.receiver, "inbox")].append((t0 - message.received) * MS)
    for message in traces.messages.values():
        if message.run in runs and message.sender in ("worker", "client") and message.confirmed:
            assert message.sent is not None
            steps[(message.sender, "publish")].append((message.confirmed - message.sent) * MS)
    return steps


def run_latency(traces: Traces, run: str) -> tuple[int, int] | None:
    """(when the client published the run's start, when the last transition of the run ended)."""
    start = [m.sent for m in traces.messages.values() if m.run == run and m.kind == "start" and m.sent]
    ids = {i for i, m in traces.messages.items() if m.run == run}
    ends = [t1 for t0, t1, ms in traces.spans.get(("orchestrator", "lua"), []) if ids.intersection(ms)]
    if not start or not ends:
        return None
    return min(start), max(ends)


def timeline(traces: Traces, run: str, origin: int) -> list[str]:
    """The run's hops and steps in time order, as text lines, from ``origin`` (ns)."""
    rows: list[tuple[int, str]] = []
    ids = {i for i, m in traces.messages.items() if m.run == run}
    for message_id in ids:
        m = traces.messages[message_id]
        what = f"{m.kind:<8} {m.stage or '-':<20}"
        if m.sent and m.received:
            hop = (m.received - m.sent) * MS
            rows.append((m.sent, f"{m.sender:>12} -> {m.receiver:<12} {what} hop {hop:6.2f} ms"))
    for (role, step), spans in traces.spans.items():
        for t0, t1, ms in spans:
            if ids.intersection(ms):
                rows.append((t0, f"{role:>12}    {step:<24} {'':<17} {(t1 - t0) * MS:6.2f} ms"))
    return [f"+{(t - origin) * MS:8.2f} ms  {text}" for t, text in sorted(rows)]


# ---- the run -----------------------------------------------------------------------------------------


async def traced_runs(stack: BenchStack, count: int, timeout_s: float) -> list[str]:
    watcher = Watcher(stack.settings.redis_url, stack.prefix)
    try:
        async with Client(stack.settings) as client:
            await watcher.time_one(client, "warm-0", timeout_s)
            runs = []
            for i in range(count):
                runs.append(completed(await watcher.time_one(client, f"t{i}", timeout_s), stack).run_id)
                await asyncio.sleep(0.05)  # the next run starts on an idle system
            return runs
    finally:
        await watcher.close()


def report_untraced(untraced: Untraced) -> None:
    """The untraced runs' figures: saga's and the skeleton's latency, the bare hop around them, and the
    CPU each process spent per run."""
    plain, bare_protocol = untraced.latencies, untraced.skeleton
    if plain:
        emit("latency p50", p50(plain), "ms", runs=len(plain), traced=False, back_to_back=True)
        if untraced.hops:
            emit("bare hop around the latency runs p50", p50(untraced.hops), "ms", pings=len(untraced.hops))
    if bare_protocol:
        emit("skeleton latency p50", p50(bare_protocol), "ms", runs=len(bare_protocol), back_to_back=True)
    for (side, role), total in sorted(untraced.cpu_ms.items()):
        emit("cpu per run", total / len(plain), "ms", side=side, process=role, runs=len(plain))


def report(
    traces: Traces,
    runs: list[str],
    measured: Floors,
    idle_ms: float,
    untraced: Untraced,
) -> None:
    bare = p50(measured.hops)
    spans = {run: run_latency(traces, run) for run in runs}
    latencies = {run: (end - start) * MS for run, found in spans.items() if found for start, end in [found]}
    plain, bare_protocol = untraced.latencies, untraced.skeleton
    report_untraced(untraced)
    emit("traced latency p50", p50(list(latencies.values())), "ms", runs=len(latencies), traced=True)
    emit(
        "bare hop p50", bare, "ms", pings=len(measured.hops), confirm_p50_ms=round(p50(measured.confirms), 3)
    )
    emit("bare hop after idle p50", p50(measured.hops_after_idle), "ms", idle_ms=idle_ms)
    emit("redis round trip p50", p50(measured.redis), "ms")
    emit("redis round trip after idle p50", p50(measured.redis_after_idle), "ms", idle_ms=idle_ms)
    wanted = set(runs)
    for kind in HOP_KINDS:
        values = [
            (m.received - m.sent) * MS
            for m in traces.messages.values()
            if m.run in wanted and m.kind == kind and m.sent and m.received
        ]
        emit("hop p50", p50(values), "ms", hop=kind, n=len(values))
    steps = step_durations(traces, wanted)
    for (role, step), values in sorted(steps.items()):
        emit("step p50", p50(values), "ms", process=role, step=step, n=len(values))
    handler_per_run = p50(
        [
            sum(
                (t1 - t0) * MS
                for t0, t1, ms in traces.spans.get(("worker", "handler"), [])
                if any(traces.messages[i].run == run for i in ms if i in traces.messages)
            )
            for run in latencies
        ]
    )
    # Each latency against the bare hop measured closest to it: the untraced runs' and the skeleton's
    # against the hops around the untraced runs, the traced runs' against those after them. (The
    # skeleton runs no handlers: nothing of its time is theirs.)
    around = CRITICAL_HOPS * p50(untraced.hops) if untraced.hops else float("nan")
    for figure, latency, floor, handlers in (
        ("own time per hop", p50(plain) if plain else None, around, handler_per_run),
        ("traced own time per hop", p50(list(latencies.values())), CRITICAL_HOPS * bare, handler_per_run),
        ("skeleton own time per hop", p50(bare_protocol) if bare_protocol else None, around, 0.0),
    ):
        if latency is None:
            continue
        emit(
            figure,
            (latency - floor - handlers) / CRITICAL_HOPS,
            "ms",
            critical_hops=CRITICAL_HOPS,
            floor_ms=round(floor, 2),
            handlers_ms=round(handlers, 2),
            latency_over_floor=round(latency / floor, 2),
        )
    if plain and bare_protocol:
        emit(
            "own time per hop beyond the skeleton",
            (p50(plain) - p50(bare_protocol)) / CRITICAL_HOPS,
            "ms",
            critical_hops=CRITICAL_HOPS,
        )
    median_run = sorted(latencies, key=latencies.__getitem__)[len(latencies) // 2]
    found = spans[median_run]
    assert found is not None
    print(f"\nthe median run, {median_run} ({latencies[median_run]:.2f} ms):", file=sys.stderr)
    for line in timeline(traces, median_run, found[0]):
        print("  " + line, file=sys.stderr)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--plain-runs",
        type=int,
        default=200,
        help="untraced model-ingest runs, back to back, for the latency figures (0: skip)",
    )
    p.add_argument("--runs", type=int, default=20, help="traced model-ingest runs, one after another")
    p.add_argument("--pings", type=int, default=200, help="bare hops measured")
    p.add_argument(
        "--idle-ms", type=float, default=3.0, help="idle time before each 'after idle' hop and round trip"
    )
    p.add_argument("--shard-count", type=int, default=4, help="shards per class")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds a run may take")
    p.add_argument("--keep", action="store_true", help="keep the vhost, keys, logs and traces")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    untraced = untraced_latencies(args) if args.plain_runs else Untraced([], [], [])
    folder = Path(tempfile.mkdtemp(prefix="saga-trace-"))
    stack = BenchStack(args.shard_count)
    stack.env["SAGA_TRACE_DIR"] = str(folder)
    try:
        stack.setup()
        stack.start(orchestrators=1, workers=1, concurrency=16)
        stack.wait_consuming()
        TRACE.configure(str(folder), "client")
        runs = asyncio.run(traced_runs(stack, args.runs, args.timeout))
        TRACE.configure(None, "client")  # flushes the client's trace
        for name in list(stack.processes):
            stack.stop(name)  # they flush their traces on the way out
        measured = asyncio.run(floors(stack, args.pings, args.idle_ms))
    finally:
        stack.teardown(keep=args.keep)
    report(read_traces(folder), runs, measured, args.idle_ms, untraced)
    print(f"traces in {folder}", file=sys.stderr)
    return 0


@dataclass
class Untraced:
    """The runs the latency figures come from, with the bare hops measured around them, and the CPU
    time each process spent on them (ms, summed over the runs, by role: saga's and the skeleton's)."""

    latencies: list[float]
    skeleton: list[float]
    hops: list[float]
    cpu_ms: dict[tuple[str, str], float] = field(default_factory=dict)  # by (side, process)


def untraced_latencies(args: argparse.Namespace) -> Untraced:
    """``--plain-runs`` model-ingest runs with tracing off and as many runs of the protocol's skeleton
    (``bench/skeleton.py``, its two processes beside saga's on the same vhost), in turn (saga then the
    skeleton, then the skeleton then saga, ...), each timed as ``bench/run.py`` times its single runs:
    from the start's publish until the client's wait returns with the run completed (the run's end is
    announced to it).
    Half the bare hops right before them, half right after: this machine's speed drifts within
    minutes, and runs a few milliseconds apart see the same machine."""
    stack = BenchStack(args.shard_count)
    try:
        stack.setup()
        stack.start(orchestrators=1, workers=1, concurrency=16)
        stack.wait_consuming()
        urls = (stack.settings.amqp_url, stack.settings.redis_url, f"{stack.prefix}:skeleton")
        with skeleton.roles(*urls) as skeleton_pids:
            pids = {
                "saga": {
                    "orchestrator": stack.processes["orchestrator-0"].pid,
                    "worker": stack.processes["worker-0"].pid,
                },
                "skeleton": skeleton_pids,
            }
            before, _ = asyncio.run(bare_hop(stack.settings.amqp_url, args.pings // 2))
            plain, bare_protocol, cpu = asyncio.run(
                runs_in_turn(stack, urls, pids, args.plain_runs, args.timeout)
            )
            after, _ = asyncio.run(bare_hop(stack.settings.amqp_url, args.pings - args.pings // 2))
        return Untraced(plain, bare_protocol, before + after, cpu)
    finally:
        stack.teardown(keep=False)


def completed(run: SingleRun, stack: BenchStack) -> SingleRun:
    if run.state != "completed":
        raise RuntimeError(f"run {run.run_id} ended {run.state}; see {stack.logs}")
    return run


async def runs_in_turn(
    stack: BenchStack,
    urls: tuple[str, str, str],
    pids: dict[str, dict[str, int]],
    count: int,
    timeout_s: float,
) -> tuple[list[float], list[float], dict[tuple[str, str], float]]:
    """``count`` saga runs and ``count`` skeleton runs, in turn, after a warm-up run of each; with the
    CPU time (ms) the processes of each (``pids``: by side, then role) spent on them, read right before
    and after each run, so that nothing done between runs counts."""
    watcher = Watcher(stack.settings.redis_url, stack.prefix)
    driver = skeleton.Driver(*urls, timeout_s=timeout_s)
    cpu: dict[tuple[str, str], float] = {}

    async def counted(side: str, run: Awaitable[float]) -> float:
        before = {role: cpu_ns(pid) for role, pid in pids[side].items()}
        ms = await run
        for role, pid in pids[side].items():
            cpu[side, role] = cpu.get((side, role), 0.0) + (cpu_ns(pid) - before[role]) * MS
        return ms

    try:
        await driver.open()
        async with Client(stack.settings) as client:

            async def saga_run(name: str) -> float:
                timed = await watcher.time_one(client, name, timeout_s)
                return completed(timed, stack).ms

            await saga_run("warm-0")
            await driver.one()
            latencies: dict[str, list[float]] = {"saga": [], "skeleton": []}
            for i in range(count):
                runs: dict[str, Callable[[], Awaitable[float]]] = {
                    "saga": functools.partial(saga_run, f"p{i}"),
                    "skeleton": driver.one,
                }
                for side in ("saga", "skeleton") if i % 2 == 0 else ("skeleton", "saga"):
                    latencies[side].append(await counted(side, runs[side]()))
            return latencies["saga"], latencies["skeleton"], cpu
    finally:
        await driver.close()
        await watcher.close()


if __name__ == "__main__":
    sys.exit(main())

"""Building blocks of fault scenarios: a Redis server of their own, a stack whose orchestrator reaches that
Redis only through a fault proxy, a seeded workload, and what to observe while a fault lasts.

The worker and the test's own checks talk to the Redis server directly: only the orchestrator's path is
faulted, so what a scenario sees is the orchestrator's behaviour, not the worker's or the checker's.
"""

from __future__ import annotations

import random
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from orchestrator.client import SyncClient, run_id_for
from orchestrator.settings import Settings
from tests.faults import invariants
from tests.faults.proxy import FaultProxy
from tests.integration.own_redis import RedisServer
from tests.integration.stack import Stack, poll


@contextmanager
def redis_server(folder: Path) -> Iterator[RedisServer]:
    if shutil.which("redis-server") is None:
        raise RuntimeError("redis-server is not installed; the fault scenarios need it")
    server = RedisServer(folder)
    try:
        server.start()
        yield server
    finally:
        server.stop()


@contextmanager
def stack_behind_proxy(
    name: str, folder: Path, *, worker_concurrency: int = 16
) -> Iterator[tuple[Stack, FaultProxy]]:
    """A set-up stack on a Redis of its own, the orchestrator's ``SAGA_REDIS_URL`` pointing at a fault
    proxy in front of it. Everything is stopped and removed afterwards, also on failure: processes, the
    vhost, the keys, the proxy's thread and sockets, the redis-server."""
    with redis_server(folder) as server, FaultProxy("127.0.0.1", server.port) as proxy:
        stack = Stack(name, redis_url=server.url)
        try:
            stack.setup()
            stack.start_orchestrator(extra_env={"SAGA_REDIS_URL": proxy.redis_url()})
            stack.start_worker("worker", "--concurrency", str(worker_concurrency))
            wait_until_serving(stack, proxy)
            yield stack, proxy
        finally:
            # An orchestrator stuck on a connection a blackhole stranded would sit out SIGTERM until the
            # stop's timeout; reset those connections so that it can hear it and drain.
            proxy.reset_stranded()
            stack.teardown()


def wait_until_serving(stack: Stack, proxy: FaultProxy, timeout_s: float = 60.0) -> None:
    """Until every shard queue has a consumer, which the orchestrator opens only after Redis answered it
    through the proxy: a fault injected earlier would hit a process still starting, not a serving one."""

    def serving() -> bool:
        consumers = {
            n: c
            for n, c in stack.list_queues("consumers").items()
            if n.startswith("saga.shard.") and not n.endswith(".dlq")
        }
        return bool(consumers) and all(consumers.values()) and proxy.stats().bytes_down > 0

    poll(serving, timeout_s, interval_s=0.2, what="the orchestrator to serve every shard through the proxy")


@dataclass(frozen=True)
class FaultSeed:
    """A scenario's random choices come from ``rng``; ``seed`` reproduces them (SAGA_FAULT_SEED)."""

    seed: int
    rng: random.Random


# ---- workload -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Start:
    definition: str
    context: dict[str, Any]
    key: str  # idempotency key: the run id is known before the start is sent

    @property
    def run_id(self) -> str:
        return run_id_for(self.definition, self.key)


@dataclass
class Workload:
    before: list[Start] = field(default_factory=list)  # started before the fault
    during: list[Start] = field(default_factory=list)  # started while it lasts
    delayed: int = 0  # how many tasks got an injected delay

    @property
    def run_ids(self) -> list[str]:
        return [s.run_id for s in self.before + self.during]


# model-ingest stages a delay can slow down (cache.lookup is left alone: a slow lookup delays the whole run)
SLOWABLE = ("thumbnail.render", "semantic.analyse", "metadata.extract", "catalogue.publish")


def mixed_workload(
    stack: Stack, rng: random.Random, *, runs: int, during: int, bag_items: int, tag: str = "w"
) -> Workload:
    """``runs`` model-ingest runs (some cache hits, some with a slow stage) and one thumbnail-batch bag
    of ``bag_items`` items (some slow); the last ``during`` model-ingest runs are meant to be started while
    the fault lasts. The slow stages keep runs in flight across the fault instead of finishing first."""
    work = Workload()
    starts = []
    for i in range(runs):
        model = f"{'cached-' if rng.random() < 0.15 else ''}{tag}-{i}"
        if rng.random() < 0.5:
            stack.world.set_fault(model, rng.choice(SLOWABLE), delay_ms=rng.randint(50, 1500))
            work.delayed += 1
        starts.append(Start("model-ingest", {"modelId": model}, f"{tag}-ingest-{i}"))
    items = [f"{tag}-item-{i}" for i in range(bag_items)]
    for item in rng.sample(items, k=bag_items // 10):
        stack.world.set_fault(item, "thumbnail.render", delay_ms=rng.randint(50, 500))
        work.delayed += 1
    work.before = [Start("thumbnail-batch", {"modelIds": items}, f"{tag}-bag"), *starts[: runs - during]]
    work.during = starts[runs - during :]
    return work


def start_all(settings: Settings, starts: list[Start], threads: int = 4) -> None:
    """Start runs from ``threads`` clients at once (a pika connection is not thread-safe: one each)."""
    errors: list[BaseException] = []

    def send(part: list[Start]) -> None:
        try:
            with SyncClient(settings) as client:
                for s in part:
                    assert client.start(s.definition, s.context, idempotency_key=s.key) == s.run_id
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=send, args=(starts[i::threads],)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(120)
    if errors:
        raise errors[0]


# ---- observation ------------------------------------------------------------------------------------------


def history_total(r: redis.Redis, prefix: str) -> int:
    """How many history events all runs under ``prefix`` have: it only grows when a transition commits."""
    keys = list(r.scan_iter(match=f"{prefix}:{{*}}:run:*:history", count=1000))
    with r.pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.xlen(key)
        return sum(int(n) for n in pipe.execute())


def busy_queues(stack: Stack) -> dict[str, int]:
    return {name: n for name, n in stack.list_queues("messages").items() if n}


def log_tail(stack: Stack, name: str, lines: int = 30) -> str:
    return "\n".join(stack.log(name).splitlines()[-lines:])


def sleep_until(deadline: float) -> None:
    time.sleep(max(0.0, deadline - time.monotonic()))


def await_convergence(
    stack: Stack, run_ids: list[str], what: str, timeout_s: float, logs: tuple[str, ...] = ("orchestrator",)
) -> None:
    """Every run terminal and every outbox empty within ``timeout_s`` (a liveness bound, not a timing
    claim); else print the processes' last log lines and the busy queues, and fail naming ``what``."""
    pending = invariants.wait_for_convergence(stack.redis, stack.prefix, run_ids, timeout_s)
    if pending:
        for name in logs:
            print(f"{name} log, last lines:\n{log_tail(stack, name)}")
        print(f"busy queues: {busy_queues(stack)}")
    invariants.assert_no_violations(pending, f"liveness {what}")


def invariant_violations(stack: Stack, run_ids: list[str]) -> list[str]:
    """The shared invariants over ``run_ids`` (and every run of the stack), and no dead letters."""
    violations = invariants.check_runs(stack.redis, stack.prefix, run_ids, all_runs=True)
    return violations + invariants.dead_letters(stack.queue_depths())

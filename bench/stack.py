"""An isolated saga stack for the benchmark: the integration tests' Stack (tests/integration/stack.py),
with the benchmark's names and several orchestrator and worker processes.

Isolation: a RabbitMQ vhost of its own (``saga-bench-<tag>``, made with rabbitmqctl, deleted after) and a
Redis key prefix of its own (``sagabench<tag>``, its keys deleted after). The topology is applied and every
definition in ``definitions/`` published. Orchestrators and workers run as real subprocesses
(``python -m orchestrator orchestrator|worker``), logging to ``/tmp/saga-bench-<tag>/``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import re
import time
from pathlib import Path

from orchestrator.provision import provision
from orchestrator.store.keys import ShardKeys, index_key
from tests.integration.stack import REGISTRY, ROOT, Stack, rabbitmqctl

PROBLEM = re.compile(r"\b(ERROR|CRITICAL|WARNING)\b|Traceback")


def shard_ranges(count: int, parts: int) -> list[str]:
    """Split shard numbers 0..count-1 into ``parts`` contiguous ``--shards`` ranges ("0-1", "2-3")."""
    if parts > count:
        raise ValueError(f"{parts} orchestrators need at least {parts} shards (--shard-count)")
    bounds = [round(i * count / parts) for i in range(parts + 1)]
    return [f"{lo}-{hi - 1}" if hi - 1 > lo else str(lo) for lo, hi in itertools.pairwise(bounds)]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a live process, from /proc (0.0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_ns(pid: int) -> int:
    """Nanoseconds on a CPU so far of every thread of a live process, from /proc/<pid>/task/*/schedstat
    (exact, where ``cpu_seconds`` counts clock ticks: fine enough for a run of milliseconds); 0 once it is
    gone."""
    total = 0
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                total += int((task / "schedstat").read_text().split()[0])
    except OSError:
        return 0
    return total


SERVICES = {"beam.smp": "rabbitmq", "redis-server": "redis"}
# the size of a key of each type, for describing a stuck run (a bag's bitmap is a string, its results a list)
SIZE_COMMANDS = {"hash": "hlen", "stream": "xlen", "set": "scard", "list": "llen", "string": "strlen"}


def service_pids() -> dict[str, list[int]]:
    """PIDs of the RabbitMQ and Redis servers on this machine, by service (from /proc)."""
    found: dict[str, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                comm = (entry / "comm").read_text().strip()
            except OSError:
                continue
            if comm in SERVICES:
                found.setdefault(SERVICES[comm], []).append(int(entry.name))
    return found


def machine_busy_seconds() -> float:
    """CPU seconds every core of this machine has spent busy (not idle, not waiting) since boot."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = (
        int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]
    )
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class BenchStack(Stack):
    """The tests' isolated stack (tests/integration/stack.py) with the benchmark's names, shard count and
    no-op handlers, plus several orchestrators or workers and CPU and hang reporting."""

    def __init__(
        self, shard_count: int, items_per_message: int | None = None, pack_tasks: int | None = None
    ) -> None:
        # no-op handlers (SAGA_DEMO_EFFECTS=0), like the peers' tasks
        env = {"SAGA_DEMO_EFFECTS": "0"}
        if pack_tasks is not None:
            env["SAGA_PACK_TASKS"] = str(pack_tasks)
        super().__init__("", family="bench", shard_count=shard_count, env=env)
        self.shard_count = shard_count
        self.items_per_message = items_per_message

    def setup(self) -> None:
        """As the tests' stack, with the bag's ``items_per_message`` set as asked (None: as written)."""
        if self.items_per_message is None:
            super().setup()
            return
        self.rabbitmqctl("add_vhost", self.vhost)
        self.rabbitmqctl("set_permissions", "-p", self.vhost, "guest", ".*", ".*", ".*")
        folder = self.logs / "definitions"
        folder.mkdir(parents=True, exist_ok=True)
        for source in sorted((ROOT / "definitions").glob("*.yaml")):
            text = source.read_text(encoding="utf-8")
            if source.name == "thumbnail-batch.yaml":
                text = re.sub(r"\n *items_per_message: *\d+", "", text)
                text = text.replace(
                    "    max_items:", f"    items_per_message: {self.items_per_message}\n    max_items:"
                )
            (folder / source.name).write_text(text, encoding="utf-8")
        asyncio.run(provision(self.settings, REGISTRY, sorted(folder.glob("*.yaml"))))

    def start(self, orchestrators: int, workers: int, concurrency: int) -> None:
        ranges = shard_ranges(self.shard_count, orchestrators)
        for i, shards in enumerate(ranges):
            args = ["--shards", shards] if orchestrators > 1 else []
            self._spawn(f"orchestrator-{i}", ["orchestrator", *args], None)
        for i in range(workers):
            self._spawn(f"worker-{i}", ["worker", "--concurrency", str(concurrency)], None)

    def wait_consuming(self, timeout_s: float = 60.0) -> None:
        """Until every shard and task queue has a consumer (dead-letter and rejected queues never do)."""
        deadline = time.monotonic() + timeout_s
        idle: list[str] = ["(not listed yet)"]
        while time.monotonic() < deadline:
            self._check_alive()
            consumers = self.list_queues("consumers")
            idle = [q for q, n in consumers.items() if n == 0 and self._consumed(q)]
            if consumers and not idle:
                return
            time.sleep(0.5)
        raise RuntimeError(f"queues without consumers after {timeout_s:g} s: {idle}; see {self.logs}")

    @staticmethod
    def _consumed(queue: str) -> bool:
        return not queue.endswith((".dlq", ".rejected"))

    def _check_alive(self) -> None:
        dead = {n: p.returncode for n, p in self.processes.items() if p.poll() is not None}
        if dead:
            raise RuntimeError(f"processes exited early: {dead}; see {self.logs}")

    def cpu_by_role(self) -> dict[str, float]:
        """CPU seconds used so far by the orchestrators and the workers (summed per role)."""
        out: dict[str, float] = {}
        for name, process in self.processes.items():
            role = name.rsplit("-", 1)[0] + "s"
            out[role] = out.get(role, 0.0) + cpu_seconds(process.pid)
        return out

    # ---- inspection --------------------------------------------------------------------------------

    def dead_letters(self) -> dict[str, int]:
        """Messages sitting in dead-letter queues or the rejected queue (all should be empty)."""
        return {q: n for q, n in self.list_queues("messages").items() if n and not self._consumed(q)}

    def log_problems(self) -> list[str]:
        """Warning, error and traceback lines of every process log, as ``name: line``."""
        lines = []
        for path in sorted(self.logs.glob("*.log")):
            for line in path.read_text(errors="replace").splitlines():
                if PROBLEM.search(line):
                    lines.append(f"{path.stem}: {line}")
        return lines

    def describe_run(self, run_id: str, fields: int = 40, events: int = 8) -> list[str]:
        """What a stuck run looks like in Redis: its record, the sizes of its keys, its last events."""
        shard = self.redis.get(index_key(self.prefix, run_id))
        if shard is None:
            return [f"run {run_id}: never created (no index key)"]
        base = ShardKeys(self.prefix, str(shard)).run(run_id)
        record: dict[str, str] = self.redis.hgetall(base)  # type: ignore[assignment]
        lines = [f"run {run_id} on shard {shard}: {len(record)} fields in its hash"]
        lines += [f"  {k} = {v[:160]}" for k, v in sorted(record.items())[:fields]]
        for key in sorted(self.redis.scan_iter(match=f"{base}:*", count=1000)):
            kind = self.redis.type(key)
            command = SIZE_COMMANDS.get(str(kind))
            size = getattr(self.redis, command)(key) if command else "?"
            lines.append(f"  key {key[len(base) :]}: {kind} of {size}")
        last: list[tuple[str, dict[str, str]]] = self.redis.xrevrange(f"{base}:history", count=events)  # type: ignore[assignment]
        for entry_id, entry in reversed(last):
            lines.append(f"  history {entry_id}: {json.dumps(entry)[:300]}")
        return lines

    def queue_report(self) -> list[str]:
        """Queues holding messages (ready or unacked), with their consumer counts."""
        out = rabbitmqctl(
            "list_queues", "-p", self.vhost, "name", "messages_ready", "messages_unacknowledged", "consumers"
        )
        rows = [line.split() for line in out.splitlines()]
        return [
            f"queue {r[0]}: ready {r[1]}, unacked {r[2]}, consumers {r[3]}"
            for r in rows
            if len(r) == 4 and r[1].isdigit() and (int(r[1]) or int(r[2]))
        ]

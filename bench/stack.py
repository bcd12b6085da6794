"""An isolated saga stack for the benchmark, set up the way tests/integration/stack.py sets up a test's.

Isolation: a RabbitMQ vhost of its own (``saga-bench-<tag>``, made with rabbitmqctl, deleted after) and a
Redis key prefix of its own (``sagabench<tag>``, its keys deleted after). The topology is applied and every
definition in ``definitions/`` published. Orchestrators and workers run as real subprocesses
(``python -m orchestrator orchestrator|worker``), logging to ``/tmp/saga-bench-<tag>/``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from urllib.parse import quote

import redis

from orchestrator.bus import names
from orchestrator.contracts import Registry
from orchestrator.provision import provision
from orchestrator.settings import Settings
from orchestrator.store.keys import ShardKeys, index_key

ROOT = Path(__file__).resolve().parents[1]
REGISTRY = Registry.from_modules(["workers.demo"])
PROBLEM = re.compile(r"\b(ERROR|CRITICAL|WARNING)\b|Traceback")


def rabbitmqctl(*args: str) -> str:
    done = subprocess.run(
        ["rabbitmqctl", "-q", *args], capture_output=True, text=True, timeout=60, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"rabbitmqctl {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout


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


SERVICES = {"beam.smp": "rabbitmq", "redis-server": "redis"}


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


class BenchStack:
    def __init__(self, shard_count: int) -> None:
        tag = uuid.uuid4().hex[:8]
        self.vhost = f"saga-bench-{tag}"
        self.prefix = f"sagabench{tag}"
        self.shard_count = shard_count
        self.env = {
            **os.environ,
            "SAGA_AMQP_URL": f"amqp://guest:guest@127.0.0.1:5672/{quote(self.vhost, safe='')}",
            "SAGA_REDIS_URL": "redis://127.0.0.1:6379/0",
            "SAGA_KEY_PREFIX": self.prefix,
            "SAGA_SHARD_COUNT": str(shard_count),
            "SAGA_DEMO_EFFECTS": "0",  # no-op handlers, like the peers' tasks
            "PYTHONUNBUFFERED": "1",
        }
        self.settings = Settings(
            amqp_url=self.env["SAGA_AMQP_URL"],
            redis_url=self.env["SAGA_REDIS_URL"],
            key_prefix=self.prefix,
            shard_count=shard_count,
        )
        self.redis = redis.Redis.from_url(self.settings.redis_url, decode_responses=True)
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.logs = Path(f"/tmp/{self.vhost}")
        self.logs.mkdir(parents=True, exist_ok=True)

    # ---- lifecycle ---------------------------------------------------------------------------------

    def setup(self) -> None:
        rabbitmqctl("add_vhost", self.vhost)
        rabbitmqctl("set_permissions", "-p", self.vhost, "guest", ".*", ".*", ".*")
        asyncio.run(provision(self.settings, REGISTRY, sorted((ROOT / "definitions").glob("*.yaml"))))

    def start(self, orchestrators: int, workers: int, concurrency: int) -> None:
        ranges = shard_ranges(self.shard_count, orchestrators)
        for i, shards in enumerate(ranges):
            args = ["--shards", shards] if orchestrators > 1 else []
            self._spawn(f"orchestrator-{i}", ["orchestrator", *args])
        for i in range(workers):
            self._spawn(f"worker-{i}", ["worker", "--concurrency", str(concurrency)])

    def _spawn(self, name: str, args: list[str]) -> None:
        log = (self.logs / f"{name}.log").open("ab")
        self.processes[name] = subprocess.Popen(
            [sys.executable, "-m", "orchestrator", *args, "-v"],
            cwd=ROOT,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )

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
        return queue != names.REJECTED_QUEUE and not queue.endswith(".dlq")

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

    def teardown(self, keep: bool = False) -> None:
        for name in list(self.processes):
            self.stop(name)
        self.redis.close()
        if keep:
            return
        try:
            rabbitmqctl("delete_vhost", self.vhost)
        finally:
            client = redis.Redis.from_url(self.settings.redis_url, decode_responses=True)
            keys = list(client.scan_iter(match=f"{self.prefix}:*", count=1000))
            for i in range(0, len(keys), 500):
                client.delete(*keys[i : i + 500])
            client.close()

    def stop(self, name: str, sig: int = signal.SIGTERM) -> int:
        process = self.processes.pop(name)
        if process.poll() is None:
            process.send_signal(sig)
        try:
            return process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            return process.wait(timeout=10)

    # ---- inspection --------------------------------------------------------------------------------

    def list_queues(self, column: str) -> dict[str, int]:
        out = rabbitmqctl("list_queues", "-p", self.vhost, "name", column)
        found = {}
        for line in out.splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1].isdigit():
                found[parts[0]] = int(parts[1])
        return found

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
            size = {"hash": self.redis.hlen, "stream": self.redis.xlen, "set": self.redis.scard}.get(
                str(kind), lambda _k: "?"
            )(key)
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

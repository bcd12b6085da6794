"""A whole saga stack on the real services, isolated for one test module.

Isolation: a RabbitMQ vhost of its own (created with rabbitmqctl, deleted after) and a Redis key prefix of
its own (its keys deleted after), so tests never disturb a demo or a benchmark on the same services.
Processes: the orchestrator and a worker run as real subprocesses (``python -m orchestrator ...``), so
they can be killed with SIGKILL and restarted.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aio_pika

from orchestrator.bus.connect import connect_once
from orchestrator.bus.envelope import Envelope, encode
from orchestrator.compiler import CompiledPlan
from orchestrator.contracts import Registry
from orchestrator.governance.service import publish_verb
from orchestrator.governance.store import DefinitionStore, definition_key, parse_state
from orchestrator.keys.reload import signer_for
from orchestrator.provision import provision
from orchestrator.settings import Settings
from orchestrator.store.connect import sync_client
from orchestrator.store.keys import ShardKeys, index_key
from orchestrator.store.redis_store import RedisStore
from workers.demo.effects import DemoWorld

ROOT = Path(__file__).resolve().parents[2]
REGISTRY = Registry.from_modules(["workers.demo"])


async def publish_active(store: RedisStore, plan: CompiledPlan) -> None:
    """Publish, approve and activate ``plan`` on ``store``'s Redis and prefix (a processor under test
    creates runs only from approved versions)."""
    definitions = DefinitionStore(store.client, store.prefix)
    await definitions.change(plan.name, publish_verb(plan, activate=True), "tests", "under test", plan)


def rabbitmqctl(*args: str, node: str | None = None) -> str:
    """``rabbitmqctl ARGS`` on the machine's broker, or on ``node`` (a test cluster's node name)."""
    target = ["-n", node] if node else []
    done = subprocess.run(
        ["rabbitmqctl", "-q", *target, *args], capture_output=True, text=True, timeout=60, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"rabbitmqctl {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout


def now_ms() -> int:
    """The wall clock as messages carry it (``issued_at_ms``): a message built by a test is fresh."""
    return int(time.time() * 1000)


def poll(
    check: Callable[[], Any], timeout_s: float = 30.0, interval_s: float = 0.05, what: str = "condition"
) -> Any:
    """Poll until ``check()`` returns something truthy; never sleep-and-hope."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


class Stack:
    def __init__(
        self,
        name: str,
        redis_url: str = "redis://127.0.0.1:6379/0",
        *,
        family: str = "test",
        shard_count: int = 2,
        env: dict[str, str] | None = None,
        amqp_hosts: str = "127.0.0.1:5672",
        rabbitmq_node: str | None = None,
    ) -> None:
        """``family`` names what owns the stack (``test``, ``bench``): vhost ``saga-<family>-<name>-<tag>``,
        key prefix ``saga<family><tag>``; ``env`` adds SAGA_* variables for every process.
        ``amqp_hosts`` and ``rabbitmq_node`` point it at another broker (a test cluster: its nodes'
        host:port, comma-separated, and the node that rabbitmqctl asks)."""
        tag = uuid.uuid4().hex[:8]
        self.vhost = "-".join(part for part in ("saga", family, name, tag) if part)
        self.prefix = f"saga{family}{tag}"
        self.env = {
            **os.environ,
            "SAGA_AMQP_URL": f"amqp://guest:guest@{amqp_hosts}/{quote(self.vhost, safe='')}",
            "SAGA_REDIS_URL": redis_url,
            "SAGA_KEY_PREFIX": self.prefix,
            "SAGA_SHARD_COUNT": str(shard_count),
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        self.settings = Settings(
            amqp_url=self.env["SAGA_AMQP_URL"],
            redis_url=self.env["SAGA_REDIS_URL"],
            key_prefix=self.prefix,
            shard_count=shard_count,
        )
        self.redis = sync_client(self.settings.redis_url, decode_responses=True)
        self.world = DemoWorld(self.redis, self.prefix)
        self.signer = signer_for(self.settings)
        self.rabbitmq_node = rabbitmq_node
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.logs = Path(f"/tmp/{self.vhost}")
        self.logs.mkdir(parents=True, exist_ok=True)

    # ---- lifecycle ---------------------------------------------------------------------------------

    def setup(self) -> None:
        self.rabbitmqctl("add_vhost", self.vhost)
        self.rabbitmqctl("set_permissions", "-p", self.vhost, "guest", ".*", ".*", ".*")
        asyncio.run(provision(self.settings, REGISTRY, sorted((ROOT / "definitions").glob("*.yaml"))))

    def teardown(self, keep: bool = False, drop_vhost: bool = True) -> None:
        """Stop every process, then delete the vhost and the keys (``keep``: leave them to inspect;
        ``drop_vhost=False``: the broker is thrown away whole, as a test cluster is)."""
        for name in list(self.processes):
            self.stop(name)
        if keep:
            self.redis.close()
            return
        try:
            if drop_vhost:
                self.rabbitmqctl("delete_vhost", self.vhost)
        finally:
            keys = list(self.redis.scan_iter(match=f"{self.prefix}:*", count=1000))
            for i in range(0, len(keys), 500):
                self.redis.delete(*keys[i : i + 500])
            self.redis.close()

    def start_orchestrator(
        self, name: str = "orchestrator", *args: str, extra_env: dict[str, str] | None = None
    ) -> None:
        self._spawn(name, ["orchestrator", *args], extra_env)

    def start_worker(self, name: str = "worker", *args: str, extra_env: dict[str, str] | None = None) -> None:
        self._spawn(name, ["worker", "--concurrency", "16", *args], extra_env)

    def _spawn(self, name: str, args: list[str], extra_env: dict[str, str] | None) -> None:
        log = (self.logs / f"{name}.log").open("ab")
        self.processes[name] = subprocess.Popen(
            [sys.executable, "-m", "orchestrator", *args, "-v"],
            cwd=ROOT,
            env={**self.env, **(extra_env or {})},
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def saga(
        self, *args: str, timeout_s: float = 120.0, extra_env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run ``saga ARGS`` against this stack (its vhost, key prefix and settings, plus ``extra_env``)."""
        return subprocess.run(
            [sys.executable, "-m", "orchestrator", *args],
            cwd=ROOT,
            env={**self.env, **(extra_env or {})},
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )

    def saga_json(self, *args: str) -> Any:
        """``saga ARGS --json``, which must succeed; its parsed output."""
        done = self.saga(*args, "--json")
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    def stop(self, name: str, sig: int = signal.SIGTERM) -> int:
        process = self.processes.pop(name)
        if process.poll() is None:
            process.send_signal(sig)
        try:
            return process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            return process.wait(timeout=10)

    def wait_exit(self, name: str, timeout_s: float = 30.0) -> int:
        process = self.processes.pop(name)
        return process.wait(timeout=timeout_s)

    def log(self, name: str) -> str:
        path = self.logs / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    # ---- inspection --------------------------------------------------------------------------------

    def active_digest(self, definition: str) -> str | None:
        """The digest of the version new runs of ``definition`` use (None: no active version)."""
        state = parse_state(definition, self.redis.get(definition_key(self.prefix, definition)))
        return state.versions[state.active].digest if state.active else None

    def shard_of(self, run_id: str) -> str | None:
        return self.redis.get(index_key(self.prefix, run_id))  # type: ignore[return-value]

    def record(self, run_id: str) -> dict[str, str]:
        shard = self.shard_of(run_id)
        return self.redis.hgetall(ShardKeys(self.prefix, shard).run(run_id)) if shard else {}  # type: ignore[return-value]

    def history(self, run_id: str) -> list[dict[str, Any]]:
        shard = self.shard_of(run_id)
        if not shard:
            return []
        rows = self.redis.xrange(ShardKeys(self.prefix, shard).history(run_id))
        return [{**f, "detail": json.loads(f["detail"])} for _, f in rows]  # type: ignore[union-attr]

    def wait_finished(self, run_id: str, timeout_s: float = 60.0) -> dict[str, str]:
        return poll(
            lambda: (r := self.record(run_id)) and r.get("status") in ("completed", "failed") and r,
            timeout_s,
            what=f"run {run_id} to finish",
        )  # type: ignore[no-any-return]

    def outbox(self, shard: str) -> dict[str, str]:
        return self.redis.hgetall(ShardKeys(self.prefix, shard).outbox())  # type: ignore[return-value]

    def queue_depths(self) -> dict[str, int]:
        return self.list_queues("messages")

    def list_queues(self, column: str) -> dict[str, int]:
        """One numeric column of ``rabbitmqctl list_queues`` for this vhost, by queue name."""
        out = self.rabbitmqctl("list_queues", "-p", self.vhost, "name", column)
        found = {}
        for line in out.splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1].isdigit():
                found[parts[0]] = int(parts[1])
        return found

    # ---- publishing as a service (or an attacker) would --------------------------------------------

    def rabbitmqctl(self, *args: str) -> str:
        """``rabbitmqctl ARGS`` on the broker (or cluster node) this stack uses."""
        return rabbitmqctl(*args, node=self.rabbitmq_node)

    def publish_raw(
        self, exchange: str, routing_key: str, body: bytes, headers: dict[str, Any] | None = None
    ) -> None:
        async def go() -> None:
            connection = await connect_once(self.settings.amqp_url)
            try:
                channel = await connection.channel(publisher_confirms=True)
                target = await channel.get_exchange(exchange, ensure=False)
                await target.publish(
                    aio_pika.Message(body, delivery_mode=aio_pika.DeliveryMode.PERSISTENT, headers=headers),
                    routing_key=routing_key,
                    mandatory=True,
                )
            finally:
                await connection.close()

        asyncio.run(go())

    def publish_envelope(self, envelope: Envelope, exchange: str, routing_key: str) -> None:
        self.publish_raw(exchange, routing_key, encode(self.signer.sign(envelope)))


@contextmanager
def running(name: str, env: dict[str, str] | None = None) -> Iterator[Stack]:
    """A set-up stack with one orchestrator and one worker running (``env``: SAGA_* for every process),
    torn down after."""
    stack = Stack(name, env=env)
    stack.setup()
    try:
        stack.start_orchestrator()
        stack.start_worker()
        yield stack
    finally:
        stack.teardown()

"""The main job: run model-ingest end to end on RabbitMQ and Redis, with a live stage table.

`make demo` runs it. It empties its own environment (namespace `demo`: what an earlier demo left in its
queues and Redis keys), validates, publishes and activates the definitions, declares the broker
topology, starts an orchestrator and a worker pool as real processes, starts one model-ingest run (the
demo workers are slowed down a little so you can watch), shows each stage as it moves, then prints the
run's output and history. Every step is also a `saga` command you can run by hand; they are listed at the end.

Settings come from SAGA_* variables (defaults: RabbitMQ and Redis on 127.0.0.1, namespace `demo`).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import redis

from orchestrator.bus.connect import connect_once
from orchestrator.bus.topology import topology_for
from orchestrator.client import Client
from orchestrator.contracts import Registry
from orchestrator.observe import status_view
from orchestrator.provision import provision
from orchestrator.settings import Settings
from orchestrator.store.connect import sync_client
from orchestrator.store.redis_store import RedisStore
from orchestrator.store.shardmap_store import current_map
from orchestrator.views import LiveTable
from workers.demo.effects import DemoWorld

ROOT = Path(__file__).resolve().parent.parent
DEMO_NAMESPACE = "demo"  # the demo's own environment, emptied at every start
LOGS = Path(os.environ.get("SAGA_DEMO_LOGS") or ROOT / ".demo")  # the processes' logs
SLOW_MS = {
    "thumbnail.render": 700,
    "semantic.analyse": 900,
    "metadata.extract": 500,
    "catalogue.publish": 300,
}


def check_services(settings: Settings) -> None:
    problems = []
    try:
        sync_client(settings.redis_url, socket_connect_timeout=2).ping()
    except (redis.RedisError, redis.exceptions.RedisClusterException) as exc:
        problems.append(f"Redis at {settings.redis_url}: {exc}")

    async def amqp() -> None:
        connection = await connect_once(settings.amqp_url, timeout_s=3)
        await connection.close()

    try:
        asyncio.run(amqp())
    except Exception as exc:
        problems.append(f"RabbitMQ: {exc}")
    if problems:
        sys.exit(
            "demo: cannot reach the services it needs:\n  "
            + "\n  ".join(problems)
            + "\nStart them (docker compose up -d rabbitmq redis, or see README), then run make demo again."
        )


def fresh_environment(settings: Settings, registry: Registry) -> None:
    """The demo's namespace starts empty every time: the queues and Redis keys an earlier demo left are
    deleted, so a changed demo definition or contract never meets a version published before with
    another digest, nor messages of runs that no longer exist."""

    async def delete_queues() -> None:
        shard_map = await current_map(settings, seed=False)
        connection = await connect_once(settings.amqp_url)
        try:
            channel = await connection.channel()
            for queue in topology_for(settings, registry, shard_map).queues:
                await channel.queue_delete(queue.name)  # RabbitMQ: deleting a missing queue is no error
        finally:
            await connection.close()

    asyncio.run(delete_queues())
    client = sync_client(settings.redis_url)
    try:
        keys = list(client.scan_iter(match=f"{settings.key_prefix}:*", count=1000))
        for i in range(0, len(keys), 500):
            client.delete(*keys[i : i + 500])
    finally:
        client.close()


def prepare(settings: Settings, registry: Registry) -> None:
    if settings.namespace == DEMO_NAMESPACE and settings.key_prefix == DEMO_NAMESPACE:
        print(f"▸ a fresh '{DEMO_NAMESPACE}' environment: what an earlier demo left there is deleted")
        fresh_environment(settings, registry)
    else:  # never empty an environment that is not the demo's own
        print(f"▸ environment '{settings.namespace}' (not the demo's own): kept as it is")
    print("▸ validating and publishing definitions/*.yaml, declaring the broker topology")
    plans = asyncio.run(provision(settings, registry, sorted((ROOT / "definitions").glob("*.yaml"))))
    for plan in plans:
        print(f"  {plan.name:<20} {plan.version:<8} {plan.digest[:23]}…")


def spawn(name: str, args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    LOGS.mkdir(exist_ok=True)
    log = (LOGS / f"{name}.log").open("wb")
    return subprocess.Popen(
        [sys.executable, "-m", "orchestrator", *args], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
    )


async def run_one(settings: Settings) -> dict[str, Any]:
    model_id = f"model-{uuid.uuid4().hex[:6]}"
    world = DemoWorld(sync_client(settings.redis_url, decode_responses=True), settings.key_prefix)
    for contract, delay in SLOW_MS.items():  # slow the demo workers down so the table has time to move
        world.set_fault(model_id, contract, delay_ms=delay)
    async with Client(settings) as client:
        print(f"\n▸ starting model-ingest for {model_id}")
        run_id = await client.start("model-ingest", {"modelId": model_id})
        started = time.monotonic()
        status: dict[str, Any] | None = None
        table = LiveTable(sys.stdout.isatty())  # the renderer of `saga watch`
        store = RedisStore(client.redis, settings.key_prefix)
        show(table.frame(status, 0.0))
        while status is None or status["state"] not in ("completed", "failed"):
            await asyncio.sleep(0.1)
            try:
                status = await status_view(client.redis, settings, run_id, store=store)
            except Exception:
                status = None
            if time.monotonic() - started > 60:
                sys.exit(f"demo: run {run_id} did not finish in 60 s; see .demo/*.log")
            show(table.frame(status, time.monotonic() - started))
        return status


def show(frame: str | None) -> None:
    if frame is not None:
        sys.stdout.write(frame)
        sys.stdout.flush()


def main() -> None:
    os.environ.setdefault("SAGA_NAMESPACE", DEMO_NAMESPACE)  # its own queues and keys
    settings = Settings()
    registry = Registry.from_modules(settings.contracts)
    check_services(settings)
    prepare(settings, registry)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    processes = [spawn("orchestrator", ["orchestrator"], env), spawn("worker", ["worker"], env)]
    print("▸ orchestrator and worker pool started (logs in .demo/)")
    try:
        time.sleep(1.0)
        status = asyncio.run(run_one(settings))
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(timeout=30)
    print(f"\n▸ run {status['state']}: output = {status['output']}")
    if status.get("reason"):
        print(f"  reason: {status['reason']}")
    run_id = status["run_id"]
    print(f"""
What to try next:
  export SAGA_NAMESPACE={settings.namespace}       # the demo's environment (queues and keys)
  .venv/bin/saga history {run_id}        # every durable step of this run
  .venv/bin/saga status {run_id} --json
  .venv/bin/saga graph definitions/model-ingest.yaml   # paste into https://mermaid.live
  .venv/bin/saga orchestrator &  .venv/bin/saga worker &  # run the processes yourself, then:
  .venv/bin/saga start model-ingest --context '{{"modelId": "cached-1"}}' --wait   # the cache-hit path
""")
    sys.exit(0 if status["state"] == "completed" else 1)


if __name__ == "__main__":
    main()

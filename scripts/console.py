"""The web console with something to look at: ``make console``.

Prepares the environment as ``make demo`` does (namespace ``demo``, emptied first; definitions
published, topology declared), starts an orchestrator, a worker pool and ``saga server`` as real
processes, makes an admin token for you (shown once), and starts a few model-ingest runs: some complete,
one fails at its render stage, one waits a minute in it so there is a run to watch move or cancel. Then
it prints where to sign in and serves until Ctrl-C, which stops every process it started.

    python scripts/console.py [--port 8080] [--runs 6]

Settings come from SAGA_* variables, as for the demo. Logs are in .demo/ (or $SAGA_DEMO_LOGS).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from types import FrameType

import httpx
from demo import DEMO_NAMESPACE, LOGS, check_services, prepare, spawn  # scripts/demo.py

from orchestrator.auth.roles import Role
from orchestrator.auth.tokens import TokenStore
from orchestrator.client import Client
from orchestrator.contracts import Registry
from orchestrator.settings import Settings, redis_client
from orchestrator.store.connect import sync_client
from workers.demo.effects import DemoWorld

READY_TIMEOUT_S = 30.0


async def make_token(settings: Settings) -> str:
    """A new admin token named ``console-<random>``: its secret is printed once and never stored."""
    client = redis_client(settings)
    try:
        store = TokenStore(client, settings.key_prefix)
        secret, _ = await store.create(f"console-{uuid.uuid4().hex[:6]}", Role.ADMIN, actor="make console")
        return secret
    finally:
        await client.aclose()


async def start_runs(settings: Settings, count: int) -> list[str]:
    """``count`` model-ingest runs: the last fails at render-thumbnail, the one before waits a minute
    in it, the others complete (slowed a little, so they can be seen moving)."""
    world = DemoWorld(sync_client(settings.redis_url, decode_responses=True), settings.key_prefix)
    run_ids = []
    async with Client(settings) as client:
        for i in range(count):
            model_id = f"console-{uuid.uuid4().hex[:6]}"
            if i == count - 1:
                world.set_fault(model_id, "thumbnail.render", fail=True)
            elif i == count - 2:
                world.set_fault(model_id, "thumbnail.render", delay_ms=60_000)
            else:
                world.set_fault(model_id, "thumbnail.render", delay_ms=500 * (i + 1))
            run_ids.append(await client.start("model-ingest", {"modelId": model_id}))
    return run_ids


def check_alive(processes: dict[str, subprocess.Popen[bytes]], port: int) -> None:
    """Stop the script, naming the process and its log, when one of its processes has exited."""
    for name, process in processes.items():
        if process.poll() is not None:
            hint = f" (is port {port} taken? give another with --port)" if name == "server" else ""
            log = LOGS / f"{name}.log"
            sys.exit(f"console: the {name} process exited ({process.returncode}){hint}; see {log}")


def ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def wait_ready(probes: dict[str, str], processes: dict[str, subprocess.Popen[bytes]], port: int) -> None:
    """Until every process's /readyz answers 200 (the orchestrator's and worker's on their metrics
    port: they consume their queues)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    waiting = dict(probes)
    while waiting and time.monotonic() < deadline:
        check_alive(processes, port)
        waiting = {name: url for name, url in waiting.items() if not ready(url)}
        time.sleep(0.3)
    if waiting:
        names = ", ".join(waiting)
        sys.exit(f"console: {names} not ready within {READY_TIMEOUT_S:g} s; see the logs in {LOGS}/")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


Processes = dict[str, subprocess.Popen[bytes]]


def serve(args: argparse.Namespace, settings: Settings, processes: Processes) -> None:
    """Start the processes (into ``processes``, so the caller stops whatever started), wait until they
    are ready, make a token and the runs, print where to go, then wait for Ctrl-C or SIGTERM."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    host = f"[{args.host}]" if ":" in args.host else args.host
    url = f"http://{host}:{args.port}"
    probes = {"server": url}
    for name, command in (("orchestrator", ["orchestrator"]), ("worker", ["worker"])):
        port = free_port()
        processes[name] = spawn(name, [*command, "--metrics-port", str(port)], env)
        probes[name] = f"http://127.0.0.1:{port}"
    processes["server"] = spawn("server", ["server", "--host", args.host, "--port", str(args.port)], env)
    wait_ready(probes, processes, args.port)
    token = asyncio.run(make_token(settings))
    run_ids = asyncio.run(start_runs(settings, args.runs)) if args.runs else []
    logs = os.path.relpath(LOGS)
    print(f"▸ orchestrator, worker pool and server started (logs in {logs}/), {len(run_ids)} runs")
    print(f"\n  console:  {url}/")
    print(f"  token:    {token}")
    print("            (an admin token, shown once: paste it on the sign-in page; SAGA_TOKEN for")
    print(f"             'saga --server {url} ...')")
    print("\n  Ctrl-C stops the server, the orchestrator and the worker pool.", flush=True)
    while True:
        check_alive(processes, args.port)
        time.sleep(0.5)


def stop_all(processes: dict[str, subprocess.Popen[bytes]]) -> None:
    """Stop every process started: SIGTERM, then SIGKILL for one still there after 30 s (or at a second
    Ctrl-C)."""
    for process in processes.values():
        if process.poll() is None:
            process.terminate()
    try:
        for process in processes.values():
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
    except KeyboardInterrupt:
        pass
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1", help="address the server binds [127.0.0.1]")
    parser.add_argument("--port", type=int, default=8080, help="its port [8080]")
    parser.add_argument("--runs", type=int, default=6, help="runs started to look at [6]; 0: none")
    args = parser.parse_args()

    os.environ.setdefault("SAGA_NAMESPACE", DEMO_NAMESPACE)  # the demo's own queues and keys
    settings = Settings()
    registry = Registry.from_modules(settings.contracts)
    check_services(settings)
    prepare(settings, registry)
    signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM stops it as Ctrl-C does
    processes: dict[str, subprocess.Popen[bytes]] = {}
    try:
        serve(args, settings, processes)
    except KeyboardInterrupt:
        pass
    finally:
        stop_all(processes)
        print("▸ stopped", flush=True)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    main()

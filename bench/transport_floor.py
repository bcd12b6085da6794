"""The transport floor: how many model-ingest-shaped runs/s RabbitMQ and aio-pika alone allow here.

    python bench/transport_floor.py [--runs 3000] [--steps 6] [--body-bytes 700]

No engine, no Redis, no signing, no JSON: a relay that moves the same messages a saga run moves. For each
run the client publishes a start to an "orchestrator" queue; the orchestrator process answers every
message on it with a dispatch to a task queue (``--steps`` times, model-ingest has 6 task stages including
its finaliser) and then one completion event; a worker process answers every dispatch with a result on
the orchestrator queue. 2 + 2 * steps messages per run (14 for model-ingest), as saga sends.

It runs that relay twice, with what saga guarantees (quorum queues, publisher confirms, persistent
messages, acks after the confirm on the worker) and with what the peers do (classic queues, no
confirms), and prints runs/s and the CPU each side spent per run. Whatever saga's own code costs comes on
top of the first figure: if it is below a peer's runs/s, that target cannot be met with these guarantees
on this machine, however fast the engine gets. The acks, frame coalescing and prefetch are saga's own
(workers.acks, orchestrator.bus.coalesce), so the floor is measured with the same transport tricks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import aio_pika  # noqa: E402
from aio_pika.abc import AbstractIncomingMessage  # noqa: E402

import orchestrator.bus  # noqa: E402,F401  (installs frame coalescing, as in saga's processes)
from bench.stack import cpu_seconds, service_pids  # noqa: E402
from tests.integration.stack import rabbitmqctl  # noqa: E402
from workers.acks import AckCoalescer  # noqa: E402

ORCH_QUEUE, TASK_QUEUE, DONE_QUEUE, EVENTS = "floor.orch", "floor.tasks", "floor.done", "floor.events"


def _args(queue: str, mode: str) -> dict[str, str]:
    return {"x-queue-type": "quorum"} if mode == "saga" and queue != DONE_QUEUE else {}


async def declare(url: str, mode: str) -> None:
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        for queue in (ORCH_QUEUE, TASK_QUEUE, DONE_QUEUE):
            await channel.declare_queue(queue, durable=True, arguments=_args(queue, mode))
        await channel.declare_exchange(EVENTS, aio_pika.ExchangeType.TOPIC, durable=True)


def _message(body: bytes, mode: str) -> aio_pika.Message:
    persistent = aio_pika.DeliveryMode.PERSISTENT if mode == "saga" else aio_pika.DeliveryMode.NOT_PERSISTENT
    return aio_pika.Message(body, delivery_mode=persistent, message_id=uuid.uuid4().hex)


async def orchestrator_role(url: str, mode: str, steps: int, prefetch: int) -> None:
    """Answers each start or result with the next dispatch, or with the completion event; acks a batch
    once its publishes are issued (saga acks after the Redis commit and waits for confirms meanwhile)."""
    connection = await aio_pika.connect(url)
    channel = await connection.channel(publisher_confirms=mode == "saga")
    await channel.set_qos(prefetch_count=prefetch)
    events = await channel.get_exchange(EVENTS)
    pending: list[AbstractIncomingMessage] = []
    confirms: set[asyncio.Future[object]] = set()

    def flush() -> None:
        last = pending[-1]
        pending.clear()
        _keep(confirms, asyncio.ensure_future(last.ack(multiple=True)))

    def answer(payload: bytes) -> None:
        step = payload[0]
        body = bytes([step + 1]) + payload[1:]
        if step < steps:
            publish = channel.default_exchange.publish(_message(_batch([body]), mode), TASK_QUEUE)
        else:
            event = events.publish(_message(body, mode), "run.completed", mandatory=False)
            _keep(confirms, asyncio.ensure_future(event))
            publish = channel.default_exchange.publish(_message(body, mode), DONE_QUEUE)
        _keep(confirms, asyncio.ensure_future(publish))

    async def on_message(message: AbstractIncomingMessage) -> None:
        for payload in _unbatch(message.body):
            answer(payload)
        if not pending:
            asyncio.get_running_loop().call_soon(flush)
        pending.append(message)

    await (await channel.get_queue(ORCH_QUEUE)).consume(on_message)
    await asyncio.Future()


def _batch(payloads: list[bytes]) -> bytes:
    return b"".join(len(p).to_bytes(4, "big") + p for p in payloads)


def _unbatch(body: bytes) -> list[bytes]:
    payloads, at = [], 0
    while at < len(body):
        size = int.from_bytes(body[at : at + 4], "big")
        payloads.append(body[at + 4 : at + 4 + size])
        at += 4 + size
    return payloads


async def worker_role(url: str, mode: str, concurrency: int, batch_results: bool) -> None:
    """Answers each dispatch with a result; acks only once the result is confirmed (as saga's worker).
    With ``batch_results`` the results of one event-loop turn travel in one message."""
    connection = await aio_pika.connect(url)
    channel = await connection.channel(publisher_confirms=mode == "saga")
    await channel.set_qos(prefetch_count=concurrency)
    acks = AckCoalescer()
    tasks: set[asyncio.Future[object]] = set()
    turn: list[AbstractIncomingMessage] = []

    async def answer(messages: list[AbstractIncomingMessage]) -> None:
        body = b"".join(m.body for m in messages)  # each is one framed payload
        await channel.default_exchange.publish(_message(body, mode), ORCH_QUEUE)
        for message in messages:
            acks.settled(message)

    def flush() -> None:
        _keep(tasks, asyncio.ensure_future(answer(turn[:])))
        turn.clear()

    async def on_message(message: AbstractIncomingMessage) -> None:
        acks.delivered(message)
        if not batch_results:
            _keep(tasks, asyncio.ensure_future(answer([message])))
            return
        if not turn:
            asyncio.get_running_loop().call_soon(flush)
        turn.append(message)

    await (await channel.get_queue(TASK_QUEUE)).consume(on_message)
    await asyncio.Future()


def _keep(tasks: set[asyncio.Future[object]], task: asyncio.Future[object]) -> None:
    tasks.add(task)
    task.add_done_callback(tasks.discard)


async def drive(url: str, mode: str, runs: int, body_bytes: int, in_flight: int) -> float:
    """Start ``runs`` runs (``in_flight`` start publishes outstanding) and wait until all are done."""
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel(publisher_confirms=mode == "saga")
        done_queue = await channel.get_queue(DONE_QUEUE)
        finished = asyncio.Event()
        count = 0

        async def on_done(message: AbstractIncomingMessage) -> None:
            nonlocal count
            count += 1
            if count == runs:
                finished.set()

        await done_queue.consume(on_done, no_ack=True)
        padding = b"x" * max(0, body_bytes - 1)
        limit = asyncio.Semaphore(in_flight)

        async def start() -> None:
            async with limit:
                await channel.default_exchange.publish(
                    _message(_batch([b"\x00" + padding]), mode), ORCH_QUEUE
                )

        began = time.perf_counter()
        await asyncio.gather(*(start() for _ in range(runs)))
        await finished.wait()
        return time.perf_counter() - began


def measure(mode: str, args: argparse.Namespace) -> dict[str, object]:
    vhost = f"saga-floor-{uuid.uuid4().hex[:8]}"
    rabbitmqctl("add_vhost", vhost)
    rabbitmqctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
    url = f"amqp://guest:guest@127.0.0.1:5672/{vhost}"
    roles: list[subprocess.Popen[bytes]] = []
    try:
        asyncio.run(declare(url, mode))
        for role in ("orchestrator", "worker"):
            command = [sys.executable, __file__, "--role", role, "--url", url, "--mode", mode]
            roles.append(subprocess.Popen([*command, *_role_options(args)]))
        time.sleep(1.5)  # both consuming
        services = service_pids()
        before = [cpu_seconds(p.pid) for p in roles], _service_cpu(services), time.process_time()
        seconds = asyncio.run(drive(url, mode, args.runs, args.body_bytes, args.in_flight))
        after = [cpu_seconds(p.pid) for p in roles], _service_cpu(services), time.process_time()
    finally:
        for process in roles:
            process.kill()
            process.wait()
        rabbitmqctl("delete_vhost", vhost)
    per_run = {
        "orchestrator": after[0][0] - before[0][0],
        "worker": after[0][1] - before[0][1],
        "rabbitmq": after[1] - before[1],
        "client": after[2] - before[2],
    }
    return {
        "peer": "transport-floor",
        "figure": f"relay runs/s ({mode})",
        "value": round(args.runs / seconds, 2),
        "unit": "runs/s",
        "runs": args.runs,
        "messages_per_run": 2 + 2 * args.steps,
        "cpu_ms_per_run": {k: round(v * 1000 / args.runs, 3) for k, v in per_run.items()},
    }


def _service_cpu(services: dict[str, list[int]]) -> float:
    return sum(cpu_seconds(pid) for pid in services.get("rabbitmq", []))


def _role_options(args: argparse.Namespace) -> list[str]:
    options = [
        "--steps",
        str(args.steps),
        "--prefetch",
        str(args.prefetch),
        "--concurrency",
        str(args.concurrency),
    ]
    return [*options, "--batch-results"] if args.batch_results else options


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3000)
    parser.add_argument("--steps", type=int, default=6, help="task stages per run (model-ingest: 6)")
    parser.add_argument("--body-bytes", type=int, default=700, help="about a saga envelope's size")
    parser.add_argument("--in-flight", type=int, default=64, help="start publishes outstanding")
    parser.add_argument("--prefetch", type=int, default=64, help="orchestrator prefetch (saga's default)")
    parser.add_argument("--concurrency", type=int, default=16, help="worker prefetch (the bench's)")
    parser.add_argument("--modes", default="saga,peer")
    parser.add_argument(
        "--batch-results", action="store_true", help="a worker sends one turn's results in one message"
    )
    parser.add_argument("--role", choices=["orchestrator", "worker"], help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "orchestrator":
        asyncio.run(orchestrator_role(args.url, args.mode, args.steps, args.prefetch))
    elif args.role == "worker":
        asyncio.run(worker_role(args.url, args.mode, args.concurrency, args.batch_results))
    else:
        for mode in args.modes.split(","):
            print(json.dumps(measure(mode, args)), flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()

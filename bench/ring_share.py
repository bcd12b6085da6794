"""How RabbitMQ's consistent-hash exchange splits new starts among a class's shards, as the shard map
changes: the share each shard queue gets of starts routed by run id, measured on the live broker.

    python bench/ring_share.py [--starts 20000] [--steps 4,8,5]

For each step N, the exchange has N shard queues bound with weight 1 (what ``saga shards add`` and
``drain`` leave), and ``--starts`` messages with fresh run ids (uuid4 hex, as the client makes them) are
published through it. Prints one JSON line per step: every queue's share, the smallest and largest, and
for a step that adds shards, the share the added ones took. In its own vhost, deleted after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import aio_pika  # noqa: E402

from tests.integration.stack import rabbitmqctl  # noqa: E402

EXCHANGE = "ring.start"


async def measure(url: str, steps: list[int], starts: int) -> None:
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        exchange = await channel.declare_exchange(EXCHANGE, "x-consistent-hash", durable=False)
        bound: list[str] = []
        numbers = iter(range(10_000))  # shards are added with numbers never used before
        for count in steps:
            before = set(bound)
            while len(bound) < count:
                name = f"ring.shard.{next(numbers)}"
                queue = await channel.declare_queue(name, durable=False, auto_delete=False)
                await queue.bind(exchange, routing_key="1")
                bound.append(name)
            while len(bound) > count:  # drained shards are unbound, oldest numbers first
                gone = bound.pop(0)
                await (await channel.get_queue(gone)).unbind(exchange, routing_key="1")
            for name in bound:
                await (await channel.get_queue(name)).purge()
            for _ in range(starts):
                await exchange.publish(aio_pika.Message(b"x"), routing_key=uuid.uuid4().hex)
            counts = {}
            for name in bound:
                declared = await channel.declare_queue(name, durable=False, passive=True)
                counts[name] = declared.declaration_result.message_count
            total = sum(counts.values())
            shares = {name: round(n / total, 4) for name, n in counts.items()}
            added = [name for name in bound if name not in before]
            print(
                json.dumps(
                    {
                        "shards": count,
                        "starts": total,
                        "even_share": round(1 / count, 4),
                        "min_share": min(shares.values()),
                        "max_share": max(shares.values()),
                        "added_share": round(sum(shares[n] for n in added), 4) if before else None,
                        "shares": shares,
                    }
                ),
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--starts", type=int, default=20_000)
    parser.add_argument("--steps", default="4,8,5")
    args = parser.parse_args()
    vhost = f"saga-bench-ring-{uuid.uuid4().hex[:8]}"
    rabbitmqctl("add_vhost", vhost)
    rabbitmqctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
    try:
        asyncio.run(
            measure(
                f"amqp://guest:guest@127.0.0.1:5672/{vhost}",
                [int(s) for s in args.steps.split(",")],
                args.starts,
            )
        )
    finally:
        rabbitmqctl("delete_vhost", vhost)


if __name__ == "__main__":
    main()

"""The shard's processor alone, without the broker: CPU per message of model-ingest runs.

Starts ``--runs`` runs and answers every task they send, each answer as a worker would report it, in
batches of ``--batch`` (a shard's prefetch), against the local Redis under its own key prefix; only the
processor's calls are timed (decode, the reports' signing and the outbox reads are not), with the
garbage collector paced as in the orchestrator process (``orchestrator/gc_tuning.py``). It isolates what
the engine, the processor and redis-py cost per message from the transport, so a change to them can be
measured without the noise of a whole bench. Prints one JSON line per repeat, then the best.

With ``--idle-ms`` and ``--sweep-mb``, each batch comes after that much sleep and after that much memory
written (outside the timed call), as a single run's messages come to a live orchestrator: after a wait,
with the broker, Redis and the worker run in between. Run with ``--batch 1`` and without, the two say how
much of a message's processing is the caches it finds cold (``bench/engine.py`` does the same for the
engine alone).

    .venv/bin/python bench/processor.py --runs 1000 --repeat 3
    .venv/bin/python bench/processor.py --runs 200 --batch 1 --repeat 1 --idle-ms 2 --sweep-mb 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.cold import before_each
from orchestrator import gc_tuning
from orchestrator.bus.envelope import Envelope
from orchestrator.bus.publisher import envelope_for, outgoing_from_payload
from orchestrator.client import start_envelope
from orchestrator.shard.processor import Processor
from orchestrator.store.connect import async_client
from orchestrator.store.redis_store import RedisStore
from tests.integration.stack import publish_active
from tests.integration.test_nudge_race import REDIS_URL, SHARD, SIGNER, report
from tests.unit.test_engine import compiled


async def one_sitting(runs: int, batch: int, prepare: Callable[[], None]) -> dict[str, float]:
    client = async_client(REDIS_URL, decode_responses=True)  # as the orchestrator connects
    store = RedisStore(client, prefix=f"sagabenchproc{uuid.uuid4().hex[:8]}", direct=True)
    processor = Processor(store, lambda: int(time.time() * 1000))
    cpu = wall = 0.0
    handled = 0

    async def handle(envelopes: list[Envelope]) -> None:
        nonlocal cpu, wall, handled
        for i in range(0, len(envelopes), batch):
            prepare()
            cpu0, wall0 = time.process_time(), time.perf_counter()
            await processor.handle_batch(SHARD, envelopes[i : i + batch])
            cpu += time.process_time() - cpu0
            wall += time.perf_counter() - wall0
        handled += len(envelopes)

    try:
        await store.load_library()
        plan = compiled("model-ingest")
        await publish_active(store, plan)
        ids = [f"bench-{uuid.uuid4().hex[:10]}" for _ in range(runs)]
        await handle([start_envelope(SIGNER, r, "model-ingest", plan.digest, {"modelId": r}) for r in ids])
        while entries := [outgoing_from_payload(p) for p in (await store.outbox(SHARD)).values()]:
            await store.mark_sent(SHARD, [m.message_id for m in entries])
            answers = [report(m) if m.kind == "task" else envelope_for(m, SIGNER, 0) for m in entries]
            await handle([a for a, m in zip(answers, entries, strict=True) if m.kind != "run.finished"])
        done = sum([await client.hget(store.keys(SHARD).run(r), "status") == "completed" for r in ids])
        return {
            "messages": handled,
            "completed": done,
            "cpu_ms_per_message": round(1000 * cpu / handled, 4),
            "wall_ms_per_message": round(1000 * wall / handled, 4),
        }
    finally:
        keys = [k async for k in client.scan_iter(match=f"{store.prefix}:*")]
        for i in range(0, len(keys), 500):
            await client.delete(*keys[i : i + 500])
        await client.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--idle-ms", type=float, default=0.0, help="sleep before each batch")
    parser.add_argument("--sweep-mb", type=int, default=0, help="memory written before each batch")
    args = parser.parse_args()
    prepare = before_each(args.idle_ms, args.sweep_mb)
    gc_tuning.tune()  # the collector's pace of the orchestrator process
    sittings = []
    for _ in range(args.repeat):
        figures = asyncio.run(one_sitting(args.runs, args.batch, prepare))
        sittings.append(figures)
        print(json.dumps({"peer": "saga", "figure": "processor per message", **figures}), flush=True)
    best = min(sittings, key=lambda f: f["cpu_ms_per_message"])
    conditions = {"batch": args.batch, "idle_ms": args.idle_ms, "sweep_mb": args.sweep_mb}
    print(
        json.dumps(
            {
                "peer": "saga",
                "figure": "processor per message (best)",
                "runs": args.runs,
                **conditions,
                **best,
            }
        )
    )


if __name__ == "__main__":
    main()

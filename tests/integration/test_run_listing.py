"""Listing runs by state and definition reads the index of exactly those runs, kept by the transitions:
with 10,000 other runs on the shard, a filtered page reads no more than the page (and pages stably)."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import redis.asyncio as aioredis

from orchestrator.bus.envelope import Signer
from orchestrator.client import start_envelope
from orchestrator.observe import RunFilter, list_runs
from orchestrator.settings import DEVELOPMENT_SIGNING_KEY, Settings
from orchestrator.shard.processor import Processor
from orchestrator.store.keys import ShardKeys
from orchestrator.store.redis_store import RedisStore
from tests.conftest import DEFINITIONS, compile_yaml
from tests.integration.stack import publish_active

pytestmark = pytest.mark.services

REDIS_URL = "redis://127.0.0.1:6379/0"
SHARD = "fast.0"
SIGNER = Signer.from_settings((DEVELOPMENT_SIGNING_KEY,))
OTHERS = 10_000
WANTED = 60


def test_a_filtered_page_reads_the_index_of_its_runs_not_every_run() -> None:
    prefix = f"t{uuid.uuid4().hex}"

    async def main() -> None:
        client = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
        store = RedisStore(client, prefix=prefix)
        processor = Processor(store, lambda: int(time.time() * 1000))
        ingest = compile_yaml((DEFINITIONS / "model-ingest.yaml").read_text())
        batch = compile_yaml((DEFINITIONS / "thumbnail-batch.yaml").read_text())
        try:
            await store.load_library()
            await publish_active(store, ingest)
            await publish_active(store, batch)
            # Given 10,000 running model-ingest runs, and 60 thumbnail-batch runs that failed
            for first in range(0, OTHERS, 500):
                starts = [
                    start_envelope(SIGNER, f"other-{i}", "model-ingest", ingest.digest, {"modelId": f"m-{i}"})
                    for i in range(first, first + 500)
                ]
                await processor.handle_batch(SHARD, starts)
            wanted = [f"wanted-{i:03d}" for i in range(WANTED)]
            starts = [
                start_envelope(SIGNER, run, "thumbnail-batch", batch.digest, {"modelIds": ["a"]})
                for run in wanted
            ]
            await processor.handle_batch(SHARD, starts)
            for run in wanted:
                assert await store.poison(SHARD, run, f"poison-{run}", "test", int(time.time() * 1000)) == 0
            keys = ShardKeys(prefix, SHARD)
            # Then the index of failed thumbnail-batch runs holds exactly those, and the running ones moved
            assert await client.zcard(keys.facet("def", "thumbnail-batch", "state", "failed")) == WANTED
            assert await client.zcard(keys.facet("def", "thumbnail-batch", "state", "running")) == 0
            assert await client.zcard(keys.facet("state", "running")) == OTHERS
            # and a listing pages through them, 25 at a time, each page reading only its own runs
            settings = Settings(redis_url=REDIS_URL, key_prefix=prefix)
            seen: list[str] = []
            after = None
            timings = []
            while True:
                began = time.perf_counter()
                page = await list_runs(
                    settings, RunFilter(state="failed", definition="thumbnail-batch", limit=25, after=after)
                )
                timings.append(time.perf_counter() - began)
                seen += [row["run_id"] for row in page]
                assert all(
                    row["state"] == "failed" and row["definition"] == "thumbnail-batch" for row in page
                )
                if len(page) < 25:
                    break
                after = (page[-1]["created_at"], page[-1]["run_id"])
            assert sorted(seen) == wanted and len(seen) == len(set(seen))
            # (the figure, printed for the notes: a page's time does not grow with the 10,000 others)
            print(f"filtered pages over {OTHERS + WANTED} runs: {[round(t * 1000, 1) for t in timings]} ms")
        finally:
            keys_left = [k async for k in client.scan_iter(match=f"{prefix}:*", count=1000)]
            for i in range(0, len(keys_left), 500):
                await client.delete(*keys_left[i : i + 500])
            await client.aclose()

    asyncio.run(main())

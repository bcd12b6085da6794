"""The orchestrator and a worker on a Redis Cluster (``SAGA_REDIS_URL=redis+cluster://...``): the main
runs end to end, the fault suite's invariants hold over them, and a primary that lost the Functions
library (a new primary, simulated with FUNCTION FLUSH) gets it back from the first FCALL that misses it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import pytest
import redis

from orchestrator.client import DefinitionNotFound, SyncClient
from orchestrator.store.connect import async_client, is_cluster
from orchestrator.store.keys import ShardKeys, index_key
from orchestrator.store.redis_store import LIBRARY_NAME, RedisStore
from tests.cluster.cluster import LocalCluster
from tests.faults import invariants
from tests.integration.stack import Stack, poll

pytestmark = pytest.mark.services

STARTED: list[str] = []  # every run of the module, for the invariants at the end


@pytest.fixture(scope="module")
def stack(cluster: LocalCluster) -> Iterator[Stack]:
    s = Stack("cluster", redis_url=cluster.url)
    s.setup()
    try:
        s.start_orchestrator()
        s.start_worker()
        yield s
    finally:
        s.teardown()


@pytest.fixture(scope="module")
def client(stack: Stack) -> Iterator[SyncClient]:
    with SyncClient(stack.settings) as c:
        assert is_cluster(c.redis)
        yield c


def owner_of(cluster: LocalCluster, key: str) -> redis.Redis:
    """A plain client of the primary that owns ``key``'s slot."""
    with cluster.client() as rc:
        port = rc.get_node_from_key(key).port
    return cluster.node(int(port))


def has_library(node: redis.Redis) -> bool:
    return bool(node.function_list(library=LIBRARY_NAME))


def test_model_ingest_cache_miss_and_hit_complete(stack: Stack, client: SyncClient) -> None:
    # Given an orchestrator and a worker on a Redis Cluster
    # When a model the cache does not hold and one it holds are ingested
    miss = client.start("model-ingest", {"modelId": "miss-1"})
    hit = client.start("model-ingest", {"modelId": "cached-7"})
    STARTED.extend([miss, hit])
    # Then the miss renders, forks and joins; the hit skips all that
    missed = client.wait(miss, timeout_s=30)
    assert missed.state == "completed", missed
    assert missed.output == {"modelId": "miss-1", "catalogueId": "cat-miss-1"}
    assert client.status(miss)["stages"]["render-thumbnail"] == {"state": "completed", "attempt": 1}
    assert [e["kind"] for e in stack.history(miss)].count("join.released") == 1
    got = client.wait(hit, timeout_s=30)
    assert got.state == "completed", got
    assert got.output == {"modelId": "cached-7", "catalogueId": "cat-cached-7"}
    stages = client.status(hit)["stages"]
    assert "render-thumbnail" not in stages and stages["publish"]["state"] == "completed"


def test_a_bag_of_200_items_joins_once_in_order(stack: Stack, client: SyncClient) -> None:
    ids = [f"item-{i:03d}" for i in range(200)]
    run_id = client.start("thumbnail-batch", {"modelIds": ids})
    STARTED.append(run_id)
    result = client.wait(run_id, timeout_s=60)
    assert result.state == "completed", result
    assert result.output["count"] == 200
    assert result.output["thumbnails"] == [{"thumbnailUri": f"thumbs/{i}.png"} for i in ids]
    assert [e["kind"] for e in stack.history(run_id)].count("stage.completed") == 1


def test_a_primary_without_the_library_gets_it_back(
    cluster: LocalCluster, stack: Stack, client: SyncClient
) -> None:
    # Given the primary that holds shard fast.0 lost every function (as a new primary would have none)
    node = owner_of(cluster, ShardKeys(stack.prefix, "fast.0").outbox())
    assert has_library(node)
    node.function_flush("SYNC")
    assert not has_library(node)
    # When runs are started until one lands on that shard
    landed = []
    for i in range(64):
        run_id = client.start("model-ingest", {"modelId": f"reload-{i}"})
        STARTED.append(run_id)
        if poll(lambda r=run_id: stack.shard_of(r), 10, what="the run's shard") == "fast.0":
            landed.append(run_id)
            break
    assert landed, "no run landed on shard fast.0"
    # Then its transitions reloaded the library there and the runs complete
    for run_id in STARTED[-(i + 1) :]:
        assert client.wait(run_id, timeout_s=30).state == "completed"
    assert has_library(node)


def test_the_store_reloads_a_flushed_library_and_retries_once(cluster: LocalCluster, stack: Stack) -> None:
    # Given a store on the cluster, and the primary of shard slow.1's slot without functions
    outbox = ShardKeys(stack.prefix, "slow.1").outbox()
    node = owner_of(cluster, outbox)
    node.function_flush("SYNC")

    async def mark() -> int:
        client = async_client(cluster.url, decode_responses=True)
        try:
            store = RedisStore(client, stack.prefix)
            await client.hset(outbox, "m-1", "{}")  # type: ignore[misc]
            return await store.mark_sent("slow.1", ["m-1"])
        finally:
            await client.aclose()

    # When a function of the library is called there
    # Then it is loaded again and the call succeeds
    assert asyncio.run(mark()) == 1
    assert has_library(node)


def test_cli_listing_reconcile_and_suggestions_read_every_primary(stack: Stack, client: SyncClient) -> None:
    # Given runs done, and run-id claims without a run spread over the slots of every primary
    orphans = [f"orphan-{i}" for i in range(12)]
    for orphan in orphans:
        stack.redis.set(index_key(stack.prefix, orphan), "fast.0")
    # When the runs are listed, claims reconciled (a SCAN) and a misspelt definition started (a SCAN)
    listed = {r["run_id"] for r in stack.saga_json("runs", "--limit", "1000")["runs"]}
    done = stack.saga("reconcile", "--json", "--dry-run", "--min-age-s", "0")
    with pytest.raises(DefinitionNotFound) as refused:
        client.start("model-ingets", {"modelId": "m"})
    # Then every run, every orphan claim and the published definition are found
    assert set(STARTED) <= listed
    assert done.returncode == 0, done.stderr
    assert sorted(json.loads(done.stdout)["orphan_claims"]) == sorted(orphans)
    assert refused.value.did_you_mean == "model-ingest"
    for orphan in orphans:
        stack.redis.delete(index_key(stack.prefix, orphan))


def test_the_fault_suites_invariants_hold_over_every_run(stack: Stack) -> None:
    # The checks read a cluster through the same calls (every key of one call in one slot; SCAN on
    # every primary)
    assert is_cluster(stack.redis)
    left = invariants.wait_for_convergence(stack.redis, stack.prefix, STARTED, timeout_s=30)
    assert left == []
    invariants.assert_no_violations(
        invariants.check_runs(stack.redis, stack.prefix, STARTED, all_runs=True), "the invariants"
    )
    assert invariants.dead_letters(stack.queue_depths()) == []

"""The orchestrator's asyncio Redis Cluster client (``orchestrator/store/connect.py``) on a slot being
migrated: it follows ASK also when it holds many connections to the importing node (redis-py's own client
then sends ASKING on one connection and the command on another, and fails with "TTL exhausted"), and a
TRYAGAIN that lasts past redis-py's redirection budget reaches the caller as ``TryAgainError`` (what the
shard service treats as "the cluster is resharding: wait"), not as a ``ClusterError``; and a new client's
first commands, many at once, go to their keys' nodes rather than to random ones."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis.exceptions import TryAgainError

from orchestrator.store.connect import async_client
from tests.cluster.cluster import LocalCluster, key_slot

pytestmark = pytest.mark.services

TAG = "{saga-ask-test}"


def key_served_by(cluster: LocalCluster, port: int) -> str:
    """A key (of another slot than ``TAG``'s) that primary ``port`` serves."""
    nodes = [n for n in cluster.nodes() if n.port == port]
    return next(k for i in range(10_000) if nodes[0].serves(key_slot(k := f"{{other-{i}}}:k")))


async def exercise(cluster: LocalCluster, target: int) -> dict[str, Any]:
    client = async_client(cluster.url, decode_responses=True)
    try:
        # a busy client: several connections open to the importing node (each held for a moment by a
        # blocking pop on a key of that node's own slots), free again when the slot is asked for
        other = key_served_by(cluster, target)
        await asyncio.gather(*(client.blpop([other], timeout=0.1) for _ in range(8)))  # type: ignore[misc]
        found: dict[str, Any] = {
            "absent": await client.get(f"{TAG}:absent"),  # ASK, then read on the target
            "created": await client.set(f"{TAG}:created", "v"),  # ASK, then created on the target
            "read back": await client.get(f"{TAG}:created"),  # ASK again
        }
        try:  # one key on each side: TRYAGAIN, as every multi-key call (an FCALL) gets
            found["split"] = await client.exists(f"{TAG}:present", f"{TAG}:created")
        except TryAgainError:
            found["split"] = "TRYAGAIN"
        return found
    finally:
        await client.aclose()


def test_the_client_follows_ask_and_reports_a_lasting_tryagain_as_such(cluster: LocalCluster) -> None:
    # Given a key of a slot on its primary, and the slot migrating to another primary
    slot = key_slot(f"{TAG}:x")
    source = cluster.primary_of_slot(slot)
    target = next(p for p in cluster.primary_ports() if p != source)
    with cluster.client() as rc:
        rc.set(f"{TAG}:present", "1")
    found: dict[str, Any] = {}
    # When the orchestrator's client reads and writes keys of that slot while it migrates
    moved = cluster.migrate_slot(
        slot, target, opened=lambda: found.update(asyncio.run(exercise(cluster, target)))
    )
    # Then redirections were followed, and the split multi-key call said TRYAGAIN
    assert found == {"absent": None, "created": True, "read back": "v", "split": "TRYAGAIN"}
    assert moved == 1  # "created" was made on the target itself
    with cluster.client() as rc:
        assert rc.mget_nonatomic([f"{TAG}:present", f"{TAG}:created"]) == ["1", "v"]
        rc.delete(f"{TAG}:present", f"{TAG}:created")


def test_a_new_clients_first_commands_go_to_their_keys_nodes(cluster: LocalCluster) -> None:
    async def first_commands() -> tuple[list[Any], int]:
        # reinitialize_steps=0: every MOVED is counted (by default the count restarts at every fifth)
        client = async_client(cluster.url, decode_responses=True, reinitialize_steps=0)
        try:
            keys = [f"{{first-{i}}}:k" for i in range(24)]  # slots of every primary
            found = await asyncio.gather(*(client.get(k) for k in keys))
            return found, client.reinitialize_counter  # type: ignore[attr-defined]
        finally:
            await client.aclose()

    # When a new client's first commands go out together, before it knows the cluster's slots
    found, redirected = asyncio.run(first_commands())
    # Then each went to its key's node: no MOVED (every fifth would have closed every connection of the
    # client, the others' handshakes with them), and every command was answered
    assert redirected == 0
    assert found == [None] * 24

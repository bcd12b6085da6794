"""Runs not yet finished, per plan digest: the sum of every shard's live-runs hash, which the transitions
keep (``lua/helpers.lua``, ``count_live``). A definition version's count shows its runs draining to 0."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from orchestrator.store.keys import TENANT_FIELD_PREFIX, ShardKeys


async def unfinished_by_digest(client: Any, prefix: str, shards: Iterable[str]) -> dict[str, int]:
    """Plan digest -> unfinished runs over ``shards`` (every shard of the map, retired ones included:
    their runs may still be finishing). One pipelined HGETALL per shard."""
    names = list(shards)
    if not names:
        return {}
    async with client.pipeline(transaction=False) as pipe:
        for shard in names:
            pipe.hgetall(ShardKeys(prefix, shard).live())
        counts = await pipe.execute()
    total: dict[str, int] = {}
    for per_shard in counts:
        for digest, n in per_shard.items():
            key = digest.decode() if isinstance(digest, bytes) else str(digest)
            if key.startswith(TENANT_FIELD_PREFIX):
                continue  # a tenant's count, kept in the same hash
            total[key] = total.get(key, 0) + max(0, int(n))
    return {digest: n for digest, n in total.items() if n > 0}

"""What ``saga shards`` does on the live services: read a shard's load, and add, drain and retire shards.

Every change goes through the shard map's version check first (two operators cannot both change the
map from the same reading), then to the broker: the map is what orchestrators follow, and a shard the
broker has but the map does not serve would take starts nobody processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import asdict, dataclass
from typing import Any

import aio_pika
import aiormq
import redis.asyncio as aioredis

from orchestrator.bus.connect import connect_once
from orchestrator.bus.names import Names, dead_letter_queue
from orchestrator.bus.topology import HASH_WEIGHT, apply_topology, build_topology
from orchestrator.engine.model import TERMINAL_RUN_STATUSES
from orchestrator.errors import SagaError
from orchestrator.settings import Settings, redis_client
from orchestrator.shardmap import ShardEntry, ShardMap, ShardState, owners
from orchestrator.store import membership, shardmap_store
from orchestrator.store.keys import ShardKeys

#: How long ``retire`` waits for orchestrators to leave a retired shard (they read the map every 2 s).
LEAVE_WAIT_S = 30.0


class RetireRefused(SagaError):
    """A shard that still holds work (or is not draining) cannot be retired; says what it holds."""

    code = "retire_refused"
    id_fields = ("shard",)

    def __init__(self, shard: str, why: str, *, changed: bool = False) -> None:
        self.shard = shard
        outcome = (
            "it is retired in the map; run the command again to finish" if changed else "nothing was changed"
        )
        super().__init__(f"shard {shard} cannot be retired: {why}; {outcome}")


class NoShardMap(SagaError):
    """A change asked of a namespace whose shard map was never stored (its topology never applied)."""

    code = "shard_map_missing"
    id_fields = ("namespace",)

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        super().__init__(
            f"namespace {namespace!r} has no shard map yet: run 'saga topology apply' first (it stores the "
            "map SAGA_SHARD_CLASSES and SAGA_SHARD_COUNT describe); nothing was changed"
        )


@dataclass(frozen=True)
class ShardLoad:
    """One shard as ``saga shards list`` shows it."""

    shard: str
    shard_class: str
    number: int
    state: str
    queued: int | None  # ready messages on its queue (None: no queue, or the broker not reached)
    consumers: int | None
    unfinished_runs: int
    outbox: int
    timers: int
    dead_letters: int | None
    serving: str | None  # the member process whose share it is (None: pinned with --shards, or none)

    def document(self) -> dict[str, Any]:
        return asdict(self)


async def _queue_counts(channel: aio_pika.abc.AbstractChannel, name: str) -> tuple[int, int] | None:
    """(ready messages, consumers) of queue ``name``, or None if it does not exist."""
    try:
        declared = await channel.declare_queue(name, passive=True)
    except aiormq.exceptions.ChannelNotFoundEntity:
        return None
    result = declared.declaration_result
    return result.message_count or 0, result.consumer_count or 0


async def _work_held(client: aioredis.Redis, prefix: str, shard: str) -> tuple[int, int, int]:
    """(unfinished runs, outbox entries, timers) the shard holds in Redis."""
    keys = ShardKeys(prefix, shard)
    run_ids = await client.zrange(keys.runs(), 0, -1)
    async with client.pipeline(transaction=False) as pipe:
        for run_id in run_ids:
            pipe.hget(keys.run(run_id), "status")
        statuses = await pipe.execute()
    terminal = {s.value for s in TERMINAL_RUN_STATUSES}
    unfinished = sum(1 for status in statuses if status is not None and status not in terminal)
    outbox = await client.hlen(keys.outbox())  # type: ignore[misc]
    return unfinished, int(outbox), int(await client.zcard(keys.timers()))


async def shard_loads(settings: Settings) -> tuple[ShardMap, list[ShardLoad]]:
    names = settings.names()
    client = redis_client(settings)
    try:
        shard_map = await shardmap_store.current_map(settings, seed=False)
        owners = await _owners(client, settings.key_prefix, shard_map)
        connection = await connect_once(settings.amqp_url)
        try:
            loads = [
                await _load(connection, client, settings.key_prefix, names, e, owners.get(e.id))
                for e in shard_map.shards
            ]
        finally:
            await connection.close()
        return shard_map, loads
    finally:
        await client.aclose()


async def _load(
    connection: aio_pika.abc.AbstractConnection,
    client: aioredis.Redis,
    prefix: str,
    names: Names,
    entry: ShardEntry,
    owner: str | None,
) -> ShardLoad:
    unfinished, outbox, timers = await _work_held(client, prefix, entry.id)
    queue = names.shard_queue(entry.id)
    channel = await connection.channel()  # a passive declare of a missing queue closes its channel
    counts = await _queue_counts(channel, queue)
    channel = channel if not channel.is_closed else await connection.channel()
    dead = await _queue_counts(channel, dead_letter_queue(queue))
    with contextlib.suppress(Exception):
        await channel.close()
    return ShardLoad(
        entry.id,
        entry.shard_class,
        entry.number,
        entry.state.value,
        counts[0] if counts else None,
        counts[1] if counts else None,
        unfinished,
        outbox,
        timers,
        dead[0] if dead else None,
        owner,
    )


async def _owners(client: aioredis.Redis, prefix: str, shard_map: ShardMap) -> dict[str, str]:
    """Served shard -> the member process whose share it is, as the members divide them now."""
    live = {c: await membership.members(client, prefix, c) for c in shard_map.classes}
    return owners(shard_map, live)


async def _change(settings: Settings, change: Any) -> tuple[ShardMap, ShardMap]:
    """Apply ``change`` (old map -> new map) to the stored map, over its version; (old, new)."""
    client = redis_client(settings)
    try:
        old = await shardmap_store.load(client, settings.key_prefix)
        if old is None:  # seeding here, from this shell's settings, could disown shards the processes serve
            raise NoShardMap(settings.namespace)
        new = change(old)
        await shardmap_store.save(client, settings.key_prefix, new)
        return old, new
    finally:
        await client.aclose()


async def add(settings: Settings, shard_class: str, count: int) -> list[str]:
    """Add ``count`` active shards to ``shard_class``; declare and bind their queues. Returns their ids."""
    old, new = await _change(settings, lambda m: m.with_added(shard_class, count))
    added = [e for e in new.shards if e.id not in old.known]
    connection = await connect_once(settings.amqp_url)
    try:
        topology = build_topology(
            settings.names(),
            ShardMap(new.version, tuple(added)),
            [],
            settings.delivery_limit,
            settings.quorum_group_size,
        )
        await apply_topology(await connection.channel(), topology)
    finally:
        await connection.close()
    return [e.id for e in added]


async def drain(settings: Settings, shard: str) -> None:
    """No new starts for ``shard`` (its start binding removed); its runs are still served."""
    _, new = await _change(settings, lambda m: m.with_state(shard, ShardState.DRAINING))
    names = settings.names()
    connection = await connect_once(settings.amqp_url)
    try:
        channel = await connection.channel()
        queue = await channel.get_queue(names.shard_queue(shard), ensure=False)
        await queue.unbind(names.start_exchange(new.entry(shard).shard_class), HASH_WEIGHT)
    finally:
        await connection.close()


async def retire(settings: Settings, shard: str, leave_wait_s: float = LEAVE_WAIT_S) -> None:
    """Retire a draining shard that holds nothing; delete its queues once no orchestrator serves it."""
    names = settings.names()
    queue = names.shard_queue(shard)
    client = redis_client(settings)
    try:
        shard_map = await shardmap_store.current_map(settings, seed=False)
        entry = shard_map.entry(shard)
        if entry.state is ShardState.ACTIVE:
            raise RetireRefused(shard, f"it is active: drain it first ('saga shards drain {shard}')")
        unfinished, outbox, timers = await _work_held(client, settings.key_prefix, shard)
    finally:
        await client.aclose()
    held = [
        f"{n} {what}"
        for n, what in (
            (unfinished, "unfinished run(s)"),
            (outbox, "unsent outbox entries"),
            (timers, "timer(s)"),
        )
        if n
    ]
    connection = await connect_once(settings.amqp_url)
    try:
        counts = await _queue_counts(await connection.channel(), queue)
        dead = await _queue_counts(await connection.channel(), dead_letter_queue(queue))
        if counts and counts[0]:
            held.append(f"{counts[0]} message(s) on {queue}")
        if dead and dead[0]:
            held.append(f"{dead[0]} dead letter(s) on {dead_letter_queue(queue)} (replay or purge them)")
        if held:  # checked again on a second run too: nothing is deleted while it holds anything
            raise RetireRefused(
                shard, "it still holds " + ", ".join(held), changed=entry.state is ShardState.RETIRED
            )
        # no new starts whatever a drain left behind (a drain whose unbind failed after it saved the map)
        channel = await connection.channel()
        unbound = await channel.get_queue(queue, ensure=False) if counts is not None else None
        if unbound is not None:
            await unbound.unbind(names.start_exchange(entry.shard_class), HASH_WEIGHT)
        if entry.state is ShardState.DRAINING:
            await _change(settings, lambda m: m.with_state(shard, ShardState.RETIRED))
        await _delete_when_left(connection, names, shard, leave_wait_s)
    finally:
        await connection.close()


async def _delete_when_left(
    connection: aio_pika.abc.AbstractConnection, names: Names, shard: str, wait_s: float
) -> None:
    """Delete the shard's queues once its orchestrators have left it and it is still empty. Quorum queues
    cannot be deleted "only if empty", so nothing may arrive in between: the runs exchange's binding (the
    only way left in) goes first, and a message that came before is kept by refusing."""
    queue = names.shard_queue(shard)
    deadline = time.monotonic() + wait_s
    while True:
        counts = await _queue_counts(await connection.channel(), queue)
        if counts is None or counts[1] == 0 or time.monotonic() >= deadline:
            break
        await asyncio.sleep(0.5)
    if counts is None:
        return  # deleted already (a retire run again)
    if counts[1]:
        raise RetireRefused(
            shard,
            f"{counts[1]} consumer(s) still hold {queue} after {wait_s:g} s (are the orchestrators "
            "following the map?)",
            changed=True,
        )
    channel = await connection.channel()
    bound = await channel.get_queue(queue, ensure=False)
    await bound.unbind(names.runs_exchange, shard)
    counts = await _queue_counts(channel, queue)
    if counts is not None and counts[0]:
        raise RetireRefused(
            shard,
            f"{counts[0]} message(s) reached {queue} meanwhile: it stays (unbound); handle them (an "
            f"orchestrator with --shards {shard.rsplit('.', 1)[1]} --class {shard.rsplit('.', 1)[0]})",
            changed=True,
        )
    for name in (queue, dead_letter_queue(queue)):
        channel = await connection.channel()
        with contextlib.suppress(aiormq.exceptions.ChannelNotFoundEntity):
            await channel.queue_delete(name)

"""The live worker registry: which worker processes run now, and which contract versions each serves.

Runs pin contract versions, and a task of a version no live worker serves waits in its queue (invariant
14). During a rolling upgrade an operator needs to see that: ``saga contracts list --live`` shows, per
contract version, the live workers serving it and the unfinished runs pinned to it, and ``saga status``
says when a dispatched stage waits for a version nobody serves.

Every ``saga worker`` process registers itself once it consumes its queues, with a lease it renews every
third of :data:`LEASE_MS`; a process that misses three renewals (killed, stopped, cut off) has left. Keys,
all under the ``{workers}`` hash tag (one slot on Redis Cluster):

* ``<prefix>:{workers}:live``: sorted set, member = worker id, score = when its lease ends (Redis's own
  clock, so hosts' clocks do not matter); each renewal drops the members whose lease ended;
* ``<prefix>:{workers}:worker:<id>``: the worker's description (JSON: host, pid, started-at, what it
  serves, its adapters), expiring with the lease.

A reading lists the members whose lease has not ended and reads their descriptions. A clean stop removes
both at once. The registry only informs: routing never depends on it (tasks reach workers through their
contract queues), so a worker cut off from Redis keeps working and registers again when Redis is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from orchestrator.governance.store import digests_key, parse_digest_info
from orchestrator.store.live_runs import unfinished_by_digest
from orchestrator.store.membership import process_id, redis_now_ms

log = logging.getLogger(__name__)

#: A worker unheard of for this long has left (three renewals missed).
LEASE_MS = 15_000


def live_key(prefix: str) -> str:
    """Worker id -> when its lease ends."""
    return f"{prefix}:{{workers}}:live"


def worker_key(prefix: str, worker_id: str) -> str:
    """One worker's description, expiring with its lease."""
    return f"{prefix}:{{workers}}:worker:{worker_id}"


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker process serves: (task queue, contract ref) pairs, and for each contract it serves
    through an adapter, the ref of the handler the adapter calls."""

    id: str
    host: str
    pid: int
    started_at_ms: int
    serving: tuple[tuple[str, str], ...]
    adapters: Mapping[str, str] = field(default_factory=dict)
    apps: tuple[str, ...] = ()

    @classmethod
    def of_this_process(
        cls,
        serving: Iterable[tuple[str, str]],
        adapters: Mapping[str, str] | None = None,
        apps: Iterable[str] = (),
    ) -> WorkerInfo:
        return cls(
            id=process_id(),
            host=socket.gethostname(),
            pid=os.getpid(),
            started_at_ms=int(time.time() * 1000),
            serving=tuple(sorted(set(serving))),
            adapters=dict(sorted((adapters or {}).items())),
            apps=tuple(apps),
        )

    @property
    def contracts(self) -> list[str]:
        return sorted({ref for _, ref in self.serving})

    @property
    def queues(self) -> list[str]:
        """The task queues it serves (``tasks.parallel``, ``rendering``...)."""
        return sorted({queue for queue, _ in self.serving})

    def to_document(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "host": self.host,
            "pid": self.pid,
            "started_at_ms": self.started_at_ms,
            "contracts": self.contracts,
            "queues": self.queues,
            "serving": [list(pair) for pair in self.serving],
            "adapters": dict(self.adapters),
            "apps": list(self.apps),
        }

    @classmethod
    def from_document(cls, data: Any) -> WorkerInfo | None:
        """None for what this code did not write (an entry of another release is skipped, not fatal)."""
        try:
            return cls(
                id=str(data["id"]),
                host=str(data["host"]),
                pid=int(data["pid"]),
                started_at_ms=int(data["started_at_ms"]),
                serving=tuple((str(q), str(ref)) for q, ref in data["serving"]),
                adapters={str(k): str(v) for k, v in (data.get("adapters") or {}).items()},
                apps=tuple(str(a) for a in data.get("apps") or ()),
            )
        except (KeyError, TypeError, ValueError, AttributeError):
            return None

    def summary(self, ref: str | None = None) -> dict[str, Any]:
        """Who it is, for a listing; with ``ref``, also how it serves that contract."""
        found: dict[str, Any] = {
            "id": self.id,
            "host": self.host,
            "pid": self.pid,
            "started_at_ms": self.started_at_ms,
        }
        if ref is not None:
            found["adapter_to"] = self.adapters.get(ref)
            found["queues"] = sorted(q for q, r in self.serving if r == ref)
        return found


# ---- writing: one worker's presence -----------------------------------------------------------------


async def register(client: aioredis.Redis, prefix: str, info: WorkerInfo, lease_ms: int = LEASE_MS) -> None:
    """Register ``info`` (or renew its lease) and drop the members whose lease ended."""
    now_ms = await redis_now_ms(client)
    async with client.pipeline(transaction=False) as pipe:
        pipe.set(worker_key(prefix, info.id), json.dumps(info.to_document(), sort_keys=True), px=lease_ms)
        pipe.zadd(live_key(prefix), {info.id: now_ms + lease_ms})
        pipe.zremrangebyscore(live_key(prefix), "-inf", now_ms)
        await pipe.execute()


async def unregister(client: aioredis.Redis, prefix: str, worker_id: str) -> None:
    async with client.pipeline(transaction=False) as pipe:
        pipe.zrem(live_key(prefix), worker_id)
        pipe.delete(worker_key(prefix, worker_id))
        await pipe.execute()


@dataclass
class Presence:
    """A worker's entry in the registry, renewed in the background from :meth:`start` to :meth:`stop`.
    Best effort: Redis trouble is logged (once per outage) and the next renewal tries again; it never
    stops the worker, whose tasks do not depend on the registry."""

    client: aioredis.Redis
    prefix: str
    info: WorkerInfo
    lease_ms: int = LEASE_MS
    _renewing: asyncio.Task[None] | None = None
    _registered: bool | None = None  # None: not tried yet

    @property
    def every_s(self) -> float:
        return self.lease_ms / 3000

    def start(self) -> None:
        """Register now and renew until :meth:`stop`, in the background (Redis down delays nothing)."""
        self._renewing = asyncio.create_task(self._keep_renewing())

    async def _keep_renewing(self) -> None:
        while True:
            await self.renew()
            await asyncio.sleep(self.every_s)

    async def renew(self) -> bool:
        """One renewal; whether it reached Redis."""
        try:
            # bounded: a reply that never comes must not outlive the lease unnoticed
            await asyncio.wait_for(register(self.client, self.prefix, self.info, self.lease_ms), self.every_s)
        except Exception as exc:  # an outage (or anything else) must not stop the worker: retried next time
            if self._registered is not False:
                log.warning(
                    "cannot register worker %s in the live worker registry (%s: %s); retrying every %.1f s",
                    self.info.id,
                    type(exc).__name__,
                    exc,
                    self.every_s,
                )
            self._registered = False
            return False
        if self._registered is False:
            log.warning("worker %s is registered in the live worker registry again", self.info.id)
        self._registered = True
        return True

    async def stop(self) -> None:
        """Stop renewing and leave the registry at once (a clean stop is not a death to wait out)."""
        if self._renewing is not None:
            self._renewing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewing
        try:
            await asyncio.wait_for(unregister(self.client, self.prefix, self.info.id), self.every_s)
        except Exception as exc:  # its lease ends on its own
            log.warning("could not leave the live worker registry (%s); the entry expires on its own", exc)


# ---- reading ----------------------------------------------------------------------------------------


async def live_workers(client: aioredis.Redis, prefix: str) -> list[WorkerInfo]:
    """The workers whose lease has not ended, by id. Read-only."""
    now_ms = await redis_now_ms(client)
    ids = [_text(m) for m in await client.zrangebyscore(live_key(prefix), now_ms, "+inf")]
    if not ids:
        return []
    raw = await client.mget([worker_key(prefix, i) for i in ids])
    found = []
    for text in raw:
        if text is None:  # its description expired between the two reads
            continue
        with contextlib.suppress(ValueError):
            info = WorkerInfo.from_document(json.loads(_text(text)))
            if info is not None:
                found.append(info)
    return sorted(found, key=lambda w: w.id)


def serving_index(workers: Iterable[WorkerInfo]) -> dict[str, list[WorkerInfo]]:
    """Contract ref -> the live workers that serve it."""
    index: dict[str, list[WorkerInfo]] = {}
    for info in workers:
        for ref in info.contracts:
            index.setdefault(ref, []).append(info)
    return index


async def pinned_plans(
    client: aioredis.Redis, prefix: str, digests: Iterable[str]
) -> dict[str, Mapping[str, Any]]:
    """The plans of ``digests``, by digest; a plan that is not stored is left out."""
    # imported here: workers register through this module, and load nothing of the store or the engine
    from orchestrator.store.redis_store import PlanNotFound, RedisStore

    store = RedisStore(client, prefix)
    plans: dict[str, Mapping[str, Any]] = {}
    for digest in sorted(set(digests)):
        with contextlib.suppress(PlanNotFound):
            plans[digest] = await store.plan(digest)
    return plans


def contract_rows(
    contracts: Iterable[Any],
    workers: Iterable[WorkerInfo],
    plans: Mapping[str, Mapping[str, Any]],
    unfinished: Mapping[str, int],
    startable: Iterable[str] = (),
) -> list[dict[str, Any]]:
    """``saga contracts list --live``: one row per contract version that is registered (``contracts``,
    of :class:`~orchestrator.contracts.Contract`), served by a live worker, pinned by an unfinished run
    or used by a definition version that may still start runs (``startable``: their plan digests): its
    kind and queue, the live workers serving it (and through which adapter), and per plan that uses it
    its unfinished runs and whether new runs may still start on it. Pure."""
    may_start = set(startable)
    known: dict[str, dict[str, Any]] = {
        c.ref: {"kind": c.kind.value, "queue": c.queue, "registered": True} for c in contracts
    }
    by_ref = serving_index(workers)
    pinned: dict[str, list[dict[str, Any]]] = {}
    for digest, plan in sorted(plans.items()):
        runs = int(unfinished.get(digest, 0))
        for ref, contract in sorted(plan.get("contracts", {}).items()):
            known.setdefault(
                ref, {"kind": contract.get("kind"), "queue": contract.get("queue"), "registered": False}
            )
            entry = {"digest": digest, "definition": plan.get("name"), "version": plan.get("version")}
            pinned.setdefault(ref, []).append({**entry, "runs": runs, "startable": digest in may_start})
    for ref in by_ref:
        known.setdefault(ref, {"kind": None, "queue": None, "registered": False})
    rows = []
    for ref in sorted(known, key=_ref_order):
        plans_of = pinned.get(ref, [])
        rows.append(
            {
                "ref": ref,
                **known[ref],
                "workers": [w.summary(ref) for w in by_ref.get(ref, [])],
                "pinned_runs": sum(p["runs"] for p in plans_of),
                "startable": any(p["startable"] for p in plans_of),
                "plans": plans_of,
            }
        )
    return rows


async def read_contract_rows(
    client: aioredis.Redis, prefix: str, shards: Iterable[str], contracts: Iterable[Any]
) -> list[dict[str, Any]]:
    """:func:`contract_rows` from Redis: live workers, unfinished runs per digest over ``shards`` (every
    shard of the map, retired ones included), and the definition versions that may still start runs."""
    workers = await live_workers(client, prefix)
    unfinished = await unfinished_by_digest(client, prefix, shards)
    startable = await startable_digests(client, prefix)
    plans = await pinned_plans(client, prefix, [*unfinished, *startable])
    return contract_rows(contracts, workers, plans, unfinished, startable)


async def startable_digests(client: aioredis.Redis, prefix: str) -> list[str]:
    """The plan digests of every definition version that may still start runs (approved, not retired)."""
    raw = await client.hgetall(digests_key(prefix))  # type: ignore[misc]
    infos = {_text(d): parse_digest_info(v) for d, v in raw.items()}
    return sorted(d for d, info in infos.items() if info is not None and info.startable)


def _ref_order(ref: str) -> tuple[str, int]:
    """``render@3`` before ``render@12``."""
    name, _, version = ref.rpartition("@")
    return (name, int(version)) if version.isdigit() else (ref, 0)


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)

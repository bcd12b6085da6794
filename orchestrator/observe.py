"""Read what runs are doing: a run's record and pinned plan (Redis), who consumes its task queues
(RabbitMQ, by passive declare), who holds the serial lane, its history, and the runs of every shard.
Read-only: nothing here writes to Redis or publishes. The documents' text is in ``orchestrator.views``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aio_pika
import aiormq
import pamqp.exceptions
import redis.asyncio as aioredis

from orchestrator import views
from orchestrator.bus.connect import connect_once
from orchestrator.bus.names import SERIAL_TASKS
from orchestrator.client import RunNotFound, is_final, refused_document, status_document, visible
from orchestrator.engine.model import StageStatus
from orchestrator.keys.reload import opened, sealer_for
from orchestrator.redaction import Redactor, run_secrets, sensitive_values
from orchestrator.sealing import Sealer
from orchestrator.settings import Settings, redis_client
from orchestrator.shardmap import ShardMap
from orchestrator.store import shardmap_store
from orchestrator.store.facets import listing_facet
from orchestrator.store.keys import ShardKeys, refused_key
from orchestrator.store.redis_store import PlanNotFound, RedisStore
from orchestrator.store.spec import snapshot_from_record
from orchestrator.wire.bodies import DEFAULT_TENANT
from workers.serial_lane import holder_of, lane_key

#: How long ``wait`` and ``watch`` give a run id that is not there yet (its start may still be on its
#: way to the shard) before they say it is unknown.
NOT_FOUND_GRACE_S = 5.0
PAGE = 500
_BROKER_ERRORS = (aiormq.exceptions.AMQPError, pamqp.exceptions.PAMQPException, OSError, TimeoutError)


class BrokerProbe:
    """Consumer counts of task queues, by passive declare on one connection. A queue nobody declared has
    no consumer. Best effort: a broker that cannot be reached leaves the counts unknown (``error`` says
    why), so a status never fails for want of its waiting reasons."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.error: str | None = None
        self._connection: aio_pika.abc.AbstractConnection | None = None
        self._channel: aio_pika.abc.AbstractChannel | None = None

    async def __aenter__(self) -> BrokerProbe:
        return self

    async def _connect(self) -> aio_pika.abc.AbstractConnection | None:
        """Connect on first use (a run with nothing dispatched needs no broker), once."""
        if self._connection is None and self.error is None:
            logging.getLogger("aiormq").addHandler(logging.NullHandler())
            try:
                self._connection = await connect_once(self.url, timeout_s=5)
            except (*_BROKER_ERRORS, ValueError) as exc:
                self.error = f"cannot reach RabbitMQ: {exc or type(exc).__name__}"
        return self._connection

    async def __aexit__(self, *exc: object) -> None:
        if self._connection is not None:
            await self._connection.close()

    async def consumers(self, queue: str) -> int | None:
        connection = await self._connect()
        if connection is None:
            return None
        try:
            if self._channel is None or self._channel.is_closed:
                # a passive declare of a queue that is not there closes its channel
                self._channel = await connection.channel()
            declared = await self._channel.declare_queue(queue, passive=True)
        except aiormq.exceptions.ChannelNotFoundEntity:
            return 0
        except _BROKER_ERRORS as exc:
            self.error = f"RabbitMQ did not answer: {exc or type(exc).__name__}"
            return None
        result = declared.declaration_result
        count = result.consumer_count if result is not None else None
        return int(count) if count is not None else None


async def read_record(
    client: aioredis.Redis, prefix: str, run_id: str, tenant: str | None = None
) -> dict[str, str]:
    """A run's record (its flat hash); raises RunNotFound, also for a run of another tenant than
    ``tenant`` (None: any), which is not this caller's to know of."""
    shard = await RedisStore(client, prefix).owner(run_id)
    record: dict[str, str] = (
        await client.hgetall(ShardKeys(prefix, shard).run(run_id)) if shard else {}  # type: ignore[misc]
    )
    if not record or not visible(record, tenant):
        raise RunNotFound(run_id)
    return record


async def run_document(
    client: aioredis.Redis,
    prefix: str,
    run_id: str,
    tenant: str | None = None,
    key: bytes | None = None,
    sealer: Sealer | None = None,
) -> dict[str, Any]:
    """``client.status_document`` of a run (its output's sensitive values marked, ``key`` keying the
    marks), or of a run id whose start the shard refused (state ``refused``, with the reason); raises
    RunNotFound (for ``tenant``, as :func:`read_record`)."""
    try:
        record = await read_record(client, prefix, run_id, tenant)
    except RunNotFound:
        refused = await client.hgetall(refused_key(prefix, run_id))  # type: ignore[misc]
        if refused and visible(refused, tenant):
            return refused_document(run_id, refused)
        raise
    record = opened(record, sealer)
    document = status_document(record)
    if document["output"] is None:
        return document
    try:
        plan = await RedisStore(client, prefix).plan(str(document["digest"]))
    except PlanNotFound:
        return document
    scrubbed: dict[str, Any] = redactor_of(record, plan, key).scrub(document)
    return scrubbed


async def status_view(
    client: aioredis.Redis,
    settings: Settings,
    run_id: str,
    *,
    inputs: bool = False,
    probe: BrokerProbe | None = None,
    store: RedisStore | None = None,
    tenant: str | None = None,
) -> dict[str, Any]:
    """The ``saga status --json`` document: ``client.status_document`` with the plan order and each
    stage's result, progress and (with ``probe``) why a dispatched stage waits. ``tenant``: only a run
    of that tenant (else RunNotFound)."""
    try:
        sealer = sealer_for(settings)  # the key ring, read once: it opens sealed values and keys the marks
        record = opened(await read_record(client, settings.key_prefix, run_id, tenant), sealer)
    except RunNotFound:
        return {**await run_document(client, settings.key_prefix, run_id, tenant), "order": []}
    document = status_document(record)
    store = store or RedisStore(client, settings.key_prefix)
    try:
        plan = await store.plan(str(document["digest"]))
    except PlanNotFound:
        return {**document, "order": sorted(document["stages"])}
    view = views.enrich(document, record, plan, inputs=inputs)
    if probe is not None:
        await _add_waits(client, settings, view, plan, probe)
    key = sealer.ring().data_secret() if sealer is not None else None
    scrubbed: dict[str, Any] = redactor_of(record, plan, key, view).scrub(view)
    return scrubbed


def redactor_of(
    record: Mapping[str, str],
    plan: Mapping[str, Any],
    key: bytes | None,
    view: Mapping[str, Any] | None = None,
) -> Redactor:
    """What hides a run's sensitive values (``orchestrator/redaction.py``) where it is shown: its
    context's and its results' by their schemas, and (``view``: a status with inputs) each stage's
    input's by its contract's input schema."""
    snapshot = snapshot_from_record(record, {})
    results = {name: rec.result for name, rec in snapshot.stages.items() if rec.result is not None}
    found = run_secrets(snapshot.context, results, plan)
    contracts, specs = plan.get("contracts") or {}, plan.get("stages") or {}
    for name, stage in ((view or {}).get("stages") or {}).items():
        spec = specs.get(name) or {}
        ref = spec.get("action") or spec.get("worker")
        if "input" in stage and ref in contracts:
            schema = contracts[ref].get("input_schema")
            each = (
                stage["input"]
                if spec.get("type") == "map" and isinstance(stage["input"], list)
                else [stage["input"]]
            )
            found += [v for item in each for v in sensitive_values(item, schema)]  # a map's: per item
    return Redactor.of(found, key)


async def _add_waits(
    client: aioredis.Redis,
    settings: Settings,
    view: dict[str, Any],
    plan: Mapping[str, Any],
    probe: BrokerProbe,
) -> None:
    holder: dict[str, Any] | None = None
    lane_read = False
    for name, stage in view["stages"].items():
        spec = plan["stages"].get(name, {})
        if stage["state"] != StageStatus.DISPATCHED or spec.get("type") not in views.WORK_TYPES:
            continue
        contract = str(spec.get("action") or spec.get("worker"))
        broker_queue = settings.names().task_queue(spec["queue"], contract)
        serial = spec["queue"] == SERIAL_TASKS
        if serial and not lane_read:
            holder, lane_read = holder_of(await client.get(lane_key(settings.key_prefix))), True
        reason = views.waiting_reason(
            run_id=view["run_id"],
            stage=name,
            contract=contract,
            queue=spec["queue"],
            broker_queue=broker_queue,
            consumers=await probe.consumers(broker_queue),
            holder=holder if serial else None,
            serial=serial,
        )
        if reason is not None:
            stage["waiting"] = reason
        elif serial and holder and holder.get("run_id") == view["run_id"] and holder.get("stage") == name:
            since = holder.get("since_ms")
            stage["lane"] = (
                f"running on {holder.get('worker', '?')} since "
                f"{views.iso_utc(since if isinstance(since, int) else None)} (holds the serial lane)"
            )


async def follow(
    read: Callable[[], Awaitable[dict[str, Any]]],
    run_id: str,
    *,
    timeout_s: float | None,
    interval_s: float,
    show: Callable[[dict[str, Any] | None, float], None] | None = None,
) -> dict[str, Any] | None:
    """Poll ``read`` until the run ends, or ``timeout_s`` passes (None: no limit), calling ``show`` with
    each reading. Returns the last document (None: the run never appeared). Raises RunNotFound once the
    run has been unknown for ``NOT_FOUND_GRACE_S``."""
    started = time.monotonic()
    document: dict[str, Any] | None = None
    poll_s = min(0.05, interval_s)
    while True:
        elapsed = time.monotonic() - started
        try:
            document = await read()
        except RunNotFound:
            if elapsed >= min(NOT_FOUND_GRACE_S, timeout_s if timeout_s is not None else NOT_FOUND_GRACE_S):
                raise
        if show is not None:
            show(document, elapsed)
        if document is not None and is_final(document["state"]):
            return document
        if timeout_s is not None and elapsed >= timeout_s:
            return document
        pause = poll_s if timeout_s is None else min(poll_s, max(timeout_s - elapsed, 0.0))
        await asyncio.sleep(pause)
        poll_s = min(poll_s * 1.5, interval_s)


async def run_history(
    client: aioredis.Redis,
    prefix: str,
    run_id: str,
    tenant: str | None = None,
    key: bytes | None = None,
    sealer: Sealer | None = None,
) -> list[dict[str, Any]]:
    """A run's history, its sensitive values marked (``key``: the marks' hash key); raises RunNotFound
    (for ``tenant``, as :func:`read_record`)."""
    store = RedisStore(client, prefix)
    shard = await store.owner(run_id)
    if shard is None:
        raise RunNotFound(run_id)
    record: dict[str, str] = await client.hgetall(ShardKeys(prefix, shard).run(run_id))  # type: ignore[misc]
    if tenant is not None and (record.get("tenant") or DEFAULT_TENANT) != tenant:
        raise RunNotFound(run_id)
    events = await store.history(shard, run_id)
    if not record.get("digest"):
        return events
    try:
        plan = await store.plan(record["digest"])
    except PlanNotFound:
        return events
    scrubbed: list[dict[str, Any]] = redactor_of(opened(record, sealer), plan, key).scrub(events)
    return scrubbed


# ---- listing runs -------------------------------------------------------------------------------------

_FIELDS = ["definition", "version", "status", "created_at", "finished_at", "reason", "tenant"]


@dataclass(frozen=True)
class RunFilter:
    """What ``saga runs`` keeps: each set field must match; ``since_ms`` bounds the creation time;
    ``limit`` keeps the newest ones; ``after`` (created-at ms, run id: the last row of a page) starts
    the next page below it, in the listing's order (newest first, then by run id, descending)."""

    state: str | None = None
    definition: str | None = None
    version: str | None = None
    since_ms: int | None = None
    limit: int | None = None
    after: tuple[int, str] | None = None
    tenant: str | None = None  # the caller's: only its runs (None: every tenant's)

    def keeps(
        self, definition: str | None, version: str | None, state: str | None, tenant: str | None = None
    ) -> bool:
        return (
            state is not None  # None: the record expired after its retention
            and (self.tenant is None or (tenant or DEFAULT_TENANT) == self.tenant)
            and (self.state is None or state == self.state)
            and (self.definition is None or definition == self.definition)
            and (self.version is None or version == self.version)
        )


def page_cursor(rows: list[dict[str, Any]], limit: int | None) -> str | None:
    """The cursor of the page after ``rows`` (``saga runs --cursor``, the API's ``next_cursor``): the
    last row's creation time and run id; None when the page was not full, so there is no more."""
    if limit is None or not rows or len(rows) < limit:
        return None
    return f"{rows[-1]['created_at']}:{rows[-1]['run_id']}"


def parse_cursor(text: str) -> tuple[int, str]:
    """A cursor :func:`page_cursor` gave, as ``RunFilter.after``; raises ValueError for any other."""
    created, _, run_id = text.partition(":")
    if not created.isdigit() or not run_id:
        raise ValueError(f"cursor {text!r} is not one a listing gave: use its next_cursor")
    return int(created), run_id


async def list_runs(settings: Settings, wanted: RunFilter) -> list[dict[str, Any]]:
    """Runs on every shard that ``wanted`` keeps, newest first. Each shard's run index is a sorted set
    scored by creation time, so each is read newest first, from ``since_ms`` on, a page at a time, and
    stops once it gave ``limit`` runs (no shard can need to give more)."""
    client = redis_client(settings)
    try:
        found: list[dict[str, Any]] = []
        shard_map = await shardmap_store.load(client, settings.key_prefix)
        known = (shard_map or ShardMap.seed(settings.shard_classes, settings.shard_count)).known
        for shard in known:  # retired shards' finished runs stay readable
            found += await _shard_runs(client, ShardKeys(settings.key_prefix, shard), wanted)
        # newest first, and within a millisecond by run id descending: the order of each shard's index
        # (ZREVRANGEBYSCORE), so a page cut at ``limit`` and the cursor after it agree
        found.sort(key=lambda r: (r["created_at"], r["run_id"]), reverse=True)
        if wanted.limit is not None:
            found = found[: wanted.limit]
        await _add_updated(client, settings.key_prefix, found)
        return found
    finally:
        await client.aclose()


async def _shard_runs(client: aioredis.Redis, keys: ShardKeys, wanted: RunFilter) -> list[dict[str, Any]]:
    low = wanted.since_ms if wanted.since_ms is not None else "-inf"
    high: int | str = wanted.after[0] if wanted.after is not None else "+inf"
    # the index of exactly the runs the filter keeps (kept by the transitions), so a page reads little
    # more than the page; each record is still checked (an index entry may outlive its expired record)
    index = listing_facet(keys, wanted.state, wanted.definition, wanted.version) or keys.runs()
    page = min(max(wanted.limit or PAGE, 100), PAGE)
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    offset = 0
    while True:
        scored = await client.zrevrangebyscore(index, high, low, start=offset, num=page, withscores=True)
        run_ids = [r for r, score in scored if not _before_cursor(wanted.after, int(score), r)]
        async with client.pipeline(transaction=False) as pipe:
            for run_id in run_ids:
                pipe.hmget(keys.run(run_id), _FIELDS)
            records = await pipe.execute()
        for run_id, (definition, version, state, created, finished, reason, tenant) in zip(
            run_ids, records, strict=True
        ):
            if run_id in seen or not wanted.keeps(definition, version, state, tenant):
                continue  # seen: a run created meanwhile moved the page by one
            seen.add(run_id)
            rows.append(
                {
                    "run_id": run_id,
                    "definition": definition,
                    "version": version,
                    "state": state,
                    "created_at": int(created or 0),
                    "finished_at": int(finished) if finished else None,
                    "reason": reason,
                    "shard": keys.shard,
                    "tenant": tenant or DEFAULT_TENANT,
                }
            )
            if wanted.limit is not None and len(rows) >= wanted.limit:
                return rows
        if len(scored) < page:
            return rows
        offset += page


def _before_cursor(after: tuple[int, str] | None, created_at: int, run_id: str) -> bool:
    """Whether a run was on a page before the one ``after`` starts (same millisecond, not a lower run id)."""
    return after is not None and created_at == after[0] and run_id >= after[1]


async def _add_updated(client: aioredis.Redis, prefix: str, rows: list[dict[str, Any]]) -> None:
    """Each run's last change (its newest history event), and ISO 8601 UTC copies of its times."""
    async with client.pipeline(transaction=False) as pipe:
        for row in rows:
            pipe.xrevrange(ShardKeys(prefix, row["shard"]).history(row["run_id"]), count=1)
        lasts = await pipe.execute()
    for row, last in zip(rows, lasts, strict=True):
        at = last[0][1].get("at") if last else None
        row["updated_at"] = int(at) if at else row["finished_at"]
        row["created"] = views.iso_utc(row["created_at"])
        row["finished"] = views.iso_utc(row["finished_at"]) if row["finished_at"] else None
        row["updated"] = views.iso_utc(row["updated_at"]) if row["updated_at"] else None

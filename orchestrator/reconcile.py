"""The reconciler: find stranded work and repair it, reporting what it did.

Three kinds of stranded work, each of which the normal paths cannot see:

* **unsent outbox entries** older than ``min_age_ms`` on any shard: committed messages that were never
  confirmed (the orchestrator serving that shard relays its own every few seconds; this covers shards
  nobody serves right now). Repair: publish with confirms, then mark sent. An entry too large for
  ``SAGA_MAX_MESSAGE_BYTES`` (committed before the limit was lowered) is never sent: its reader would
  park it unread. It is removed and its run nudged, which fails the step that needed it, with the reason.
* **stranded runs**: running or finalising, with no unsent message and no timer, and nothing in their
  history for ``stranded_after_ms``: the message they wait for was lost outside saga (a purged queue, a
  broker restored from an old backup). Repair: a nudge, which re-sends the waiting tasks with their own
  ids, so a task that was only slow becomes a duplicate.
* **index claims without a run**, idle for ``min_age_ms``: a start that claimed its run id and was never
  created, or a run whose record expired after its retention. Repair: delete the claim.

``dry_run`` reports without repairing. ``saga reconcile`` runs it over every shard; the orchestrator runs
the first two for the shards it serves, periodically.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

from orchestrator.bus.publisher import Publisher, outgoing_from_payload
from orchestrator.sealing import PREFIX, SealError
from orchestrator.shard.processor import Processor
from orchestrator.store.keys import index_key
from orchestrator.store.redis_store import RedisStore
from orchestrator.wire import sizes
from orchestrator.wire.outgoing import Outgoing

log = logging.getLogger(__name__)

ACTIVE_RUN_STATES = ("running", "finalising")
SCAN_BATCH = 500


@dataclass
class Report:
    unsent: list[str] = field(default_factory=list)  # outbox ids found (and re-published unless dry run)
    republished: list[str] = field(default_factory=list)
    undeliverable: list[str] = field(default_factory=list)  # too large to send: removed, their runs nudged
    stranded: list[str] = field(default_factory=list)  # run ids found (and nudged unless dry run)
    nudged: list[str] = field(default_factory=list)
    orphan_claims: list[str] = field(default_factory=list)  # run ids whose claim has no run
    dropped_claims: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {name: list(value) for name, value in self.__dict__.items()}

    def merge(self, other: Report) -> None:
        for name, value in other.__dict__.items():
            getattr(self, name).extend(value)


async def publish_and_mark(
    store: RedisStore, publisher: Publisher, shard: str, messages: list[Outgoing], now_ms: int
) -> list[str]:
    """Publish outbox messages and mark the confirmed ones sent; returns their ids."""
    confirmed = await publisher.publish_all(messages, now_ms)
    await store.mark_sent(shard, confirmed)
    return confirmed


@dataclass
class Reconciler:
    store: RedisStore
    processor: Processor
    publisher: Publisher | None  # None: report only
    min_age_ms: int = 60_000
    stranded_after_ms: int = 600_000
    redis_timeout_s: float | None = None  # bound each Redis read (the orchestrator's own passes)

    async def shard(self, shard: str, now_ms: int, *, dry_run: bool) -> Report:
        entries = await self._entries(shard)
        report = await self.outbox(shard, now_ms, dry_run=dry_run, entries=entries)
        report.merge(await self.stranded(shard, now_ms, dry_run=dry_run, entries=entries))
        return report

    async def _entries(self, shard: str) -> dict[str, dict[str, Any]]:
        async with asyncio.timeout(self.redis_timeout_s):
            return await self.store.outbox(shard)

    def _opened(self, payload: dict[str, Any]) -> dict[str, Any] | None:
        """An outbox entry with its values sealed at rest opened (None, logged: one that will not open
        stays for a process that holds its key, and the others go on)."""
        sealer = self.processor.sealer
        if sealer is None or PREFIX not in json.dumps(payload.get("body")):
            return payload
        try:
            opened: dict[str, Any] = sealer.unseal(payload, str(payload.get("run_id", "")))
            return opened
        except SealError as exc:
            log.error("outbox entry %s is not re-published: %s", payload.get("id"), exc)
            return None

    async def outbox(
        self, shard: str, now_ms: int, *, dry_run: bool, entries: dict[str, dict[str, Any]] | None = None
    ) -> Report:
        """Unsent outbox entries older than ``min_age_ms``: re-published, then marked sent."""
        report = Report()
        found = entries if entries is not None else await self._entries(shard)
        old = [p for p in found.values() if int(p.get("at", 0)) <= now_ms - self.min_age_ms]
        report.unsent += [str(p["id"]) for p in old]
        messages = []
        for payload in old:
            opened = self._opened(payload)
            if opened is not None:
                messages.append(outgoing_from_payload(opened))
        too_big = [m for m in messages if sizes.too_big(m.body, self.processor.limits) is not None]
        report.undeliverable += [m.message_id for m in too_big]
        if dry_run or self.publisher is None:
            return report
        if too_big:
            await self._drop_undeliverable(shard, self.publisher, too_big, now_ms)
        dropped = {m.message_id for m in too_big}
        sendable = [m for m in messages if m.message_id not in dropped]
        if sendable:
            report.republished += await publish_and_mark(self.store, self.publisher, shard, sendable, now_ms)
        return report

    async def _drop_undeliverable(
        self, shard: str, publisher: Publisher, messages: list[Outgoing], now_ms: int
    ) -> None:
        """Remove entries no reader would accept, then nudge their runs: the nudge measures what the run
        waits for again and fails that step with the reason instead of re-sending it."""
        await self.store.mark_sent(shard, [m.message_id for m in messages])
        for run_id in sorted({str(m.body.get("run_id", "")) for m in messages} - {""}):
            outcome = await self.processor.nudge(shard, run_id, f"nudge-{uuid.uuid4().hex}")
            if outcome.publish:
                await publish_and_mark(self.store, publisher, shard, outcome.publish, now_ms)

    async def stranded(
        self, shard: str, now_ms: int, *, dry_run: bool, entries: dict[str, dict[str, Any]] | None = None
    ) -> Report:
        """Active runs with nothing on its way to them and a quiet history: nudged."""
        report = Report()
        found = entries if entries is not None else await self._entries(shard)
        async with asyncio.timeout(self.redis_timeout_s):
            waiting = {str(p.get("run_id", "")) for p in found.values()} | await self.store.timer_runs(shard)
            quiet = await self._quiet_active_runs(shard, now_ms)
        for run_id in quiet:
            if run_id in waiting:
                continue
            report.stranded.append(run_id)
            if dry_run or self.publisher is None:
                continue
            outcome = await self.processor.nudge(shard, run_id, f"nudge-{uuid.uuid4().hex}")
            if outcome.publish:
                await publish_and_mark(self.store, self.publisher, shard, outcome.publish, now_ms)
                report.nudged.append(run_id)
        return report

    async def _quiet_active_runs(self, shard: str, now_ms: int) -> list[str]:
        """Running or finalising runs whose history has been quiet for ``stranded_after_ms``."""
        keys = self.store.keys(shard)
        run_ids = await self.store.run_ids(shard)
        quiet = []
        for start in range(0, len(run_ids), SCAN_BATCH):
            chunk = run_ids[start : start + SCAN_BATCH]
            async with self.store.client.pipeline(transaction=False) as pipe:
                for run_id in chunk:
                    pipe.hget(keys.run(run_id), "status")
                    pipe.xrevrange(keys.history(run_id), count=1)
                replies = await pipe.execute()
            for i, run_id in enumerate(chunk):
                status, last = replies[2 * i], replies[2 * i + 1]
                status = status.decode() if isinstance(status, bytes) else status
                if status not in ACTIVE_RUN_STATES or not last:
                    continue
                entry_id = last[0][0]
                at_ms = int((entry_id.decode() if isinstance(entry_id, bytes) else entry_id).split("-")[0])
                if at_ms <= now_ms - self.stranded_after_ms:
                    quiet.append(run_id)
        return quiet

    async def claims(self, now_ms: int, *, dry_run: bool) -> Report:
        """Index claims (``<prefix>:index:{run}``) idle for ``min_age_ms`` whose run does not exist."""
        report = Report()
        client = self.store.client
        pattern = index_key(self.store.prefix, "*")
        async for raw in client.scan_iter(match=pattern, count=SCAN_BATCH):
            key = raw.decode() if isinstance(raw, bytes) else str(raw)
            idle_s = await client.object("idletime", key)  # read before GET, which resets it
            if idle_s is None or int(idle_s) * 1000 < self.min_age_ms:
                continue
            shard = await client.get(key)
            if shard is None:
                continue
            run_id = key.split("{", 1)[1].rstrip("}")
            shard_id = shard.decode() if isinstance(shard, bytes) else str(shard)
            if await client.exists(self.store.keys(shard_id).run(run_id)):
                continue
            report.orphan_claims.append(run_id)
            if not dry_run:
                await client.delete(key)
                report.dropped_claims.append(run_id)
        return report

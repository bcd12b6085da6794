"""An in-memory model of the Redis Functions library: it applies the same specs with the same checks.

It lets the engine be exercised without services: property tests deliver messages duplicated, reordered
and stale, and golden histories replay, against a line-by-line port of ``lua/*.lua``. The Redis store is
tested against the same scenarios, so the two cannot drift apart unnoticed. The shard's listing indexes
(``facets.py``) are left out: no transition reads them, so they cannot change a decision. Bags are kept as
their members, item -> result: the bitmap and list the Redis store keeps them in are a representation
of the same membership, read back by ``RedisStore.barrier_members`` in this shape.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from orchestrator.engine.model import Decision, RunSnapshot
from orchestrator.store.keys import tenant_field
from orchestrator.store.replies import APPLIED, CONFLICT, DUPLICATE, NO_RUN, TIMER_GONE
from orchestrator.store.spec import (
    FIRST_BARRIER_KEY,
    Spec,
    build_spec,
    ordered_items,
    poison_spec,
    snapshot_from_record,
)
from orchestrator.wire.bodies import DEFAULT_TENANT


@dataclass
class MemoryRun:
    record: dict[str, str] = field(default_factory=dict)
    barriers: dict[str, dict[str, str]] = field(default_factory=dict)
    applied: set[str] = field(default_factory=set)
    history: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class MemoryStore:
    retention_ms: int = 3_600_000
    runs: dict[str, MemoryRun] = field(default_factory=dict)
    outbox: dict[str, str] = field(default_factory=dict)  # id -> payload, in insertion order
    timers: dict[str, int] = field(default_factory=dict)  # the shard's timer set: member -> due ms
    live: dict[str, int] = field(default_factory=dict)  # plan digest -> unfinished runs (helpers.lua)

    def due_timers(self, now_ms: int) -> list[str]:
        return [m for m, due in sorted(self.timers.items(), key=lambda t: (t[1], t[0])) if due <= now_ms]

    def snapshot(self, run_id: str, *, with_members: bool = False) -> RunSnapshot | None:
        """The run's snapshot, with every map's item results (and, ``with_members``, every barrier's
        members, as the Redis store reads them for a nudge)."""
        run = self.runs.get(run_id)
        if run is None or not run.record:
            return None
        maps = {
            name: ordered_items(members)
            for name, members in run.barriers.items()
            if all(k.isdigit() for k in members)
        }
        # shared, as the shard's own reads are: the engine's property tests then hold the engine to
        # changing no value of a snapshot in place
        snapshot = snapshot_from_record(run.record, maps, shared=True)
        if not with_members:
            return snapshot
        arrivals = {name: frozenset(members) for name, members in run.barriers.items()}
        return dataclasses.replace(snapshot, arrivals=arrivals)

    def apply(
        self, run_id: str, message_id: str, decision: Decision, barriers: list[str], now_ms: int = 0
    ) -> tuple[int, str]:
        spec = build_spec(
            decision,
            run_id=run_id,
            message_id=message_id,
            now_ms=now_ms,
            barriers=barriers,
            retention_ms=self.retention_ms,
        )
        return self.call(spec, barriers)

    def call(self, spec: Spec, barriers: list[str]) -> tuple[int, str]:
        names = {FIRST_BARRIER_KEY + i: b for i, b in enumerate(barriers)}
        body = spec.body
        run = self.runs.get(body["run_id"])
        exists = run is not None and bool(run.record)
        if spec.function == "saga_create":
            if exists:
                return self._duplicate(run, body, None)  # type: ignore[arg-type]
            run = self.runs.setdefault(body["run_id"], MemoryRun())
            self._commit(run, body, names)
            return APPLIED, body["mid"]
        if not exists or run is None:
            self.timers.pop(body.get("claim") or "", None)  # a timer of an expired run
            return NO_RUN, ""
        if not self._claimed(body):
            return TIMER_GONE, ""
        if spec.function == "saga_transition" and body["mid"] in run.applied:
            return self._duplicate(run, body, None)
        for k, member, *_ in body.get("absent", []):
            if member in run.barriers.get(names[k], {}):
                return self._duplicate(run, body, None)
        failed = _check(run.record, body["expects"])
        if failed is not None:
            return CONFLICT, failed
        if spec.function == "saga_arrive":
            return self._arrive(run, body, names)
        self._commit(run, body, names)
        return APPLIED, body["mid"]

    def _claimed(self, body: dict[str, Any]) -> bool:
        claim = body.get("claim")
        return not claim or self.timers.get(claim, body["at"] + 1) <= body["at"]

    def _commit(self, run: MemoryRun, body: dict[str, Any], names: dict[int, str]) -> None:
        self._apply_all(run, body, names)
        self._history(run, body)

    def _apply_all(self, run: MemoryRun, body: dict[str, Any], names: dict[int, str]) -> None:
        """Every write of an accepted transition but its history (helpers.lua: apply_all)."""
        before = run.record.get("status")
        self._write(run, body, names)
        self._count_live(run, before)
        if body.get("remember", True):
            run.applied.add(body["mid"])
        for member in body.get("untimers", []):
            self.timers.pop(member, None)
        for member, due in body.get("timers", []):
            self.timers[member] = due
        for message_id, payload in body["outbox"]:
            self.outbox[message_id] = payload
        if body.get("dels") or body["sets"] or body["inits"] or body.get("arrival"):
            run.record["rev"] = str(int(run.record.get("rev", "0")) + 1)

    def _arrive(self, run: MemoryRun, body: dict[str, Any], names: dict[int, str]) -> tuple[int, str]:
        a = body["arrival"]
        if a["member"] in run.barriers.get(names[a["k"]], {}):
            return self._duplicate(run, body, a["stage"])
        self._apply_all(run, body, names)
        members = run.barriers.setdefault(names[a["k"]], {})
        members[a["member"]] = a["value"]
        remaining = int(run.record.get(a["counter"], "0")) - 1
        run.record[a["counter"]] = str(remaining)
        if remaining == 0 and "release" in a:
            self.outbox[a["release"][0]] = a["release"][1]
        refill = a.get("refill")
        if refill is not None and refill[1] - remaining == refill[0]:
            self.outbox[refill[2][0]] = refill[2][1]
        self._history(run, body)
        return APPLIED, str(remaining)

    def _write(self, run: MemoryRun, body: dict[str, Any], names: dict[int, str]) -> None:
        for name in body.get("dels", []):
            run.record.pop(name, None)
        sets = body["sets"]
        for i in range(0, len(sets), 2):
            run.record[sets[i]] = sets[i + 1]
        for k, counter, count, members, *_ in body["inits"]:
            run.barriers[names[k]] = dict.fromkeys(members, "")
            run.record[counter] = str(count)

    def _count_live(self, run: MemoryRun, before: str | None) -> None:
        """helpers.lua: count_live."""
        was, now = _is_live(before), _is_live(run.record.get("status"))
        digest = run.record.get("digest")
        if was == now or not digest:
            return
        tenant = tenant_field(run.record.get("tenant") or DEFAULT_TENANT)
        if now:
            run.record["counted"] = "2"
            for field in (digest, tenant):
                self.live[field] = self.live.get(field, 0) + 1
            return
        counted = run.record.pop("counted", None)
        for field in (digest, tenant) if counted == "2" else (digest,) if counted else ():
            self.live[field] = self.live.get(field, 0) - 1
            if self.live[field] <= 0:
                del self.live[field]

    def _history(self, run: MemoryRun, body: dict[str, Any]) -> None:
        for kind, stage, attempt, detail in body["history"]:
            run.history.append(
                {
                    "kind": kind,
                    "stage": stage,
                    "attempt": attempt,
                    "at": body["at"],
                    "detail": json.loads(detail),
                }
            )

    def _duplicate(self, run: MemoryRun, body: dict[str, Any], stage: str | None) -> tuple[int, str]:
        detail = {"reason": "duplicate", "message_id": body["mid"]}
        run.history.append(
            {
                "kind": "callback.rejected",
                "stage": stage or "",
                "attempt": "",
                "at": body["at"],
                "detail": detail,
            }
        )
        return DUPLICATE, body["mid"]

    def poison(self, run_id: str, message_id: str, error: str, now_ms: int) -> int:
        """lua/poison.lua: fail the run a poison message names, touching nothing else."""
        body = poison_spec(message_id, error, now_ms).body
        run = self.runs.get(run_id)
        if run is None or not run.record:
            return NO_RUN
        detail = {"message_id": message_id, "error": error}
        run.history.append(
            {"kind": "message.poisoned", "stage": "", "attempt": "", "at": now_ms, "detail": detail}
        )
        if run.record.get("status") in ("completed", "failed"):
            return DUPLICATE
        run.record.setdefault("intent", "failed")
        before = run.record.get("status")
        run.record.update(status="failed", reason=body["reason"], finished_at=str(now_ms))
        run.record["rev"] = str(int(run.record.get("rev", "0")) + 1)
        self._count_live(run, before)
        failed = {"reason": body["reason"]}
        run.history.append({"kind": "run.failed", "stage": "", "attempt": "", "at": now_ms, "detail": failed})
        return APPLIED

    def mark_sent(self, ids: list[str]) -> int:
        return sum(1 for i in ids if self.outbox.pop(i, None) is not None)


def _is_live(status: str | None) -> bool:
    return status is not None and status not in ("completed", "failed")


def _check(record: dict[str, str], expects: list[list[Any]]) -> str | None:
    for name, want in expects:
        current = record.get(name)
        if (want is None and current is not None) or (want is not None and current != want):
            return str(name)
    return None

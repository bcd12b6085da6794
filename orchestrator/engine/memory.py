"""An in-memory store with the same apply semantics as the Redis Functions library.

It exists so the engine can be exercised without services: property tests deliver messages duplicated,
reordered and stale, and golden histories replay, against exactly the checks the Lua transition makes
(dedupe by message id, every ``Expect`` before any write, distinct barrier arrivals, one release).
The Redis store is tested against the same scenarios.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from orchestrator.engine.model import (
    Decision,
    HistoryEntry,
    Intent,
    Key,
    Outgoing,
    RunSnapshot,
    RunStatus,
    StageRecord,
    StageStatus,
    Verdict,
)


class Conflict(Exception):
    """Raised when a decision's preconditions no longer hold; the caller reloads and decides again."""


@dataclass
class MemoryRun:
    hashes: dict[Key, dict[str, str]] = field(default_factory=dict)
    barriers: dict[Key, int] = field(default_factory=dict)
    arrived: dict[Key, dict[str, str | None]] = field(default_factory=dict)
    applied: set[str] = field(default_factory=set)
    history: list[HistoryEntry] = field(default_factory=list)


@dataclass
class MemoryStore:
    runs: dict[str, MemoryRun] = field(default_factory=dict)
    outbox: list[Outgoing] = field(default_factory=list)

    def snapshot(self, run_id: str) -> RunSnapshot | None:
        run = self.runs.get(run_id)
        if run is None:
            return None
        return snapshot_from_hashes(run.hashes, {k.name: _ordered(v) for k, v in run.arrived.items()})

    def apply(self, run_id: str, message_id: str, decision: Decision) -> Verdict:
        """Apply atomically: all checks first, then every write. Returns the verdict recorded."""
        run = self.runs.get(run_id)
        if decision.create and run is not None:
            raise Conflict("run exists")
        if run is None:
            if not decision.create:
                return decision.verdict  # nothing to record against
            run = self.runs.setdefault(run_id, MemoryRun())
        arrival = decision.arrival
        duplicate = message_id in run.applied or (
            arrival is not None and arrival.member in run.arrived.get(arrival.key, {})
        )
        if duplicate:
            run.history.append(HistoryEntry("callback.rejected", None, None, {"reason": "duplicate"}))
            return Verdict.DUPLICATE
        _check(run, decision)
        run.applied.add(message_id)
        self._write(run, decision)
        return decision.verdict

    def _write(self, run: MemoryRun, decision: Decision) -> None:
        for write in decision.writes:
            run.hashes.setdefault(write.key, {}).update(write.fields)
        for barrier in decision.barriers:
            run.barriers[barrier.key] = barrier.count
            run.arrived[barrier.key] = {}
        arrival = decision.arrival
        if arrival is not None:
            run.arrived.setdefault(arrival.key, {})[arrival.member] = arrival.result
            run.barriers[arrival.key] = run.barriers.get(arrival.key, 0) - 1
            if run.barriers[arrival.key] == 0:
                self.outbox.append(arrival.release)
        run.history.extend(decision.history)
        self.outbox.extend(decision.outgoing)


def _check(run: MemoryRun, decision: Decision) -> None:
    for expect in decision.expects:
        if run.hashes.get(expect.key, {}).get(expect.field) != expect.value:
            raise Conflict(f"{expect.key}.{expect.field}")


def _ordered(arrived: dict[str, str | None]) -> list[Any]:
    items = sorted((int(k), v) for k, v in arrived.items() if k.isdigit())
    return [json.loads(v) if v is not None else None for _, v in items]


def snapshot_from_hashes(hashes: dict[Key, dict[str, str]], map_results: dict[str, list[Any]]) -> RunSnapshot:
    """Build the engine's snapshot from the run hash and stage hashes (shared with the Redis store)."""
    record = hashes.get(Key("run"), {})
    stages = {}
    for key, fields in hashes.items():
        if key.kind != "stage" or "status" not in fields:
            continue
        stages[key.name] = StageRecord(
            status=StageStatus(fields["status"]),
            attempt=int(fields.get("attempt", "1")),
            fence=fields.get("fence", ""),
            result=json.loads(fields["result"]) if "result" in fields else None,
            error=fields.get("error"),
        )
    return RunSnapshot(
        run_id=record["run_id"],
        shard=record["shard"],
        digest=record["digest"],
        status=RunStatus(record["status"]),
        context=json.loads(record.get("context", "{}")),
        intent=Intent(record["intent"]) if record.get("intent") else None,
        reason=record.get("reason"),
        epoch=int(record.get("epoch", "1")),
        finaliser_index=int(record.get("finaliser_index", "0")),
        finaliser_failed=record.get("finaliser_failed") == "1",
        tenant=record.get("tenant", "default"),
        output=json.loads(record["output"]) if "output" in record else None,
        stages=stages,
        map_results=map_results,
    )

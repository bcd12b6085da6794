"""The records a shard keeps between transitions: least recently used go first, and a large record keeps
no parsed snapshot beside it."""

from __future__ import annotations

from orchestrator.engine.model import RunSnapshot, RunStatus
from orchestrator.shard.records import SNAPSHOT_UP_TO, RunRecords


def snapshot(run_id: str) -> RunSnapshot:
    return RunSnapshot(run_id=run_id, shard="fast-0", digest="d", status=RunStatus.RUNNING, context={})


def test_a_small_record_keeps_its_snapshot_and_a_large_one_does_not() -> None:
    records = RunRecords()
    records.keep("fast-0", "small", {"run_id": "small", "context": "{}"}, snapshot("small"))
    large = {"run_id": "large", "context": "x" * SNAPSHOT_UP_TO}
    records.keep("fast-0", "large", large, snapshot("large"))
    kept_small, kept_large = records.get("fast-0", "small"), records.get("fast-0", "large")
    assert kept_small is not None and kept_small.snapshot == snapshot("small")
    assert kept_large is not None and kept_large.record is large and kept_large.snapshot is None


def test_the_least_recently_used_record_goes_first() -> None:
    records = RunRecords(capacity=2)
    records.keep("fast-0", "a", {"rev": "1"})
    records.keep("fast-0", "b", {"rev": "1"})
    assert records.get("fast-0", "a") is not None  # a used again: b is now the oldest
    records.keep("fast-0", "c", {"rev": "1"})
    assert records.get("fast-0", "b") is None
    assert records.get("fast-0", "a") is not None and records.get("fast-0", "c") is not None
    records.forget_shard("fast-0")
    assert len(records) == 0

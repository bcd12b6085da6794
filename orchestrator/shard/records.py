"""The run records a shard process advanced last, kept between transitions so that the next message of a
run needs no read before its write: one Redis round trip per transition instead of two.

A kept record is never trusted: it holds the run's revision (``rev``, counted up by every write of the
run hash, in Lua), and a transition decided from it expects that revision, so any write this process did
not make (a standby firing a timer, a paused old consumer, a poison mark, a failover that lost writes)
turns it into a CONFLICT, and the message is decided again from a fresh read. Arrivals at a barrier
expect no revision, as they never did (they commute with each other and check their own fences); a
decision from a kept record that refuses its message is made again from a fresh read before it is
recorded. After an applied transition the record is brought forward from the decision's own writes
when the reply's revision shows that nothing came in between; otherwise it is forgotten. The engine's
snapshot of a kept record is brought forward with it, from the decision's writes alone, so that a run's
next transition parses only what its last one changed.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from orchestrator.engine.model import RunSnapshot

DEFAULT_CAPACITY = 4096  # records per process (a model-ingest record is a few kB)
#: A record whose text is larger than this keeps no snapshot beside it (it is parsed for each message, as
#: a record read afresh is): parsed, a bag's large context takes several times its text's memory, and
#: this holds thousands of records.
SNAPSHOT_UP_TO = 256 * 1024


@dataclass(frozen=True)
class KeptRun:
    record: dict[str, str]
    snapshot: RunSnapshot | None  # None: to be built from the record when the run's next message comes


class RunRecords:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self._kept: OrderedDict[tuple[str, str], KeptRun] = OrderedDict()

    def get(self, shard: str, run_id: str) -> KeptRun | None:
        kept = self._kept.get((shard, run_id))
        if kept is not None:
            self._kept.move_to_end((shard, run_id))
        return kept

    def keep(
        self, shard: str, run_id: str, record: dict[str, str], snapshot: RunSnapshot | None = None
    ) -> None:
        if snapshot is not None and sum(map(len, record.values())) > SNAPSHOT_UP_TO:
            snapshot = None
        self._kept[(shard, run_id)] = KeptRun(record, snapshot)
        self._kept.move_to_end((shard, run_id))
        while len(self._kept) > self.capacity:
            self._kept.popitem(last=False)

    def forget(self, shard: str, run_id: str) -> None:
        self._kept.pop((shard, run_id), None)

    def forget_shard(self, shard: str) -> None:
        """A shard this process stops serving (or serves again after trouble): nothing of it is kept."""
        for key in [k for k in self._kept if k[0] == shard]:
            del self._kept[key]

    def __len__(self) -> int:
        return len(self._kept)

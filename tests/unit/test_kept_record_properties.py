"""Property test: under hostile delivery (the chaos of ``test_engine_properties``), the record a shard
keeps between transitions (``spec.record_after``: the record before, brought forward from the decision's
own writes) is exactly the record the store holds after every applied transition, and the revision
counts one for every transition that writes the run hash and none for one that only records a refusal;
and the engine's snapshot kept with it (``spec.snapshot_after``: brought forward from the decision alone,
transition after transition) is the snapshot built from the stored record.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from orchestrator.engine.model import RunSnapshot
from orchestrator.store.replies import APPLIED, DUPLICATE
from orchestrator.store.spec import record_after, snapshot_after, snapshot_from_record, writes_run
from tests.unit.engine_sim import Handled, Sim
from tests.unit.test_engine_properties import FORMATS, SETTINGS, chaos, new_sim

NOT_READ = {"counted"}  # the live-count flag: written by the store, read by no decision


class Predicted:
    """The sim's hook: after every handled event, compare the record to the one predicted from before."""

    def __init__(self) -> None:
        self.before: dict[str, str] = {}
        self.snapshot: RunSnapshot | None = None  # brought forward since the run's creation, if it could be
        self.checked = 0
        self.chained = 0

    def __call__(self, sim: Sim, handled: Handled) -> None:
        run = sim.store.runs.get(sim.run_id)
        after = dict(run.record) if run is not None else {}
        if handled.code == APPLIED and handled.conflicts == 0:
            rev = int(after["rev"])
            assert rev == int(self.before.get("rev", "0")) + writes_run(handled.decision), handled
            predicted = record_after(self.before, handled.decision, rev)
            assert _read(predicted) == _read(after), f"kept record differs after {handled.event}"
            self.checked += 1
            built = snapshot_from_record(after, {}, shared=True)
            if self.snapshot is None:
                self.snapshot = built
            else:  # the next one is brought forward from this one, as a shard does, not from the store
                self.snapshot = snapshot_after(self.snapshot, predicted, handled.decision)
                assert self.snapshot == built, f"kept snapshot differs after {handled.event}"
                self.chained += 1
        elif handled.code == DUPLICATE or handled.code is None:
            assert after == self.before, f"{handled.event} changed the record without applying"
        else:
            self.snapshot = snapshot_from_record(after, {}, shared=True) if after else None
        self.before = after


def _read(record: dict[str, str]) -> dict[str, str]:
    return {name: value for name, value in record.items() if name not in NOT_READ}


def chaos_with_prediction(data: st.DataObject, name: str, context: dict[str, Any], **kwargs: Any) -> None:
    hook = Predicted()
    sim = new_sim(name, hook=hook, **kwargs)
    chaos(data, sim, context)
    assert hook.checked >= 3, "the run applied transitions that were checked"
    assert hook.chained >= 2, "kept snapshots were brought forward and checked"


@SETTINGS
@given(
    data=st.data(),
    fmt=st.sampled_from(FORMATS),
    fail=st.sets(st.sampled_from(["render-thumbnail", "semantic-analysis"])),
)
def test_model_ingest_kept_records_are_exact(data: st.DataObject, fmt: str, fail: set[str]) -> None:
    chaos_with_prediction(data, "model-ingest", {"modelId": f"miss-{fmt}"}, fail_stages=frozenset(fail))


@SETTINGS
@given(data=st.data(), width=st.integers(1, 6), fail=st.sets(st.integers(0, 5), max_size=2))
def test_thumbnail_batch_kept_records_are_exact(data: st.DataObject, width: int, fail: set[int]) -> None:
    ids = [f"m-{i}" for i in range(width)]
    chaos_with_prediction(data, "thumbnail-batch", {"modelIds": ids}, fail_items=frozenset(fail))

"""A run hash's JSON fields: a large one is parsed once per text and shared by the snapshots that read
it (a bag's context, read again for every batch of its arrivals), a small one is parsed each time."""

from __future__ import annotations

import json

from orchestrator.store.spec import json_field, snapshot_from_record
from tests.unit.engine_sim import Sim
from tests.unit.test_engine import compiled


def test_a_large_field_is_parsed_once_and_equals_its_text() -> None:
    text = json.dumps({"modelIds": [f"m-{i}" for i in range(500)]})
    first, again = json_field(text), json_field(str(text))  # an equal text read again from Redis
    assert first == json.loads(text)
    assert again is first


def test_a_small_field_is_parsed_each_time() -> None:
    text = json.dumps({"modelId": "m-1"})
    assert json_field(text) == {"modelId": "m-1"}
    assert json_field(text) is not json_field(text)


def test_a_field_beyond_the_shared_size_is_not_kept() -> None:
    text = json.dumps(["x" * 1000] * 1100)  # over 1 MiB
    assert json_field(text) is not json_field(text)


def test_only_the_shards_snapshots_share_large_values() -> None:
    record = {
        "run_id": "r",
        "shard": "fast.0",
        "digest": "sha256:x",
        "status": "running",
        "context": json.dumps({"modelIds": [f"m-{i}" for i in range(500)]}),
    }
    assert snapshot_from_record(record, {}, shared=True).context is json_field(record["context"])
    # what the client and the views hand to callers is their own to change
    first, again = snapshot_from_record(record, {}), snapshot_from_record(record, {})
    assert first.context == again.context and first.context is not again.context


def test_a_bag_run_through_the_engine_leaves_its_shared_context_as_it_was_parsed() -> None:
    """The engine reads shared values (the in-memory store's snapshots share them, as the shard's do):
    a whole bag run, its context large enough to be shared, must not change any of them in place."""
    plan = compiled("thumbnail-batch")
    sim = Sim(plan.plan, plan.digest, run_id="run-shared", fail_items=frozenset({7}))
    ids = [f"model-{i:04d}" for i in range(300)]
    sim.start({"modelIds": ids})
    sim.run()
    text = sim.record["context"]
    assert len(text) >= 2048  # shared, not parsed each time
    assert json_field(text) == {"modelIds": ids} == json.loads(text)
    assert sim.status in ("completed", "failed") and sim.kinds()[0] == "run.started"


def test_integers_beyond_64_bits_read_back_exactly() -> None:
    """A context's or a result's big integer reaches the tasks bound from it as it was written, in both
    sizes of field (some JSON parsers read such an integer as a float, without an error)."""
    big = {"id": 123456789012345678901234, "neg": -(2**70), "ids": list(range(400))}
    for text in (json.dumps(big), json.dumps({**big, "pad": "x" * 3000})):
        parsed = json_field(text)
        assert (parsed["id"], parsed["neg"]) == (123456789012345678901234, -(2**70))
        assert isinstance(parsed["id"], int)

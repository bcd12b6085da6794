"""Translate an engine Decision into the spec the Lua transition functions apply, and a run record back
into the engine's snapshot. Pure: both the Redis store and the in-memory model use it.

A run is one flat hash: run fields by name, stage fields as ``s:<stage>:<field>``, barrier counters as
``b:<stage>``. A join's arrived branches live in one hash per join. A map (a bag) keeps two keys whose
cost per item does not depend on the bag: a bitmap of the items that arrived (an arrival's dedupe, an
eighth of a byte per item) and a list of ``<item>:<result>`` entries in arrival order (a few bytes per
item beside the result itself), sorted into item order when the bag is released. A bag opened before
that form (a hash of item -> result) finishes in the hash it began with.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from orchestrator import jsontext
from orchestrator.engine.model import (
    Decision,
    HistoryEntry,
    Intent,
    Key,
    RunSnapshot,
    RunStatus,
    StageRecord,
    StageStatus,
    evolve,
)
from orchestrator.wire.outgoing import Outgoing

FIRST_BARRIER_KEY = 8  # KEYS[8..] are barrier hashes (1-based, as Lua sees them), then each bag's two keys


def field_name(key: Key, name: str) -> str:
    if key.kind == "run":
        return name
    if key.kind == "stage":
        return f"s:{key.name}:{name}"
    if key.kind == "item":
        return f"i:{key.name}"  # one field per retried map item: its current attempt
    if key.kind == "counter":
        return counter_field(key.name)
    raise ValueError(f"no hash field for {key}")


def counter_field(stage: str) -> str:
    return f"b:{stage}"


def bag_members(in_hash: Mapping[str, str], results: Iterable[str]) -> dict[str, str]:
    """A map's arrived items (item index -> result JSON), from its hash (a bag opened in that form) and
    its results list."""
    members = dict(in_hash)
    for entry in results:
        item, _, value = entry.partition(":")
        members[item] = value
    return members


def outbox_payload(message: Outgoing, run_id: str, at_ms: int) -> str:
    payload = {
        "id": message.message_id,
        "kind": message.kind,
        "route": list(message.route),
        "body": message.body,
        "run_id": run_id,
        "at": at_ms,
    }
    if message.deadline_ms is not None:
        payload["deadline_ms"] = message.deadline_ms
    return jsontext.dumps(payload, sort_keys=True)


def _continuation_payload(message: Outgoing, run_id: str, at_ms: int) -> str:
    """The outbox payload of a barrier's release or a bag's refill: every arrival of a round names the
    same one (same time, and an id that is a function of the run, barrier, fence and chunk, as its body
    is), so it is written once per round, not once per item."""
    key = (message.message_id, message.route, run_id, at_ms)
    payload = _CONTINUATIONS.get(key)
    if payload is None:
        if len(_CONTINUATIONS) >= 64:
            _CONTINUATIONS.clear()
        payload = _CONTINUATIONS[key] = outbox_payload(message, run_id, at_ms)
    return payload


_CONTINUATIONS: dict[tuple[str, tuple[str, str], str, int], str] = {}


def history_row(entry: HistoryEntry) -> list[str]:
    attempt = "" if entry.attempt is None else str(entry.attempt)
    return [entry.kind, entry.stage or "", attempt, jsontext.dumps(dict(entry.detail), sort_keys=True)]


@dataclass(frozen=True)
class Spec:
    function: str  # saga_create | saga_transition | saga_arrive (| saga_arrive_many: several arrivals)
    body: dict[str, Any]

    def encode(self) -> str:
        return jsontext.dumps(self.body)


def build_spec(
    decision: Decision,
    *,
    run_id: str,
    message_id: str,
    now_ms: int,
    barriers: Sequence[str],
    retention_ms: int,
    bags: Sequence[str] = (),
) -> Spec:
    """``bags``: the maps whose bitmap and results list follow the barrier hashes in KEYS (the Redis
    store names them all; without them, bags are kept in their hashes, as the in-memory model does)."""
    index = {name: FIRST_BARRIER_KEY + i for i, name in enumerate(barriers)}
    # a bag's bitmap; its results list is the key after it
    bag_index = {name: FIRST_BARRIER_KEY + len(barriers) + 2 * i for i, name in enumerate(bags)}
    sets: list[str] = []
    for write in decision.writes:
        for name, value in write.fields.items():
            sets += [field_name(write.key, name), value]
    body: dict[str, Any] = {
        "mid": message_id,
        "run_id": run_id,
        "at": now_ms,
        "expects": [[field_name(e.key, e.field), e.value] for e in decision.expects],
        "sets": sets,
        "inits": [
            [index[b.key.name], counter_field(b.key.name), b.count, list(b.members)]
            + ([[bag_index[b.key.name], bag_index[b.key.name] + 1]] if b.key.name in bag_index else [])
            for b in decision.barriers
        ],
        "outbox": [[m.message_id, outbox_payload(m, run_id, now_ms)] for m in decision.outgoing],
        "history": [history_row(h) for h in decision.history],
        "expire_ms": retention_ms if decision.finished else 0,
        "absent": [
            [index[k.name], member] + ([bag_index[k.name]] if k.name in bag_index else [])
            for k, member in decision.absent
        ],
        "timers": [[t.member, t.due_ms] for t in decision.timers],
        "untimers": list(decision.untimers),
        "claim": decision.claim,
        "remember": decision.remember,
        "dels": [field_name(k, name) for k, name in decision.removes],
        "persist": decision.persist,
    }
    if decision.arrival is not None:
        a = decision.arrival
        body["arrival"] = {
            "k": index[a.key.name],
            "stage": a.key.name,
            "counter": counter_field(a.key.name),
            "member": a.member,
            "value": a.result or "",
        }
        if a.release is not None:  # else the transition releases the barrier itself
            body["arrival"]["release"] = [
                a.release.message_id,
                _continuation_payload(a.release, run_id, now_ms),
            ]
        if a.refill is not None:  # the arrival that makes ``at`` arrived appends the bag's refill
            r = a.refill
            body["arrival"]["refill"] = [
                r.at,
                r.items,
                [r.message.message_id, _continuation_payload(r.message, run_id, now_ms)],
            ]
        if a.key.name in bag_index:
            body["arrival"]["bits"] = bag_index[a.key.name]
            body["arrival"]["list"] = bag_index[a.key.name] + 1
        body["remember"] = False  # the barrier's membership is an arrival's dedupe
        return Spec("saga_arrive", body)
    return Spec("saga_create" if decision.create else "saga_transition", body)


def writes_run(decision: Decision) -> bool:
    """Whether applying ``decision`` writes the run hash (and so counts its revision up): as the
    transition functions decide it from the spec (``build_spec``)."""
    return bool(
        decision.removes
        or any(write.fields for write in decision.writes)
        or decision.barriers
        or decision.arrival is not None
    )


def record_after(record: Mapping[str, str], decision: Decision, rev: int) -> dict[str, str]:
    """The run hash after ``decision`` was applied to ``record`` with nothing else in between, as far as
    :func:`snapshot_from_record` reads it: what the transition functions write to the run hash, in
    their order (deletions, fields, barrier counters, an arrival's count), and its revision after."""
    after = dict(record)
    for key, name in decision.removes:
        after.pop(field_name(key, name), None)
    for write in decision.writes:
        for name, value in write.fields.items():
            after[field_name(write.key, name)] = str(value)
    for barrier in decision.barriers:
        after[counter_field(barrier.key.name)] = str(barrier.count)
    if decision.arrival is not None:
        counter = counter_field(decision.arrival.key.name)
        after[counter] = str(int(after.get(counter, "0")) - 1)
    after["rev"] = str(rev)
    return after


def poison_spec(message_id: str, error: str, now_ms: int) -> Spec:
    """The spec of ``saga_poison``: fail the run a poison message names, with the reason."""
    reason = f"poison message {message_id}: its transition failed on every delivery ({error})"
    return Spec("saga_poison", {"at": now_ms, "mid": message_id, "reason": reason, "error": error})


# A field's text from this size up is parsed once and the value shared; up to the upper bound only, so
# that the few values kept stay small (a bag's context of 10,000 ids is about 150 KB).
_SHARED_FROM, _SHARED_UP_TO = 2048, 1 << 20


@functools.lru_cache(maxsize=16)
def _shared(text: str) -> Any:
    return json.loads(text)


def json_field(text: str) -> Any:
    """A JSON field of a run hash. A large one (a bag's context, a map's results) is parsed once per text
    and the value shared by the snapshots that read it, so a run whose record the shard keeps between
    batches (a bag's arrivals, batch after batch) does not parse its whole context again each time.
    Python keeps a string's hash, so finding a kept record's text again costs no pass over it. Only for
    readers that change no value in place (the engine copies what it builds on): values handed to
    callers (the client's status and wait, the views) are parsed afresh."""
    if _SHARED_FROM <= len(text) <= _SHARED_UP_TO:
        return _shared(text)
    return json.loads(text)


_STAGE_FIELDS = (
    "status",
    "attempt",
    "fence",
    "result",
    "error",
    "items",
    "sent",
    "window",
    "done_at",
    "beat",
)


def _stage_record(fields: Mapping[str, str], parse: Callable[[str], Any]) -> StageRecord:
    return StageRecord(
        status=StageStatus(fields["status"]),
        attempt=int(fields.get("attempt", "1")),
        fence=fields.get("fence", ""),
        result=parse(fields["result"]) if "result" in fields else None,
        error=fields.get("error"),
        items=int(fields["items"]) if "items" in fields else None,
        sent=int(fields["sent"]) if "sent" in fields else None,
        window=int(fields["window"]) if "window" in fields else None,
        completed_at=int(fields["done_at"]) if "done_at" in fields else None,
        beat=fields.get("beat"),
    )


def _run_fields(
    record: Mapping[str, str], parse: Callable[[str], Any], context: Any = None
) -> dict[str, Any]:
    """The snapshot's run-level fields; ``context``: the already parsed context, if it did not change."""
    return {
        "run_id": record["run_id"],
        "shard": record["shard"],
        "digest": record["digest"],
        "status": RunStatus(record["status"]),
        "context": context if context is not None else parse(record.get("context", "{}")),
        "intent": Intent(record["intent"]) if record.get("intent") else None,
        "reason": record.get("reason"),
        "epoch": int(record.get("epoch", "1")),
        "finaliser_index": int(record.get("finaliser_index", "0")),
        "finaliser_failed": record.get("finaliser_failed") == "1",
        "compensations": tuple(json.loads(record["compensations"])) if "compensations" in record else (),
        "compensation_index": int(record.get("compensation_index", "0")),
        "compensation_failed": record.get("compensation_failed") == "1",
        "phase": record.get("phase", ""),
        "tenant": record.get("tenant", "default"),
        "output": parse(record["output"]) if "output" in record else None,
    }


def snapshot_from_record(
    record: Mapping[str, str], map_results: Mapping[str, list[Any]], *, shared: bool = False
) -> RunSnapshot:
    """Build the engine's snapshot from the flat run hash; ``shared``: large JSON fields parsed once and
    shared (:func:`json_field`), for the shard's engine only."""
    parse = json_field if shared else json.loads
    stage_fields: dict[str, dict[str, str]] = {}
    item_attempts: dict[str, int] = {}
    counters: dict[str, int] = {}
    for name, value in record.items():
        # one look at the tag (most fields are a stage's "s:<stage>:<field>"): this runs on every
        # transition, over every field of the run
        if name[1:2] != ":":
            continue
        tag = name[0]
        if tag == "s":
            stage, _, field = name[2:].rpartition(":")
            stage_fields.setdefault(stage, {})[field] = value
        elif tag == "i":
            item_attempts[name[2:]] = int(value)
        elif tag == "b":
            counters[name[2:]] = int(value)
    stages = {
        name: _stage_record(fields, parse) for name, fields in stage_fields.items() if "status" in fields
    }
    return RunSnapshot(
        **_run_fields(record, parse),
        item_attempts=item_attempts,
        stages=stages,
        map_results=map_results,
        barriers=counters,
    )


def snapshot_after(previous: RunSnapshot, record: Mapping[str, str], decision: Decision) -> RunSnapshot:
    """``snapshot_from_record(record, {}, shared=True)``, where ``record`` is what ``decision`` left of
    the record ``previous`` was built from (:func:`record_after`): only what the decision wrote or
    removed is read again, so a run's later transitions do not parse its untouched stages' results
    (and its context) over and over."""
    keys = [write.key for write in decision.writes] + [key for key, _ in decision.removes]
    stages = {key.name for key in keys if key.kind == "stage"}
    items = {key.name for key in keys if key.kind == "item"}
    counters = {key.name for key in keys if key.kind == "counter"}
    counters.update(barrier.key.name for barrier in decision.barriers)
    if decision.arrival is not None:
        counters.add(decision.arrival.key.name)
    changes: dict[str, Any] = {"map_results": {}, "arrivals": {}}
    if any(key.kind == "run" for key in keys):
        run_fields = {name for write in decision.writes if write.key.kind == "run" for name in write.fields}
        run_fields.update(name for key, name in decision.removes if key.kind == "run")
        changes.update(_run_fields(record, json_field, None if "context" in run_fields else previous.context))
    if stages:
        changed = dict(previous.stages)
        for name in stages:
            fields = {f: v for f in _STAGE_FIELDS if (v := record.get(f"s:{name}:{f}")) is not None}
            if "status" in fields:
                changed[name] = _stage_record(fields, json_field)
            else:
                changed.pop(name, None)
        changes["stages"] = changed
    for field, prefix, names, before in (
        ("item_attempts", "i:", items, previous.item_attempts),
        ("barriers", "b:", counters, previous.barriers),
    ):
        if names:
            values = dict(before)
            for name in names:
                value = record.get(prefix + name)
                if value is None:
                    values.pop(name, None)
                else:
                    values[name] = int(value)
            changes[field] = values
    return evolve(previous, **changes)


def ordered_items(members: Mapping[str, str]) -> list[Any]:
    """A map barrier's members (item index -> result JSON) as the list of results in item order."""
    pairs = sorted((int(k), v) for k, v in members.items())
    return [json.loads(v) if v else None for _, v in pairs]


def pinned_versions(record: Mapping[str, str]) -> dict[str, Any]:
    """What a run pinned at creation (invariant 8): ``plan``, the tool versions stored beside its plan
    (DSL, compiler, engine it was compiled for), and ``engine``, the version of the engine that created
    it. None for what a run created before versions were pinned does not record."""
    raw = record.get("plan_versions")
    try:
        plan = json.loads(raw) if raw else None
    except ValueError:
        plan = None
    return {"plan": plan if isinstance(plan, dict) else None, "engine": record.get("engine_version")}

"""The invariants every fault scenario checks afterwards, read straight from Redis.

Each check returns a list of violations, one readable line each (empty: all is well), so a scenario
reports everything that went wrong at once rather than the first assertion. They read only durable
state (run records, histories, barriers, outboxes, the demo's effect ledger) and the published plans,
never the orchestrator's memory, so they hold for any way a scenario got there: outages, crashes at named
points, duplicated or reordered deliveries.

Two kinds of property:

* liveness, which needs time after a fault heals (every run terminal, every outbox drained):
  ``wait_for_convergence`` polls these;
* safety, which no amount of waiting changes (history is append-only): ``check_runs`` checks them once.

The Redis client must decode responses (``decode_responses=True``), like ``Stack.redis``; it may be a
``RedisCluster`` (every read names one key, and the outbox SCAN covers every primary: tests/cluster/).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import redis

from orchestrator.store.facets import STATUSES, static_facets, status_facets
from orchestrator.store.keys import ShardKeys, index_key, plan_key, tenant_field
from orchestrator.store.spec import bag_members
from orchestrator.wire.bodies import DEFAULT_TENANT
from workers.demo.effects import demo_key

TERMINAL = ("completed", "failed")
WORK_STAGES = ("action", "worker", "map")
REJECTION_REASONS = frozenset({"duplicate", "stale", "late", "invalid"})
# Contracts whose demo handlers record their effect in the ledger (workers/demo: _act)
DEMO_EFFECT_CONTRACTS = frozenset(
    {
        "cache.lookup",
        "thumbnail.render",
        "semantic.analyse",
        "metadata.extract",
        "catalogue.publish",
        "audit.run-terminal",
    }
)


@dataclass
class Event:
    kind: str
    stage: str
    attempt: int | None
    detail: dict[str, Any]


@dataclass
class RunView:
    """One run as Redis holds it."""

    run_id: str
    shard: str | None
    record: dict[str, str]
    history: list[Event]
    plan: dict[str, Any] = field(default_factory=dict)

    @property
    def status(self) -> str | None:
        return self.record.get("status")

    @property
    def epoch(self) -> int:
        return int(self.record.get("epoch", "1"))

    def count(self, kind: str, stage: str | None = None, attempt: int | None = None) -> int:
        return sum(
            1
            for e in self.history
            if e.kind == kind
            and (stage is None or e.stage == stage)
            and (attempt is None or e.attempt == attempt)
        )


# ---- reading ------------------------------------------------------------------------------------------


def load_run(r: redis.Redis, prefix: str, run_id: str, plans: dict[str, dict[str, Any]]) -> RunView:
    shard: str | None = r.get(index_key(prefix, run_id))  # type: ignore[assignment]
    if shard is None:
        return RunView(run_id, None, {}, [])
    keys = ShardKeys(prefix, shard)
    record: dict[str, str] = r.hgetall(keys.run(run_id))  # type: ignore[assignment]
    rows: list[tuple[str, dict[str, str]]] = r.xrange(keys.history(run_id))  # type: ignore[assignment]
    history = [
        Event(
            f["kind"],
            f.get("stage", ""),
            int(f["attempt"]) if f.get("attempt") else None,
            json.loads(f.get("detail") or "{}"),
        )
        for _, f in rows
    ]
    digest = record.get("digest")
    if digest and digest not in plans:
        raw: str | None = r.get(plan_key(prefix, digest))  # type: ignore[assignment]
        plans[digest] = json.loads(raw)["plan"] if raw else {}
    return RunView(run_id, shard, record, history, plans.get(digest or "", {}))


def load_runs(r: redis.Redis, prefix: str, run_ids: Iterable[str]) -> list[RunView]:
    plans: dict[str, dict[str, Any]] = {}
    return [load_run(r, prefix, run_id, plans) for run_id in run_ids]


def unsent(r: redis.Redis, prefix: str) -> dict[str, list[str]]:
    """Outbox entries still waiting to be published, by shard outbox key: message id (kind, run)."""
    found: dict[str, list[str]] = {}
    for key in r.scan_iter(match=f"{prefix}:{{*}}:outbox", count=1000):
        entries: dict[str, str] = r.hgetall(key)  # type: ignore[assignment]
        if entries:
            found[str(key)] = [
                f"{mid} ({json.loads(p).get('kind')}, run {json.loads(p).get('run_id')})"
                for mid, p in sorted(entries.items())
            ]
    return found


# ---- liveness -------------------------------------------------------------------------------------------


def pending(r: redis.Redis, prefix: str, run_ids: Iterable[str]) -> list[str]:
    """What still has to happen: runs not created or not yet terminal, outbox entries not yet published
    (one line per kind of problem, naming the first few)."""
    never, unfinished = [], []
    for run in load_runs(r, prefix, run_ids):
        if run.shard is None:
            never.append(run.run_id)
        elif run.status not in TERMINAL:
            unfinished.append(f"{run.run_id} ({run.status or 'no record'})")
    problems = [
        f"{len(found)} runs {what}: {', '.join(found[:8])}{' ...' if len(found) > 8 else ''}"
        for what, found in (("never created", never), ("not finished", unfinished))
        if found
    ]
    for key, entries in unsent(r, prefix).items():
        problems.append(f"{key}: {len(entries)} unsent: {', '.join(entries[:5])}")
    return problems


def wait_for_convergence(
    r: redis.Redis, prefix: str, run_ids: Iterable[str], timeout_s: float, interval_s: float = 0.5
) -> list[str]:
    """Poll until every run is terminal and every outbox is empty; return what is still pending then.

    The relay re-publishes an entry only once it is a couple of seconds old, so a drained outbox can
    lag the runs' completion by a relay interval."""
    wanted = list(run_ids)
    deadline = time.monotonic() + timeout_s
    while True:
        left = pending(r, prefix, wanted)
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(interval_s)


# ---- safety -------------------------------------------------------------------------------------------


def check_runs(
    r: redis.Redis,
    prefix: str,
    run_ids: Iterable[str],
    *,
    expect_state: str | None = "completed",
    effects: bool = True,
    all_runs: bool = False,
) -> list[str]:
    """Every invariant of the given runs; ``[]`` when all hold.

    ``expect_state``: the terminal state every run must end in (None: either). ``effects``: check the
    demo's effect ledger (off when the worker runs with SAGA_DEMO_EFFECTS=0); only with ``all_runs``,
    which says these are all the runs under ``prefix`` (the ledger is shared by all of them)."""
    runs = load_runs(r, prefix, run_ids)
    violations: list[str] = []
    for run in runs:
        found = run_violations(r, prefix, run, expect_state)
        violations += [f"run {run.run_id}: {v}" for v in found]
    if effects and all_runs:
        violations += effect_violations(r, prefix, runs)
    if all_runs:
        violations += live_count_violations(r, prefix, runs)
    violations += index_violations(r, prefix, runs)
    for key, entries in unsent(r, prefix).items():
        violations.append(f"{key}: {len(entries)} entries never published: {', '.join(entries[:5])}")
    return violations


def live_count_violations(r: redis.Redis, prefix: str, runs: list[RunView]) -> list[str]:
    """Each shard's count of unfinished runs per plan digest (what ``saga definitions list`` shows
    draining) and per tenant (what a tenant's starts are admitted against) equals its runs that have not
    ended, given every run under ``prefix``."""
    expected: dict[str, Counter[str]] = {}
    for run in runs:
        if run.shard is not None:
            shard = expected.setdefault(run.shard, Counter())
            if run.status not in TERMINAL and run.record.get("digest"):
                shard[run.record["digest"]] += 1
                shard[tenant_field(run.record.get("tenant") or DEFAULT_TENANT)] += 1
    found = []
    for shard, want in sorted(expected.items()):
        counted = Counter({d: int(n) for d, n in r.hgetall(ShardKeys(prefix, shard).live()).items()})
        if counted != want:
            found.append(
                f"shard {shard}: unfinished runs counted {dict(counted)}, but {dict(want)} have not ended"
            )
    return found


def index_violations(r: redis.Redis, prefix: str, runs: list[RunView]) -> list[str]:
    """Each run is in the listing indexes of its definition, its version and its status, and in no
    index of another status (what ``saga runs`` and the API's filtered listings read)."""
    checks: list[tuple[str, str, str, bool]] = []  # (run id, index, why, expected present)
    for run in runs:
        definition, version, status = (run.record.get(f) for f in ("definition", "version", "status"))
        if run.shard is None or not definition or not version or not status:
            continue
        keys = ShardKeys(prefix, run.shard)
        own = {*static_facets(keys, definition, version), *status_facets(keys, definition, version, status)}
        others = {
            key
            for other in STATUSES
            if other != status
            for key in status_facets(keys, definition, version, other)
        }
        checks += [(run.run_id, key, "missing from", True) for key in sorted(own)]
        checks += [(run.run_id, key, "still in", False) for key in sorted(others)]
    if not checks:
        return []
    pipe = r.pipeline(transaction=False)
    for run_id, key, _, _ in checks:
        pipe.zscore(key, run_id)
    found = []
    for (run_id, key, why, wanted), score in zip(checks, pipe.execute(), strict=True):
        if (score is not None) != wanted:
            found.append(f"run {run_id}: {why} listing index {key}")
    return found


def run_violations(r: redis.Redis, prefix: str, run: RunView, expect_state: str | None) -> list[str]:
    if run.shard is None or not run.record:
        return ["no run record (never created, or expired)"]
    found = []
    if not run.plan.get("stages"):
        found.append(f"plan {run.record.get('digest')} not found: its joins and bags cannot be checked")
    if run.record.get("shard") != run.shard:
        found.append(f"record says shard {run.record.get('shard')}, the index says {run.shard}")
    if run.status not in TERMINAL:
        found.append(f"not terminal: {run.status}")
    elif expect_state and run.status != expect_state:
        found.append(f"ended {run.status}, expected {expect_state} (reason: {run.record.get('reason')})")
    found += _lifecycle(run)
    found += _accepted_once(run)
    found += _barriers(r, prefix, run)
    return found


def epochs(history: list[Event]) -> list[list[Event]]:
    """History cut at each ``run.redriven``: a re-driven run starts its stages again in a new epoch, where
    attempt numbers (and intents, and ends) begin anew."""
    found: list[list[Event]] = [[]]
    for e in history:
        if e.kind == "run.redriven":
            found.append([])
        found[-1].append(e)
    return found


def _lifecycle(run: RunView) -> list[str]:
    """One start; per epoch one intent and one end; the run's status is its last epoch's end, after which
    only rejections and acknowledged cancellations follow; known rejection reasons."""
    found = []
    kinds = [e.kind for e in run.history]
    if kinds[:1] != ["run.started"] or kinds.count("run.started") != 1:
        found.append(f"history must open with exactly one run.started: {kinds[:3]}...")
    segments = epochs(run.history)
    for number, segment in enumerate(segments, start=1):
        where = f" in epoch {number}" if len(segments) > 1 else ""
        found += [f"{v}{where}" for v in _epoch(segment, run.status, last=number == len(segments))]
    for e in run.history:
        if e.kind == "callback.rejected" and e.detail.get("reason") not in REJECTION_REASONS:
            found.append(f"callback.rejected with unknown reason {e.detail.get('reason')!r}")
    return found


def _epoch(segment: list[Event], status: str | None, *, last: bool) -> list[str]:
    """One epoch's intent and end: the ``last`` ends as the run's ``status`` says; an earlier one must have
    ended failed (only a failed run is re-driven)."""
    kinds = [e.kind for e in segment]
    ends = [k for k in kinds if k in ("run.completed", "run.failed")]
    found = []
    if kinds.count("intent.set") > 1:
        found.append(f"{kinds.count('intent.set')} intent.set events")
    if len(ends) > 1:
        found.append(f"{len(ends)} terminal events: {ends}")
    elif not last:
        if ends != ["run.failed"]:
            found.append(f"re-driven without having ended failed: ...{kinds[-3:]}")
    elif status not in TERMINAL:
        if ends:
            found.append(f"status {status} but the run ended: {ends}")
    elif ends != [f"run.{status}"]:
        found.append(f"status {status} but terminal events {ends}")
    else:
        after = kinds[kinds.index(ends[0]) + 1 :]
        # a worker confirming that a fenced-off attempt stopped changes nothing, and may well come last:
        # a thread-pool handler reports once its thread is told, the run ends without waiting for it
        if any(k not in ("callback.rejected", "cancellation.acknowledged") for k in after):
            found.append(f"events after the run ended: {after}")
    return found


def _accepted_once(run: RunView) -> list[str]:
    """Per epoch: at most one dispatch and one accepted outcome per (stage, attempt, item), one result per
    finaliser, each barrier released at most once; and a completed run released, in its last epoch,
    exactly once every barrier it opened there, but a bag that failed (a join that accepts a failed
    branch let the run complete), which is never released."""
    found = []
    segments = epochs(run.history)
    for number, segment in enumerate(segments, start=1):
        where = f" in epoch {number}" if len(segments) > 1 else ""
        dispatched = Counter((e.stage, e.attempt) for e in segment if e.kind == "stage.dispatched")
        outcomes = Counter(  # a bag's items settle one by one, each under its own attempt
            (e.stage, e.attempt, e.detail.get("item"))
            for e in segment
            if e.kind in ("stage.completed", "stage.failed")
        )
        finalisers = Counter(
            e.stage for e in segment if e.kind in ("finaliser.completed", "finaliser.failed")
        )
        for what, counts in (
            ("dispatches", dispatched),
            ("accepted results", outcomes),
            ("results", finalisers),
        ):
            found += [f"{n} {what} for {key}{where}" for key, n in counts.items() if n > 1]
        last_and_completed = number == len(segments) and run.status == "completed"
        for name, stage in run.plan.get("stages", {}).items():
            if stage.get("type") == "join":
                released = sum(e.kind == "join.released" and e.stage == name for e in segment)
                opened = sum(e.kind == "fork.released" and e.stage == stage.get("fork") for e in segment)
                what = f"join {name} released {released} times (its fork released {opened}){where}"
            elif stage.get("type") == "map":
                released = sum(e.kind == "stage.completed" and e.stage == name for e in segment)
                opened = sum(e.kind == "stage.dispatched" and e.stage == name for e in segment)
                what = f"bag {name} released {released} times (dispatched {opened}){where}"
            else:
                continue
            failed_bag = stage.get("type") == "map" and run.record.get(f"s:{name}:status") == "failed"
            expected = 0 if failed_bag else 1
            if released > 1 or (last_and_completed and opened and released != expected):
                found.append(what)
    return found


def barrier_members(r: redis.Redis, keys: ShardKeys, run_id: str, stage: str) -> dict[str, str]:
    """What arrived at a barrier, as ``RedisStore.barrier_members`` reads it: a join's branches (-> ''),
    a map's items (index -> result JSON) from its hash and its results list."""
    in_hash: dict[str, str] = r.hgetall(keys.barrier(run_id, stage))  # type: ignore[assignment]
    return bag_members(in_hash, _bag_results(r, keys, run_id, stage))


def _bag_results(r: redis.Redis, keys: ShardKeys, run_id: str, stage: str) -> list[str]:
    return r.lrange(keys.bag_results(run_id, stage), 0, -1)  # type: ignore[return-value]


def _barriers(r: redis.Redis, prefix: str, run: RunView) -> list[str]:
    """A barrier's counter never goes below zero; a released barrier holds exactly its members; a bag's
    bitmap marks exactly the items its results list holds, each once."""
    assert run.shard is not None
    found = []
    keys = ShardKeys(prefix, run.shard)
    for name, stage in run.plan.get("stages", {}).items():
        kind = stage.get("type")
        counter = run.record.get(f"b:{name}")
        if kind not in ("join", "map") or counter is None:
            continue
        if int(counter) < 0:
            found.append(f"barrier {name}: counter {counter} below zero (an arrival counted twice)")
        if run.record.get(f"s:{name}:status") != "completed":
            continue
        expected = len(stage["required"]) if kind == "join" else int(run.record.get(f"s:{name}:items", "-1"))
        in_hash: dict[str, str] = r.hgetall(keys.barrier(run.run_id, name))  # type: ignore[assignment]
        results = _bag_results(r, keys, run.run_id, name) if kind == "map" else []
        members = len(bag_members(in_hash, results))
        if kind == "map":
            found += _bag_form(r, keys.bag_arrived(run.run_id, name), name, results)
        if int(counter) != 0 or members != expected:
            found.append(f"barrier {name} released with counter {counter} and {members}/{expected} members")
    return found


def _bag_form(r: redis.Redis, bitmap: str, stage: str, results: list[str]) -> list[str]:
    """A bag's results list holds one entry per item, and its bitmap marks exactly those items."""
    items = [int(entry.partition(":")[0]) for entry in results]
    pipe = r.pipeline(transaction=False)
    pipe.bitcount(bitmap)
    for item in items:
        pipe.getbit(bitmap, item)
    marked, *bits = pipe.execute()
    found = []
    if len(set(items)) != len(items):
        found.append(f"barrier {stage}: an item's result listed twice ({len(items) - len(set(items))} extra)")
    unmarked = [i for i, bit in zip(items, bits, strict=True) if not bit]
    if int(marked) != len(set(items)) or unmarked:
        found.append(f"barrier {stage}: {marked} items marked arrived, {len(set(items))} results listed")
    return found


def _contract(ref: str) -> str:
    return ref.split("@", 1)[0]


def task_counts(run: RunView) -> tuple[Counter[str], Counter[str]]:
    """Per contract, the tasks the run dispatched and those whose success it accepted (a success means the
    handler ran to the end, so a demo handler recorded its effect). Counted, not named: the ledger is
    keyed by the tasks' idempotency keys, whose scheme is the engine's business."""
    stages = run.plan.get("stages", {})
    finalisers = [_contract(ref) for ref in run.plan.get("finalisers") or []]
    dispatched: Counter[str] = Counter()
    succeeded: Counter[str] = Counter()
    for e in run.history:
        if e.kind in ("finaliser.dispatched", "finaliser.completed"):
            index = int(e.stage.partition(":")[2] or -1)
            contract = finalisers[index] if 0 <= index < len(finalisers) else "(unknown finaliser)"
            (dispatched if e.kind == "finaliser.dispatched" else succeeded)[contract] += 1
            continue
        stage = stages.get(e.stage, {})
        kinds = ("stage.dispatched", "items.dispatched", "stage.completed")
        if e.kind not in kinds or stage.get("type") not in WORK_STAGES:
            continue
        tasks = 1
        if e.kind == "stage.dispatched":  # a bag sent in chunks sent its first one ("sent") at once
            tasks = int(e.detail.get("sent", e.detail.get("items", 1)))
        elif e.kind == "items.dispatched":  # and each later one with a refill
            tasks = int(e.detail["last"]) - int(e.detail["first"]) + 1
        if e.kind == "stage.completed" and stage["type"] == "map":
            tasks = int(run.record.get(f"s:{e.stage}:items", "0"))  # an empty bag completes with no task
        contract = _contract(stage.get("action") or stage["worker"])
        (succeeded if e.kind == "stage.completed" else dispatched)[contract] += tasks
    return dispatched, succeeded


def effect_violations(
    r: redis.Redis, prefix: str, runs: list[RunView], contracts: frozenset[str] = DEMO_EFFECT_CONTRACTS
) -> list[str]:
    """The demo's effect ledger (one entry per idempotency key, so a redelivered task that acts again adds
    nothing) against what the runs did, per contract: every task whose success was accepted acted, and no
    more tasks acted than committed transitions dispatched; the ledger's counts agree with its entries.

    The ledger is shared by every run under ``prefix``: ``runs`` must be all of them."""
    ledger: dict[str, str] = r.hgetall(demo_key(prefix, "effects"))  # type: ignore[assignment]
    counts: dict[str, str] = r.hgetall(demo_key(prefix, "counts"))  # type: ignore[assignment]
    acted = Counter(ledger.values())
    dispatched: Counter[str] = Counter()
    succeeded: Counter[str] = Counter()
    for run in runs:
        d, s = task_counts(run)
        dispatched, succeeded = dispatched + d, succeeded + s
    found = []
    for contract in sorted(contracts & (set(acted) | set(dispatched))):
        if acted[contract] < succeeded[contract]:
            found.append(
                f"{contract}: {succeeded[contract]} successes accepted but {acted[contract]} effects "
                "recorded: a result was accepted for a task that never acted"
            )
        if acted[contract] > dispatched[contract]:
            found.append(
                f"{contract}: {acted[contract]} effects recorded but {dispatched[contract]} tasks "
                "dispatched: a task acted that no committed transition dispatched"
            )
    for contract in sorted(set(counts) | set(acted)):
        if int(counts.get(contract, 0)) != acted[contract]:
            found.append(
                f"{contract}: the ledger counts {counts.get(contract, 0)} effects but holds {acted[contract]}"
            )
    return found


def dead_letters(depths: Mapping[str, int]) -> list[str]:
    """Messages parked where healthy messages must never go: every ``*.dlq`` and the rejected queue."""
    return [
        f"queue {name} holds {n} messages"
        for name, n in sorted(depths.items())
        if n and name.endswith((".dlq", ".rejected"))
    ]


# ---- for tests ----------------------------------------------------------------------------------------


def assert_no_violations(violations: list[str], what: str, *, limit: int = 40) -> None:
    """Fail with every violation listed (the first ``limit``), after printing them all."""
    if not violations:
        return
    print(f"{len(violations)} violations of {what}:")
    for line in violations[:500]:
        print(f"  - {line}")
    shown = "\n  - ".join(violations[:limit])
    more = f"\n  ... and {len(violations) - limit} more" if len(violations) > limit else ""
    raise AssertionError(f"{len(violations)} violations of {what}:\n  - {shown}{more}")


def assert_sound(r: redis.Redis, prefix: str, run_ids: list[str], timeout_s: float = 30.0) -> None:
    """Once the runs have settled (terminal, every outbox drained: a run's last events are published just
    after its end is announced), the shared checks hold over them."""
    assert_no_violations(wait_for_convergence(r, prefix, run_ids, timeout_s), "liveness")
    assert_no_violations(check_runs(r, prefix, run_ids), "the shared invariants")

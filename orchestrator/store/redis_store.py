"""The Redis side of the orchestrator: load the ``saga`` Functions library, read run snapshots, apply
decided transitions atomically, and keep plans and the run-id index.

Decisions stay out of this module (the engine decides); it only translates. Every state change of a run
is one FCALL (a round's arrivals of one run share one, each still checked and applied on its own). The
library is loaded at start-up and again whenever Redis answers that a function is missing: a restarted
Redis that persists nothing has lost it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from typing import TYPE_CHECKING, Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from orchestrator import metrics
from orchestrator.engine import clocks
from orchestrator.engine.model import Decision, RunSnapshot
from orchestrator.engine.plan import Plan, typed_plan
from orchestrator.errors import SagaError
from orchestrator.governance.store import digests_key, parse_digest_info
from orchestrator.store.connect import announces_run_ends, is_cluster, load_function_library
from orchestrator.store.facets import changes_status, index_spec
from orchestrator.store.keys import (
    REFUSED,
    ShardKeys,
    finished_channel,
    index_key,
    plan_key,
    refused_key,
    tenant_field,
)
from orchestrator.store.lane import Command, Lane
from orchestrator.store.replies import APPLIED, Reply
from orchestrator.trace import TRACE

if TYPE_CHECKING:
    from orchestrator.governance.store import DigestInfo
from orchestrator.store.spec import (
    Spec,
    bag_members,
    build_spec,
    ordered_items,
    poison_spec,
    snapshot_from_record,
)

log = logging.getLogger(__name__)
LUA_FILES = ("helpers.lua", "create.lua", "transition.lua", "arrive.lua", "mark_sent.lua", "poison.lua")


class PlanNotFound(SagaError):
    """Raised when a run or a start names a plan digest or definition that was never published."""

    code = "plan_not_found"

    def __init__(self, what: str) -> None:
        self.what = what
        super().__init__(f"no published plan for {what}; publish it with 'saga definitions publish FILE'")


def _lua_sources() -> str:
    folder = resources.files("orchestrator.store") / "lua"
    return "\n".join((folder / name).read_text(encoding="utf-8") for name in LUA_FILES)


# Functions are global to a Redis server. Naming the library and its functions after a hash of their
# source lets processes of two releases share a Redis during a rolling upgrade: each calls its own code,
# and loading one never replaces the other's.
LIBRARY_VERSION = hashlib.sha256(_lua_sources().encode()).hexdigest()[:10]
LIBRARY_NAME = f"saga_{LIBRARY_VERSION}"


def function_name(base: str) -> str:
    """``saga_transition`` -> ``saga_<version>_transition`` (the name this release registered)."""
    return base.replace("saga_", f"{LIBRARY_NAME}_", 1)


def library_source() -> str:
    """The one Functions library, assembled from the shipped ``.lua`` files (helpers first)."""
    body = _lua_sources().replace(
        "redis.register_function('saga_", f"redis.register_function('{LIBRARY_NAME}_"
    )
    return f"#!lua name={LIBRARY_NAME}\n{body}"


@dataclass(frozen=True)
class ApplyResult:
    code: Reply
    detail: str
    rev: int | None = None  # the run's revision after an applied transition (None: nothing written)

    @property
    def applied(self) -> bool:
        return self.code == APPLIED


#: Runs whose transition KEYS the store keeps built (then it starts again): a few MB at most.
TRANSITION_KEYS_KEPT = 8192


@dataclass
class RedisStore:
    client: aioredis.Redis
    prefix: str = "saga"
    retention_ms: int = 7 * 86_400_000
    #: Round trips of the shard's hot path on connections the store keeps (``lane.py``): for a long-lived
    #: process that makes many (the orchestrator); ignored on a Redis Cluster.
    direct: bool = False
    _lane: Lane | None = field(init=False, default=None, repr=False)
    _plans: dict[str, dict[str, Any]] = field(default_factory=dict)
    _typed_plans: dict[str, Plan] = field(default_factory=dict)
    _plan_versions: dict[str, dict[str, str]] = field(default_factory=dict)
    # the KEYS of recent runs' transitions: a run makes several in a few seconds, each naming the same keys
    _transition_keys: dict[tuple[str, str, tuple[str, ...], tuple[str, ...]], tuple[str, ...]] = field(
        default_factory=dict
    )

    def __post_init__(self) -> None:
        self._lane = Lane(self.client) if self.direct and not is_cluster(self.client) else None
        self._announces = announces_run_ends(self.client)

    def keys(self, shard: str) -> ShardKeys:
        return ShardKeys(self.prefix, shard)

    async def _round_trip(self, commands: list[Command]) -> list[Any]:
        """``commands`` in one round trip, each reply in order (a refused command's error as its
        reply): on the lane where the store has one, else in a pipeline."""
        if not commands:
            return []
        if self._lane is not None:
            return await self._lane.execute(commands)
        async with self.client.pipeline(transaction=False) as pipe:
            for command in commands:
                pipe.execute_command(*command)
            return list(await pipe.execute(raise_on_error=False))

    def _keys_of(self, shard: str, run_id: str, plan: Plan) -> list[str]:
        """``ShardKeys.transition_keys`` of a run, built once while the run is recent."""
        key = (shard, run_id, plan.barriers, plan.bags)
        found = self._transition_keys.get(key)
        if found is None:
            if len(self._transition_keys) >= TRANSITION_KEYS_KEPT:
                self._transition_keys.clear()
            found = tuple(self.keys(shard).transition_keys(run_id, plan.barriers, plan.bags))
            self._transition_keys[key] = found
        return list(found)

    async def load_library(self) -> None:
        await load_function_library(self.client, library_source())

    async def _fcall(self, spec: Spec, keys: list[str]) -> list[Any]:
        started = time.perf_counter()
        result = list(await self._function(spec.function, keys, [spec.encode()]))
        metrics.lua_call(spec.function, time.perf_counter() - started)
        return result

    async def _function(self, base: str, keys: list[str], args: list[str]) -> Any:
        """FCALL this release's ``base`` function (every call into the library goes through here but
        the pipelined ones, which come back here when the library is missing)."""
        name = function_name(base)
        if self._lane is not None:
            command = ("FCALL", name, len(keys), *keys, *args)
            (reply,) = await self._lane.execute([command])
            if isinstance(reply, ResponseError) and "function not found" in str(reply).lower():
                await self.load_library()  # Redis restarted without persistence: load and try once more
                (reply,) = await self._lane.execute([command])
            if isinstance(reply, Exception):
                raise reply
            return reply
        try:
            return await self.client.fcall(name, len(keys), *keys, *args)  # type: ignore[misc]
        except ResponseError as exc:
            if "function not found" not in str(exc).lower():
                raise
            await self.load_library()  # Redis restarted without persistence: load and try once more
            return await self.client.fcall(name, len(keys), *keys, *args)  # type: ignore[misc]

    # ---- runs --------------------------------------------------------------------------------------

    async def snapshot(
        self, shard: str, run_id: str, map_stage: str | None = None, members_of: tuple[str, ...] = ()
    ) -> RunSnapshot | None:
        """A run's snapshot; ``map_stage``: with that map's item results; ``members_of``: with the
        members that arrived at those barriers (a nudge re-sends a bag's missing items)."""
        keys = self.keys(shard)
        record = await self.client.hgetall(keys.run(run_id))  # type: ignore[misc]
        if not record:
            return None
        maps: dict[str, list[Any]] = {}
        if map_stage is not None:
            maps[map_stage] = ordered_items(await self.barrier_members(shard, run_id, map_stage))
        snapshot = snapshot_from_record(_text(record), maps)
        if not members_of:
            return snapshot
        return dataclasses.replace(snapshot, arrivals=await self.arrivals(shard, run_id, members_of))

    async def run_digest(self, shard: str, run_id: str) -> str | None:
        """The plan digest run ``run_id`` is pinned to; None: no such run on ``shard``. One field, for
        the callers that only ask whether the run exists and on which plan."""
        digest = await self.client.hget(self.keys(shard).run(run_id), "digest")  # type: ignore[misc]
        return _str(digest) if digest is not None else None

    async def barrier_members(self, shard: str, run_id: str, stage: str) -> dict[str, str]:
        """What arrived at a barrier: a join's branches (-> ''), a map's items (index -> result JSON)."""
        keys = self.keys(shard)
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.hgetall(keys.barrier(run_id, stage))
            pipe.lrange(keys.bag_results(run_id, stage), 0, -1)
            in_hash, results = await pipe.execute()
        return bag_members(_text(in_hash), map(_str, results))

    async def arrivals(self, shard: str, run_id: str, bags: tuple[str, ...]) -> dict[str, frozenset[str]]:
        """The items that arrived at each of the maps ``bags``: their bitmaps' set bits, and the items of
        a bag kept in its hash. Two round trips (the bitmaps' lengths, then their bytes as integers: the
        client decodes replies as text, which a bitmap is not)."""
        keys = self.keys(shard)
        async with self.client.pipeline(transaction=False) as pipe:
            for bag in bags:
                pipe.hkeys(keys.barrier(run_id, bag))
                pipe.strlen(keys.bag_arrived(run_id, bag))
            replies = await pipe.execute()
        async with self.client.pipeline(transaction=False) as pipe:
            for i, bag in enumerate(bags):
                reads = [arg for byte in range(int(replies[2 * i + 1])) for arg in ("GET", "u8", f"#{byte}")]
                pipe.execute_command("BITFIELD_RO", keys.bag_arrived(run_id, bag), *reads)
            bitmaps = await pipe.execute()
        return {
            bag: frozenset(map(_str, replies[2 * i])) | set_bits(bitmaps[i] or [])
            for i, bag in enumerate(bags)
        }

    async def records(self, shard: str, run_ids: list[str]) -> list[dict[str, str] | None]:
        """The run hashes of ``run_ids`` as they are (None: no such run), in one round trip."""
        keys = self.keys(shard)
        replies = _answers(await self._round_trip([("HGETALL", keys.run(run_id)) for run_id in run_ids]))
        return [_text(record) if record else None for record in replies]

    async def apply_many(
        self, shard: str, transitions: list[tuple[str, str, Decision, Plan]], now_ms: int
    ) -> list[ApplyResult]:
        """Many transitions pipelined, each still checked and applied on its own, in order: a run's
        consecutive arrivals (a bag's item results) in one FCALL of ``saga_arrive_many``, every other
        transition in an FCALL of its own."""
        calls = _grouped([self._call(shard, *transition, now_ms) for transition in transitions])
        started = time.perf_counter()
        # the round trip alone, inside the shard's "lua" step (which also builds the specs and keeps
        # the records the replies bring forward)
        with TRACE.span("fcall", (message_id for _, message_id, *_ in transitions)):
            replies = await self._round_trip(
                [
                    ("FCALL", function_name(spec.function), len(keys), *keys, spec.encode())
                    for spec, keys in calls
                ]
            )
        metrics.lua_call("pipeline", time.perf_counter() - started)
        results = []
        for (spec, keys), reply in zip(calls, replies, strict=True):
            answer = reply
            # Any exception, not only a ResponseError: a cluster pipeline also hands back a node's
            # ConnectionError (a primary gone) or a redirection that never settled (a slot moving) in
            # its replies, which is Redis trouble to raise, not an answer to index.
            if isinstance(reply, Exception):
                if not isinstance(reply, ResponseError) or "function not found" not in str(reply).lower():
                    raise reply
                answer = await self._fcall(spec, keys)  # reloads the library and retries this one
            if spec.function == ARRIVE_MANY:
                results += [_result(list(one)) for one in answer]
            else:
                results.append(_result(answer))
        return results

    async def apply(
        self,
        shard: str,
        run_id: str,
        message_id: str,
        decision: Decision,
        plan: Plan,
        now_ms: int,
    ) -> ApplyResult:
        """One transition on its own (the shard pipelines a round's with ``apply_many``)."""
        return _result(await self._fcall(*self._call(shard, run_id, message_id, decision, plan, now_ms)))

    def _call(
        self,
        shard: str,
        run_id: str,
        message_id: str,
        decision: Decision,
        plan: Plan,
        now_ms: int,
    ) -> tuple[Spec, list[str]]:
        """The spec of one transition and the KEYS it touches."""
        spec = build_spec(
            decision,
            run_id=run_id,
            message_id=message_id,
            now_ms=now_ms,
            barriers=plan.barriers,
            retention_ms=self.retention_ms,
            bags=plan.bags,
        )
        keys = self._keys_of(shard, run_id, plan)
        if decision.finished and self._announces:
            spec.body["finished"] = finished_channel(self.prefix, run_id)
        if changes_status(decision):
            spec.body["index"], facets = index_spec(
                self.keys(shard), run_id, plan.name, plan.version, len(keys) + 1
            )
            keys += facets
        return spec, keys

    async def history(self, shard: str, run_id: str) -> list[dict[str, Any]]:
        rows = await self.client.xrange(self.keys(shard).history(run_id))
        events = []
        for seq, (entry_id, fields) in enumerate(rows, start=1):
            f = _text(fields)
            event: dict[str, Any] = {
                "seq": seq,
                "id": _str(entry_id),
                "at": int(f["at"]),
                "kind": f["kind"],
                "stage": f["stage"] or None,
                "attempt": int(f["attempt"]) if f["attempt"] else None,
            }
            event.update(json.loads(f["detail"]))
            events.append(event)
        return events

    async def poison(self, shard: str, run_id: str, message_id: str, error: str, now_ms: int) -> Reply:
        """Mark the run a poison message names failed (lua/poison.lua); returns the Lua code."""
        spec = poison_spec(message_id, error, now_ms)
        if self._announces:
            spec.body["finished"] = finished_channel(self.prefix, run_id)
        keys = self.keys(shard).transition_keys(run_id, [])
        definition, version = await self.client.hmget(self.keys(shard).run(run_id), ["definition", "version"])  # type: ignore[misc]
        if definition is not None and version is not None:  # the run's listing indexes follow its status
            spec.body["index"], facets = index_spec(
                self.keys(shard), run_id, _str(definition), _str(version), len(keys) + 1
            )
            keys += facets
        code, _ = await self._fcall(spec, keys)
        return Reply(int(code))

    # ---- timers ------------------------------------------------------------------------------------

    async def due_timers(self, shards: list[str], now_ms: int, limit: int = 256) -> list[list[str]]:
        """Per shard, the members of its timer set due by ``now_ms``, earliest first: one round trip for
        all of them (a process polls every shard it serves several times a second). A shard whose
        read failed (its slot failing over, on a Redis Cluster) has none this time; the others do."""
        if not shards:
            return []
        async with self.client.pipeline(transaction=False) as pipe:
            for shard in shards:
                pipe.zrangebyscore(self.keys(shard).timers(), "-inf", now_ms, start=0, num=limit)
            found = await pipe.execute(raise_on_error=False)
        return [[] if isinstance(members, Exception) else [_str(m) for m in members] for members in found]

    async def timer_runs(self, shard: str) -> set[str]:
        """The runs of the shard that have a timer set."""
        members = await self.client.zrange(self.keys(shard).timers(), 0, -1)
        return {parsed[0] for m in members if (parsed := clocks.parse_member(_str(m))) is not None}

    async def drop_timer(self, shard: str, member: str) -> None:
        """Forget a timer whose run no longer exists (expired) or that is not one of ours."""
        await self.client.zrem(self.keys(shard).timers(), member)

    async def depths(self, shard: str, now_ms: int) -> tuple[int, int]:
        """The shard's outbox entries not marked sent, and its timers due by ``now_ms`` (one round trip)."""
        keys = self.keys(shard)
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.hlen(keys.outbox())
            pipe.zcount(keys.timers(), "-inf", now_ms)
            outbox, due = await pipe.execute()
        return int(outbox), int(due)

    async def run_ids(self, shard: str) -> list[str]:
        return [_str(r) for r in await self.client.zrange(self.keys(shard).runs(), 0, -1)]

    # ---- outbox ------------------------------------------------------------------------------------

    async def outbox(self, shard: str) -> dict[str, dict[str, Any]]:
        raw = await self.client.hgetall(self.keys(shard).outbox())  # type: ignore[misc]
        return {k: json.loads(v) for k, v in _text(raw).items()}

    async def mark_sent(self, shard: str, message_ids: list[str]) -> int:
        if not message_ids:
            return 0
        started = time.perf_counter()
        marked = int(await self._function("saga_mark_sent", [self.keys(shard).outbox()], message_ids))
        metrics.lua_call("saga_mark_sent", time.perf_counter() - started)
        return marked

    # ---- index and plans ---------------------------------------------------------------------------

    async def claim(self, run_id: str, shard: str) -> str:
        """Claim ``run_id`` for ``shard``; returns the shard that owns it (another, if claimed before)."""
        key = index_key(self.prefix, run_id)
        if await self.client.set(key, shard, nx=True):
            return shard
        owner = await self.client.get(key)
        return _str(owner) if owner is not None else shard

    async def claim_fresh(self, run_ids: list[str], shard: str) -> list[tuple[str, bool]]:
        """:meth:`claim` for many runs in two round trips at most (on the lane, where the store has one),
        saying for each whether this very call claimed it (``True``: nobody had, so no record of the run
        can exist but one whose claim expired before it, which creating the run finds all the same). A
        round trip sent again after a dropped connection can answer ``False`` for a claim its first
        sending made: the caller then reads the run first, finds none and creates it all the same."""
        keys = [index_key(self.prefix, run_id) for run_id in run_ids]
        won = _answers(await self._round_trip([("SET", key, shard, "NX") for key in keys]))
        lost = [key for key, ok in zip(keys, won, strict=True) if not ok]
        # GETs, not MGET: the claims are spread over the slots of a cluster
        owners = dict(
            zip(lost, _answers(await self._round_trip([("GET", key) for key in lost])), strict=True)
        )
        return [
            (shard, True) if ok else (_str(owners.get(key) or shard), False)
            for key, ok in zip(keys, won, strict=True)
        ]

    async def digest_info(self, digests: list[str]) -> list[DigestInfo | None]:
        """For each plan digest, its definition version and lifecycle state (None: no version publishes
        it), in one round trip on the lane: a shard reads them for every batch of starts."""
        if not digests:
            return []
        (raw,) = _answers(await self._round_trip([("HMGET", digests_key(self.prefix), *digests)]))
        return [parse_digest_info(r) for r in raw]

    async def owner(self, run_id: str) -> str | None:
        owner = await self.client.get(index_key(self.prefix, run_id))
        return _str(owner) if owner is not None else None

    async def save_plan(self, digest: str, plan: Mapping[str, Any], versions: Mapping[str, str]) -> bool:
        """Store a plan by digest (immutable: an existing digest is left as it is)."""
        body = json.dumps({"plan": plan, "versions": versions}, sort_keys=True, separators=(",", ":"))
        return bool(await self.client.set(plan_key(self.prefix, digest), body, nx=True))

    async def plan(self, digest: str) -> dict[str, Any]:
        cached = self._plans.get(digest)
        if cached is None:
            await self._load_plan(digest)
            cached = self._plans[digest]
        return cached

    async def typed_plan(self, digest: str) -> Plan:
        """Plan ``digest`` as the engine reads it, built once per digest for the process's life."""
        cached = self._typed_plans.get(digest)
        if cached is None:
            cached = self._typed_plans[digest] = typed_plan(await self.plan(digest))
        return cached

    async def plan_versions(self, digest: str) -> dict[str, str]:
        """The tool versions (DSL, compiler, engine) stored beside plan ``digest``, which a run of it pins
        at creation."""
        cached = self._plan_versions.get(digest)
        if cached is None:
            await self._load_plan(digest)
            cached = self._plan_versions[digest]
        return cached

    async def _load_plan(self, digest: str) -> None:
        """Read plan ``digest`` and the versions stored beside it, once: both are immutable, cached by
        digest for the process's life."""
        raw = await self.client.get(plan_key(self.prefix, digest))
        if raw is None:
            raise PlanNotFound(digest)
        stored = json.loads(raw)
        self._plans[digest] = stored["plan"]
        self._plan_versions[digest] = {str(k): str(v) for k, v in (stored.get("versions") or {}).items()}

    async def tenants_in_flight(self, shard: str, tenants: list[str]) -> list[int]:
        """How many runs of each of ``tenants`` on ``shard`` have not ended (the transitions count them)."""
        if not tenants:
            return []
        found = await self.client.hmget(  # type: ignore[misc]
            ShardKeys(self.prefix, shard).live(), [tenant_field(t) for t in tenants]
        )
        return [max(0, int(n)) if n is not None else 0 for n in found]

    async def record_refusal(
        self,
        run_id: str,
        digest: str,
        info: DigestInfo | None,
        why: str,
        now_ms: int,
        tenant: str = "default",
    ) -> None:
        """Why the start of ``run_id`` (for ``tenant``) created no run, for status and wait (kept for the
        retention)."""
        key = refused_key(self.prefix, run_id)
        fields: dict[str, str | int] = {"reason": why, "digest": digest, "at": now_ms, "tenant": tenant}
        if info is not None:
            fields |= {"definition": info.definition, "version": info.version}
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping=fields)
            pipe.pexpire(key, self.retention_ms)
            await pipe.execute()
        if self._announces:  # after the record: a wait that misses this finds the refusal by reading
            ending = json.dumps({"state": REFUSED, "reason": why})
            try:
                await self.client.publish(finished_channel(self.prefix, run_id), ending)
            except ResponseError as exc:  # refused (a user without channel rights): the record stands
                log.warning("could not announce the refusal of run %s: %s", run_id, exc)


def set_bits(octets: list[int]) -> frozenset[str]:
    """The indices of the set bits of a bitmap read as unsigned bytes (Redis numbers bits from the
    most significant bit of the first byte)."""
    return frozenset(
        str(8 * i + bit)
        for i, octet in enumerate(octets)
        if octet
        for bit in range(8)
        if octet & (0x80 >> bit)
    )


ARRIVE_MANY = "saga_arrive_many"
#: The most arrivals one FCALL carries: Redis serves no other client while a function runs, so a round of
#: a whole window's arrivals goes as several calls.
MAX_ARRIVALS_PER_CALL = 256


def _grouped(calls: list[tuple[Spec, list[str]]]) -> list[tuple[Spec, list[str]]]:
    """``calls`` with each run's consecutive arrivals (same function, same KEYS) made one call of
    ``saga_arrive_many``; a lone arrival stays as it is."""
    out: list[tuple[Spec, list[str]]] = []
    run: list[tuple[Spec, list[str]]] = []

    def flush() -> None:
        if len(run) > 1:
            out.append((Spec(ARRIVE_MANY, {"arrivals": [spec.body for spec, _ in run]}), run[0][1]))
        else:
            out.extend(run)
        run.clear()

    for spec, keys in calls:
        if spec.function == "saga_arrive" and run and run[0][1] == keys and len(run) < MAX_ARRIVALS_PER_CALL:
            run.append((spec, keys))
            continue
        flush()
        if spec.function == "saga_arrive":
            run.append((spec, keys))
        else:
            out.append((spec, keys))
    flush()
    return out


def _answers(replies: list[Any]) -> list[Any]:
    """A round trip's replies, or the first error among them raised."""
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    return replies


def _result(answer: list[Any]) -> ApplyResult:
    """A transition function's reply: {code, detail} and, when it wrote the run, its new revision."""
    rev = int(answer[2]) if len(answer) > 2 else None
    return ApplyResult(Reply(int(answer[0])), _str(answer[1]), rev)


def _str(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _text(mapping: Mapping[Any, Any]) -> dict[str, str]:
    return {_str(k): _str(v) for k, v in mapping.items()}

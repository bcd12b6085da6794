"""Deliveries through the orchestrator: envelope -> event -> engine -> atomic apply -> messages.

AMQP-free, so it is tested directly against Redis. The service (``service.py``) feeds it batches of
deliveries (and its due timers) and publishes what it returns. A CONFLICT from the store means another
actor changed the run between our read and our write (a paused old consumer, a concurrent branch): the
message is decided again in the batch's next round from a fresh read, and the engine then sees the newer
state (typically: a duplicate or a late callback, recorded as such).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from orchestrator import metrics
from orchestrator.bus.envelope import Envelope
from orchestrator.engine import advance, clocks
from orchestrator.engine.model import (
    RUN,
    BarrierReleased,
    Decision,
    Event,
    Expect,
    Nudge,
    RunSnapshot,
    StageResult,
    StartRun,
    TimerFired,
    Verdict,
    evolve,
)
from orchestrator.engine.plan import Plan
from orchestrator.governance.lifecycle import NotStartable, State, choose
from orchestrator.governance.store import DefinitionStore, DigestInfo
from orchestrator.sealing import Sealer, plan_marks
from orchestrator.shard.admission import TenantAdmission
from orchestrator.shard.events import start_body, to_event
from orchestrator.shard.records import RunRecords
from orchestrator.store import shardmap_store
from orchestrator.store.redis_store import ApplyResult, PlanNotFound, RedisStore
from orchestrator.store.replies import APPLIED, CONFLICT, DUPLICATE, NO_RUN
from orchestrator.store.spec import (
    ordered_items,
    record_after,
    snapshot_after,
    snapshot_from_record,
    writes_run,
)
from orchestrator.trace import TRACE
from orchestrator.wire.kinds import Kind
from orchestrator.wire.outgoing import Outgoing
from orchestrator.wire.sizes import DEFAULT_LIMITS, Limits

# Kinds that continue an existing run on its shard (everything but a start).
CONTINUES = frozenset(
    {Kind.RESULT, Kind.RELEASE, Kind.REFILL, Kind.ACCEPTED, Kind.HEARTBEAT, Kind.CANCEL_RUN, Kind.REDRIVE}
)

MAX_CONFLICT_RETRIES = 8
CLASS_SIZE_TTL_MS = 5_000  # how long a shard class's size (for tenants' shares of their limits) is kept
# What a message (or timer) for a run this shard does not hold becomes, by whether it names this shard.
NOT_HERE = ("unknown-run", "wrong-shard")


@dataclass
class Outcome:
    """What the service must do after a delivery was handled."""

    publish: list[Outgoing] = field(default_factory=list)
    forward_to: str | None = None  # the run lives on another shard: re-route the same message there
    rejected: tuple[str, str] | None = None  # (reason, detail): refuse to saga.rejected
    verdict: Verdict | None = None


@dataclass
class _Work:
    """A message (or a due timer, or a nudge) on its way through a batch's rounds."""

    index: int
    run_id: str
    event: Event
    plan: Plan | None = None  # a start's plan (a continue takes its run's pinned one)
    digest: str | None = None
    fresh: bool = False  # decide from what Redis holds now, not from a kept record
    passable: bool = False  # a message that names no shard: passed on to the run's owner
    conflicts: int = 0
    tenant: str | None = None  # a message's: the tenant whose run it must name (None: a timer, a nudge)


class Processor:
    """Every message takes one path: a batch advances its runs in rounds (a run's own messages stay in
    order, one per round), each round reading the records it needs in one pipeline and applying every
    transition in another. What a round cannot settle goes into the next round as its run's next
    message, decided afresh from Redis: a transition that conflicted with another actor's write, and a
    refusal decided from a kept record. A message on its own is a batch of one."""

    def __init__(
        self,
        store: RedisStore,
        clock_ms: Callable[[], int],
        limits: Limits = DEFAULT_LIMITS,
        admission: TenantAdmission | None = None,
        sealer: Sealer | None = None,
        seal_writes: bool = False,
    ) -> None:
        self.store = store
        self.clock_ms = clock_ms
        self.limits = limits
        self.admission = admission
        # opens values sealed at rest it reads back (whenever there is a ring: a process without the setting
        # still reads what others sealed); seals what it writes with SAGA_ENCRYPT_SENSITIVE
        self.sealer = sealer
        self.seal_writes = seal_writes and sealer is not None
        self._marks: dict[int, tuple[Plan, bool]] = {}  # id(plan) -> (plan, whether it marks anything)
        self._class_sizes: dict[str, tuple[int, int]] = {}  # shard class -> (read at ms, served shards)
        self.definitions = DefinitionStore(store.client, store.prefix)
        self.records = RunRecords()

    async def handle_batch(self, shard: str, envelopes: list[Envelope]) -> list[Outcome]:
        outcomes: list[Outcome | None] = [None] * len(envelopes)
        work: list[_Work] = []
        starts: list[int] = []
        for i, envelope in enumerate(envelopes):
            if envelope.kind is Kind.START:
                starts.append(i)
            else:
                admitted = _admitted(shard, i, envelope)
                if isinstance(admitted, Outcome):
                    outcomes[i] = admitted
                else:
                    work.append(admitted)
        # A run's starts are taken one at a time: each sees the run its earlier start created (and is
        # a duplicate) rather than deciding about a version while the run does not exist yet.
        while True:
            wave, starts = _first_of_each_run(starts, envelopes)
            with TRACE.span("claim", [envelopes[i].message_id for i in wave]):
                work += await self._claimed_starts(shard, wave, envelopes, outcomes)
            await self._run(shard, sorted(work, key=lambda w: w.index), outcomes)
            if not starts:
                break
            work = []
        done = [o if o is not None else Outcome() for o in outcomes]
        for envelope, outcome in zip(envelopes, done, strict=True):
            count(envelope.kind.value, outcome)
        return done

    async def handle(self, shard: str, envelope: Envelope) -> Outcome:
        """One message on its own (a batch that failed is handled message by message), decided from
        what Redis holds: a kept record may be what made the batch fail."""
        self.records.forget(shard, envelope.run_id)
        (outcome,) = await self.handle_batch(shard, [envelope])
        return outcome

    async def fire_timers(self, shard: str, members: list[str]) -> list[Outcome]:
        """The shard's due timers, as one batch: the engine decides what each means, its transition
        claims it. A timer whose run is gone (it expired with the timer still set) or is not this
        shard's is dropped, as is a member that is not one of ours."""
        outcomes: list[Outcome | None] = [None] * len(members)
        work = []
        for i, member in enumerate(members):
            parsed = clocks.parse_member(member)
            if parsed is None:
                await self.store.drop_timer(shard, member)
                outcomes[i] = Outcome()
                continue
            run_id, clock, stage, fence = parsed
            work.append(
                _Work(i, run_id, TimerFired(f"timer-{member}", clock, stage, fence, member), fresh=True)
            )
        await self._run(shard, work, outcomes)
        done = []
        for member, decided in zip(members, outcomes, strict=True):
            outcome = decided or Outcome()
            if outcome.rejected and outcome.rejected[0] in NOT_HERE:
                await self.store.drop_timer(shard, member)
                outcome = Outcome()
            done.append(count("timer", outcome))
        return done

    async def fire_timer(self, shard: str, member: str) -> Outcome:
        """One due timer on its own (a batch of timers that failed is fired timer by timer)."""
        (outcome,) = await self.fire_timers(shard, [member])
        return outcome

    async def nudge(self, shard: str, run_id: str, message_id: str) -> Outcome:
        """Re-send what a stranded run waits for (the reconciler's repair), a bag's missing items too."""
        return count("nudge", await self._one(shard, _Work(0, run_id, Nudge(message_id), fresh=True)))

    async def _one(self, shard: str, work: _Work) -> Outcome:
        outcomes: list[Outcome | None] = [None]
        await self._run(shard, [work], outcomes)
        return outcomes[0] or Outcome()

    async def _run(self, shard: str, work: list[_Work], outcomes: list[Outcome | None]) -> None:
        pending: dict[str, deque[_Work]] = {}
        for item in work:
            pending.setdefault(item.run_id, deque()).append(item)
        try:
            while pending:
                this_round = [w for queue in pending.values() for w in _take(queue)]
                again = await self._round(shard, this_round, outcomes)
                for item in reversed(again):  # decided afresh next round, before the run's later messages
                    pending[item.run_id].appendleft(item)
                pending = {run: queue for run, queue in pending.items() if queue}
        except BaseException:
            for item in work:  # whatever failed, nothing kept of these runs is trusted any more
                self.records.forget(shard, item.run_id)
            raise

    async def _round(self, shard: str, work: list[_Work], outcomes: list[Outcome | None]) -> list[_Work]:
        """Decide and apply one message per run (a bag's item results together); returns the work to
        decide again next round."""
        traced = [w.event.message_id for w in work]
        with TRACE.span("snapshot", traced):
            read = await self._read(shard, work)
        ready: list[tuple[_Work, Plan, Decision]] = []
        again: list[_Work] = []
        now = self.clock_ms()
        with TRACE.span("engine", traced):
            for item in work:
                decided = await self._decide(shard, item, read[item.run_id], now)
                if isinstance(decided, Outcome):
                    outcomes[item.index] = decided
                elif decided is None:
                    again.append(_afresh(item, shard, self.records))
                else:
                    ready.append((item, *decided))
        with TRACE.span("lua", traced):
            again += await self._apply(shard, ready, outcomes, now, read)
        return again

    async def _read(self, shard: str, work: list[_Work]) -> dict[str, _Read]:
        """The record of every run of the round (a bag's items share it): kept from the run's last
        transition here, or read in one round trip; none for a run claimed just now. A bag's release
        reads the items' results, a nudge the items that arrived."""
        read: dict[str, _Read] = {}
        missing = []
        for item in work:
            run = item.run_id
            if run in read or run in missing:
                continue
            if isinstance(item.event, StartRun) and not item.fresh:
                read[run] = _Read(None, None, kept=False)  # claimed just now: nothing to read
                continue
            kept = None if item.fresh else self.records.get(shard, run)
            if kept is None:
                missing.append(run)
            else:
                built = kept.snapshot
                if built is None:  # kept from the run's creation, or too large to keep parsed
                    built = snapshot_from_record(kept.record, {}, shared=True)
                    self.records.keep(shard, run, kept.record, built)
                read[run] = _Read(kept.record, built, kept=True)
        if missing:
            records = await self.store.records(shard, missing)
            if self.sealer is not None and self.sealer.has_keys():
                records = [
                    self.sealer.unseal_record(r, run) if r is not None else None
                    for run, r in zip(missing, records, strict=True)
                ]
            for run, record in zip(missing, records, strict=True):
                snapshot = snapshot_from_record(record, {}, shared=True) if record is not None else None
                read[run] = _Read(record, snapshot, kept=False)
        return read

    async def _decide(
        self, shard: str, item: _Work, run: _Read, now: int
    ) -> tuple[Plan, Decision] | Outcome | None:
        """The engine's decision for ``item``, or its outcome if it names no run here, or None: decide it
        again from what Redis holds now (a refusal decided from a kept record is recorded for good)."""
        snapshot = run.snapshot
        digest = item.digest or (snapshot.digest if snapshot else None)
        if digest is None:
            return await self._not_here(shard, item)
        if snapshot is not None and item.tenant is not None and item.tenant != snapshot.tenant:
            # a key signs for its tenant only: naming another tenant's run is refused before any write
            # (the detail names the sender's tenant only: the run's is not the sender's to learn)
            message, tenant = item.event.message_id, item.tenant
            why = f"message {message} names run {item.run_id}, which is not of tenant {tenant!r}"
            return Outcome(rejected=("wrong-tenant", why))
        # a run whose plan is missing (Redis lost it) raises: its message goes back to the queue
        plan = item.plan or await self.store.typed_plan(digest)
        if isinstance(item.event, (BarrierReleased, Nudge)) and snapshot is not None:
            snapshot = await self._with_members(shard, item, plan, snapshot)
        decision = advance(plan, digest, snapshot, item.event, now, self.limits)
        if snapshot is None and not decision.create:
            why = f"run {item.run_id} does not exist"
            return Outcome(rejected=("unknown-run", why), verdict=decision.verdict)
        if run.kept:
            if decision.verdict is not Verdict.APPLIED:
                return None
            # arrivals commute: their own fences and status guard them; one that releases its join
            # goes on from what was read, as any other transition does
            if decision.arrival is None or decision.arrival.release is None:
                guard = Expect(RUN, "rev", (run.record or {}).get("rev"))
                decision = evolve(decision, expects=(*decision.expects, guard))
        return plan, decision

    async def _with_members(self, shard: str, item: _Work, plan: Plan, snapshot: RunSnapshot) -> RunSnapshot:
        """The snapshot with what a bag's release needs (its items' results, in item order) or a nudge
        (the items that arrived at each open bag, read again on every try: it re-sends the others)."""
        event = item.event
        if isinstance(event, BarrierReleased) and event.stage in plan.bags:
            members = await self.store.barrier_members(shard, item.run_id, event.stage)
            if self.sealer is not None and self.sealer.has_keys():
                members = {m: self.sealer.unseal_text(text, item.run_id) for m, text in members.items()}
            return dataclasses.replace(snapshot, map_results={event.stage: ordered_items(members)})
        if isinstance(event, Nudge):
            bags = tuple(n for n in snapshot.stages if n in plan.bags)
            if bags:
                arrivals = await self.store.arrivals(shard, item.run_id, bags)
                return dataclasses.replace(snapshot, arrivals=arrivals)
        return snapshot

    async def _not_here(self, shard: str, item: _Work) -> Outcome:
        """A continue for a run this shard does not hold. Only a message that names no shard is passed
        on to the run's owner: one that names this shard names the wrong one, and passing it on would
        send it back and forth between the two shards for ever."""
        owner = await self.store.owner(item.run_id)
        if owner is not None and owner != shard:
            if item.passable:
                return Outcome(forward_to=owner)
            why = f"run {item.run_id} lives on shard {owner}, not on {shard}, which the message names"
            return Outcome(rejected=("wrong-shard", why))
        return Outcome(rejected=("unknown-run", f"run {item.run_id} does not exist on {shard}"))

    async def _claimed_starts(
        self, shard: str, starts: list[int], envelopes: list[Envelope], outcomes: list[Outcome | None]
    ) -> list[_Work]:
        """The batch's starts whose version may start runs, claimed for this shard after the round trip
        that reads the versions' states (a start is claimed only once it may go on: a claim given back
        later could be another consumer's of this shard by then). A start that names no plan gets the
        version a client would have chosen for its run id. A start whose run this call claimed first
        reads nothing (creating one that exists after all is refused by the store as a duplicate);
        another reads the run first."""
        named: list[tuple[int, str, dict[str, Any]]] = []
        for i in starts:
            chosen = await self._digest_of(shard, envelopes[i])
            if isinstance(chosen, Outcome):
                outcomes[i] = chosen
            else:
                named.append((i, *chosen))
        # only approved, not retired versions start runs: one read for the batch
        infos = await self.store.digest_info([digest for _, digest, _ in named])
        startable = []
        for (i, digest, context), info in zip(named, infos, strict=True):
            refusal = await self._refusal(shard, envelopes[i], digest, info)
            if refusal is not None:
                outcomes[i] = refusal
            else:
                startable.append((i, digest, context, info))
        if self.admission is not None:
            startable = await self._within_limits(shard, self.admission, startable, envelopes, outcomes)
        candidates = []
        for i, digest, context, _ in startable:
            try:
                candidates.append((i, await self.store.typed_plan(digest), digest, context))
            except PlanNotFound as exc:
                outcomes[i] = Outcome(rejected=("unknown-definition", str(exc)))
        owners = await self.store.claim_fresh([envelopes[i].run_id for i, *_ in candidates], shard)
        claimed: list[_Work] = []
        for (i, plan, digest, context), (owner, fresh) in zip(candidates, owners, strict=True):
            envelope = envelopes[i]
            if owner != shard:
                outcomes[i] = Outcome(forward_to=owner)
                continue
            versions = await self.store.plan_versions(digest)
            by = str(envelope.body.get("requested_by") or "")  # a string: _digest_of decoded this body
            event = StartRun(
                envelope.message_id,
                envelope.run_id,
                shard,
                context,
                envelope.tenant,
                versions,
                requested_by=by,
            )
            claimed.append(
                _Work(i, envelope.run_id, event, plan, digest, fresh=not fresh, tenant=envelope.tenant)
            )
        return claimed

    async def _within_limits(
        self,
        shard: str,
        admission: TenantAdmission,
        starts: list[tuple[int, str, dict[str, Any], DigestInfo | None]],
        envelopes: list[Envelope],
        outcomes: list[Outcome | None],
    ) -> list[tuple[int, str, dict[str, Any], DigestInfo | None]]:
        """The starts their tenants' limits admit; the others refused (a start of a run that exists
        goes on: a duplicate, whatever the limits)."""
        tenants = sorted({envelopes[i].tenant for i, *_ in starts})
        in_flight = dict(zip(tenants, await self.store.tenants_in_flight(shard, tenants), strict=True))
        shards = await self._served_in_class(shard)
        admitted = []
        for start in starts:
            envelope = envelopes[start[0]]
            why = admission.refusal(shard, envelope.tenant, in_flight[envelope.tenant], shards)
            if why is None:
                in_flight[envelope.tenant] += 1
                admitted.append(start)
                continue
            refused = await self._refuse(shard, envelope, start[1], start[3], why, reason="tenant-limit")
            if refused is None:
                admitted.append(start)
            else:
                outcomes[start[0]] = refused
        return admitted

    async def _served_in_class(self, shard: str) -> int:
        """How many served shards ``shard``'s class has (a tenant's limits are shared among them), read
        from the shard map at most every few seconds."""
        shard_class = shard.rpartition(".")[0]
        now = self.clock_ms()
        read_at, count = self._class_sizes.get(shard_class, (0, 0))
        if now - read_at > CLASS_SIZE_TTL_MS or count == 0:
            shard_map = await shardmap_store.load(self.store.client, self.store.prefix)
            served = shard_map.served if shard_map is not None else [shard]
            count = max(1, sum(1 for s in served if s.rpartition(".")[0] == shard_class))
            self._class_sizes[shard_class] = (now, count)
        return count

    async def _digest_of(self, shard: str, envelope: Envelope) -> tuple[str, dict[str, Any]] | Outcome:
        """The plan a start creates its run from, with its context; or why it creates none."""
        body = start_body(envelope)
        if isinstance(body, str):
            return Outcome(rejected=("malformed", body))
        try:
            digest = body.digest or await self._chosen_digest(shard, body.definition, envelope.run_id)
        except (PlanNotFound, NotStartable) as exc:
            owner = await self.store.owner(envelope.run_id)
            if owner is not None and owner != shard:
                return Outcome(forward_to=owner)  # a start re-sent for a run of another shard
            refused = await self._refuse(shard, envelope, "", None, str(exc))
            return refused or Outcome(rejected=("unknown-definition", str(exc)))
        return digest, body.context

    async def _chosen_digest(self, shard: str, definition: str, run_id: str) -> str:
        """A start that names no plan gets the version a client would have chosen for its run id; one
        re-sent for a run of this shard, the run's own (a duplicate)."""
        pinned = await self.store.run_digest(shard, run_id)
        if pinned is not None:
            return pinned
        state = await self.definitions.load(definition)
        if not state.versions:
            raise PlanNotFound(f"definition {definition!r}")
        return choose(state, run_id).digest

    async def _refusal(
        self, shard: str, envelope: Envelope, digest: str, info: DigestInfo | None
    ) -> Outcome | None:
        """Refuse a start of a plan no run may be created from (never published, not approved, or
        retired). None when the start may go on: its version may start runs, or the run already exists
        (a start re-sent for a run created while its version was startable is a duplicate)."""
        if info is not None and info.startable:
            return None
        if info is None:
            why = f"plan {digest} is not a published definition version"
        else:
            what = "not approved yet" if info.state is State.PUBLISHED else "retired: no new runs"
            why = f"{info.definition} {info.version} ({digest}) is {what}"
        return await self._refuse(shard, envelope, digest, info, why)

    async def _refuse(
        self,
        shard: str,
        envelope: Envelope,
        digest: str,
        info: DigestInfo | None,
        why: str,
        reason: str = "version-not-startable",
    ) -> Outcome | None:
        """The run is not created; the refusal is kept where status and wait find it. None when the run
        exists (this start is a duplicate and goes the usual way) or lives on another shard (which
        checks again). A claim of this shard without a run (a crash between claim and create, or a run
        whose retention ended) does not make a start a duplicate."""
        owner = await self.store.owner(envelope.run_id)
        if owner is not None and owner != shard:
            return None
        if owner == shard and await self.store.run_digest(shard, envelope.run_id) is not None:
            return None
        await self.store.record_refusal(envelope.run_id, digest, info, why, self.clock_ms(), envelope.tenant)
        return Outcome(rejected=(reason, f"run {envelope.run_id} not created: {why}"))

    async def _apply(
        self,
        shard: str,
        ready: list[tuple[_Work, Plan, Decision]],
        outcomes: list[Outcome | None],
        now: int,
        read: dict[str, _Read],
    ) -> list[_Work]:
        """Apply the round's transitions in one pipeline; returns those that conflicted."""
        if not ready:
            return []
        results = await self.store.apply_many(
            shard,
            [
                (
                    item.run_id,
                    item.event.message_id,
                    self._stored(plan, item.run_id, read.get(item.run_id), decision),
                    plan,
                )
                for item, plan, decision in ready
            ],
            now,
        )
        again = []
        for (item, plan, decision), result in zip(ready, results, strict=True):
            self._bring_forward(shard, item.run_id, read, decision, result)
            if result.code == CONFLICT:
                again.append(_afresh(item, shard, self.records, conflicted=True))
                continue
            if result.code == APPLIED:
                metrics.applied(item.run_id, plan, decision, now)
            if result.code == NO_RUN:
                outcomes[item.index] = Outcome(rejected=("unknown-run", f"run {item.run_id} does not exist"))
            else:
                outcomes[item.index] = Outcome(
                    publish=_to_publish(decision, result.code, result.detail), verdict=decision.verdict
                )
        return again

    def _stored(self, plan: Plan, run_id: str, run: _Read | None, decision: Decision) -> Decision:
        """``decision`` as Redis keeps it: with SAGA_ENCRYPT_SENSITIVE, its sensitive values sealed (what is
        published from it, and kept in memory, stays as the engine made it)."""
        if self.sealer is None or not self.seal_writes:
            return decision
        kept = self._marks.get(id(plan))
        if kept is None or kept[0] is not plan:
            kept = self._marks[id(plan)] = (plan, plan_marks(plan))
        if not kept[1]:
            return decision
        return self.sealer.sealed(plan, run.snapshot if run is not None else None, decision, run_id)

    def _bring_forward(
        self, shard: str, run_id: str, read: dict[str, _Read], decision: Decision, result: ApplyResult
    ) -> None:
        """Keep the run's record as this transition left it, when its reply shows that nothing else
        wrote the run since the record was read; else forget it. Replies come in the order the
        transitions were applied, so a round's arrivals bring one record forward one by one."""
        if result.code == DUPLICATE:
            return  # nothing written: what is kept still holds
        before = read.get(run_id)
        base = before.record if before is not None else None
        rev = result.rev
        if (
            result.code != APPLIED  # a conflict, a run gone
            or rev is None
            or decision.finished
            or (base is None and not decision.create)
            or rev != int((base or {}).get("rev", "0")) + writes_run(decision)  # a write made elsewhere
        ):
            read.pop(run_id, None)
            self.records.forget(shard, run_id)
            return
        after = record_after(base or {}, decision, rev)
        previous = before.snapshot if before is not None else None
        snapshot = snapshot_after(previous, after, decision) if previous is not None else None
        read[run_id] = _Read(after, snapshot, kept=True)
        self.records.keep(shard, run_id, after, snapshot)


@dataclass(frozen=True)
class _Read:
    """A run's record as a round decides from it, and whether it was kept from an earlier transition."""

    record: dict[str, str] | None
    snapshot: RunSnapshot | None
    kept: bool


def count(kind: str, outcome: Outcome) -> Outcome:
    """Count a handled message (or timer, or nudge) in the metrics by what became of it. A refusal to
    the rejected queue is counted with its reason where it is parked (``Publisher.reject``)."""
    if outcome.rejected is not None:
        metrics.transition(kind, "rejected")
    elif outcome.forward_to is not None:
        metrics.transition(kind, "forwarded")
    elif outcome.verdict is None:
        metrics.transition(kind, "ignored")
    else:
        metrics.transition(kind, outcome.verdict.value)
        if outcome.verdict is not Verdict.APPLIED:
            metrics.refused(outcome.verdict.value)
    return outcome


def _admitted(shard: str, index: int, envelope: Envelope) -> _Work | Outcome:
    """A message that continues a run, as work for the rounds; or what becomes of one that does not
    (another kind, another shard's, a body that is no event)."""
    if envelope.kind not in CONTINUES:
        return Outcome(rejected=("wrong-kind", f"{envelope.kind.value} messages are not for shard queues"))
    if envelope.shard and envelope.shard != shard:
        return Outcome(forward_to=envelope.shard)
    event = to_event(envelope)
    if isinstance(event, str):
        return Outcome(rejected=("malformed", event))
    return _Work(index, envelope.run_id, event, passable=not envelope.shard, tenant=envelope.tenant)


def _first_of_each_run(starts: list[int], envelopes: list[Envelope]) -> tuple[list[int], list[int]]:
    """The first start of each run among ``starts``, and the rest (in batch order)."""
    first: dict[str, int] = {}
    rest = []
    for i in starts:
        if envelopes[i].run_id in first:
            rest.append(i)
        else:
            first[envelopes[i].run_id] = i
    return list(first.values()), rest


def _afresh(item: _Work, shard: str, records: RunRecords, *, conflicted: bool = False) -> _Work:
    """``item`` to be decided again from what Redis holds now: what is kept of its run is stale."""
    records.forget(shard, item.run_id)
    conflicts = item.conflicts + conflicted
    if conflicts > MAX_CONFLICT_RETRIES:
        raise RuntimeError(
            f"run {item.run_id}: {MAX_CONFLICT_RETRIES} conflicting writes in a row; giving up"
        )
    return dataclasses.replace(item, fresh=True, conflicts=conflicts)


def _take(queue: deque[_Work]) -> list[_Work]:
    """A run's next message for this round; successful map-item results of one stage travel together,
    because arrivals commute (each checks only its own stage fence and the run's intent)."""
    first = queue.popleft()
    taken = [first]
    stage = _item_success_of(first)
    while stage is not None and queue and _item_success_of(queue[0]) == stage:
        taken.append(queue.popleft())
    return taken


def _item_success_of(item: _Work) -> str | None:
    """The map stage ``item`` reports a successful item of (None: it reports none)."""
    event = item.event
    return event.stage if isinstance(event, StageResult) and event.item is not None and event.ok else None


def _to_publish(decision: Decision, code: int, detail: str) -> list[Outgoing]:
    if code != APPLIED:
        return []
    messages = list(decision.outgoing)
    if decision.arrival is not None:  # the store's reply to an arrival: how many members are to come
        messages += decision.arrival.continuations(int(detail))
    return messages

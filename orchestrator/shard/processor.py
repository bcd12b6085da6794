"""One delivery through the orchestrator: envelope -> event -> engine -> atomic apply -> messages.

AMQP-free, so it is tested directly against Redis. The service (``service.py``) feeds it deliveries and
publishes what it returns. A CONFLICT from the store means another actor changed the run between our read
and our write (a paused old consumer, a concurrent branch): we reload and decide again, and the engine
then sees the newer state (typically: a duplicate or a late callback, recorded as such).
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
    StartRun,
    TimerFired,
    Verdict,
)
from orchestrator.engine.plan import Plan
from orchestrator.governance.lifecycle import NotStartable, State, choose
from orchestrator.governance.store import DefinitionStore, DigestInfo
from orchestrator.shard.events import start_body, to_event
from orchestrator.shard.records import RunRecords
from orchestrator.store.redis_store import ApplyResult, PlanNotFound, RedisStore
from orchestrator.store.replies import APPLIED, CONFLICT, DUPLICATE, NO_RUN
from orchestrator.store.spec import record_after, snapshot_from_record, writes_run
from orchestrator.trace import TRACE
from orchestrator.wire.kinds import Kind
from orchestrator.wire.outgoing import Outgoing
from orchestrator.wire.sizes import DEFAULT_LIMITS, Limits

# Kinds that continue an existing run on its shard (everything but a start).
CONTINUES = frozenset(
    {Kind.RESULT, Kind.RELEASE, Kind.REFILL, Kind.ACCEPTED, Kind.HEARTBEAT, Kind.CANCEL_RUN, Kind.REDRIVE}
)

MAX_CONFLICT_RETRIES = 8


@dataclass
class Outcome:
    """What the service must do after a delivery was handled."""

    publish: list[Outgoing] = field(default_factory=list)
    forward_to: str | None = None  # the run lives on another shard: re-route the same message there
    rejected: tuple[str, str] | None = None  # (reason, detail): refuse to saga.rejected
    verdict: Verdict | None = None


class Processor:
    def __init__(
        self, store: RedisStore, clock_ms: Callable[[], int], limits: Limits = DEFAULT_LIMITS
    ) -> None:
        self.store = store
        self.clock_ms = clock_ms
        self.limits = limits
        self.definitions = DefinitionStore(store.client, store.prefix)
        self.records = RunRecords()

    async def handle_batch(self, shard: str, envelopes: list[Envelope]) -> list[Outcome]:
        """Handle a batch with few round trips: runs advance in rounds (a run's own messages stay in
        order, one per round), each round reading every snapshot in one pipeline and applying every
        transition in another. A conflict falls back to the one-at-a-time path for that message."""
        outcomes: list[Outcome | None] = [None] * len(envelopes)
        pending: dict[str, deque[int]] = {}
        for i, envelope in enumerate(envelopes):
            pending.setdefault(envelope.run_id, deque()).append(i)
        while pending:
            this_round = [i for queue in pending.values() for i in _take(queue, envelopes)]
            pending = {run: queue for run, queue in pending.items() if queue}
            await self._round(shard, this_round, envelopes, outcomes)
        done = [o if o is not None else Outcome() for o in outcomes]
        for envelope, outcome in zip(envelopes, done, strict=True):
            count(envelope.kind.value, outcome)
        return done

    async def _round(
        self, shard: str, indices: list[int], envelopes: list[Envelope], outcomes: list[Outcome | None]
    ) -> None:
        starts = [i for i in indices if envelopes[i].kind is Kind.START]
        continues = [
            i
            for i in indices
            if envelopes[i].kind in CONTINUES and (not envelopes[i].shard or envelopes[i].shard == shard)
        ]
        for i in sorted(set(indices) - set(starts) - set(continues)):
            outcomes[i] = await self._handle(shard, envelopes[i])
        # (index, event, plan, digest or None: a continue takes its run's pinned digest)
        work: list[tuple[int, Event, Plan | None, str | None]] = []
        unread: set[str] = set()  # runs claimed just now: nothing to read
        with TRACE.span("claim", [envelopes[i].message_id for i in starts]):
            work += await self._claimed_starts(shard, starts, envelopes, outcomes, unread)
        for i in continues:
            event = to_event(envelopes[i])
            if isinstance(event, str):
                outcomes[i] = Outcome(rejected=("malformed", event))
            else:
                work.append((i, event, None, None))
        if not work:
            return
        traced = [envelopes[i].message_id for i, *_ in work]
        with TRACE.span("snapshot", traced):
            read = await self._read(shard, [envelopes[i].run_id for i, *_ in work], unread)
        ready: list[tuple[int, Event, Plan, Decision]] = []
        now = self.clock_ms()
        with TRACE.span("engine", traced):
            careful = await self._decide_round(shard, work, envelopes, read, now, ready)
        for i in careful:
            outcomes[i] = await self._handle(shard, envelopes[i])  # the careful path handles it
        with TRACE.span("lua", traced):
            await self._apply_ready(shard, ready, envelopes, outcomes, now, read)

    async def _read(self, shard: str, run_ids: list[str], unread: set[str]) -> dict[str, _Read]:
        """The record of every run of the round (map items of one run share it): kept from the run's last
        transition here, or read in one round trip; none for a run claimed just now."""
        read: dict[str, _Read] = {run: _Read(None, None, kept=False) for run in unread}
        missing = []
        for run in dict.fromkeys(run_ids):
            if run in read:
                continue
            record = self.records.get(shard, run)
            if record is None:
                missing.append(run)
            else:
                read[run] = _Read(record, snapshot_from_record(record, {}, shared=True), kept=True)
        if missing:
            for run, record in zip(missing, await self.store.records(shard, missing), strict=True):
                snapshot = snapshot_from_record(record, {}, shared=True) if record is not None else None
                read[run] = _Read(record, snapshot, kept=False)
        return read

    async def _decide_round(
        self,
        shard: str,
        work: list[tuple[int, Event, Plan | None, str | None]],
        envelopes: list[Envelope],
        read: dict[str, _Read],
        now: int,
        ready: list[tuple[int, Event, Plan, Decision]],
    ) -> list[int]:
        """The engine's decision for each message of the round whose plan and snapshot are in hand,
        appended to ``ready``; returns the messages the careful path must handle instead."""
        careful = []
        for i, event, start_plan, start_digest in work:
            run = read[envelopes[i].run_id]
            snapshot = run.snapshot
            digest = start_digest or (snapshot.digest if snapshot else None)
            plan = start_plan or (await self.store.typed_plan(digest) if digest else None)
            if plan is None or digest is None or (start_plan is None and _needs_map_results(event, plan)):
                careful.append(i)
                continue
            decision = advance(plan, digest, snapshot, event, now, self.limits)
            if run.kept:
                if decision.verdict is not Verdict.APPLIED:
                    # a refusal is recorded for good: made again from what Redis holds now
                    self.records.forget(shard, envelopes[i].run_id)
                    careful.append(i)
                    continue
                if decision.arrival is None:  # arrivals commute: their own fences and status guard them
                    guard = Expect(RUN, "rev", (run.record or {}).get("rev"))
                    decision = dataclasses.replace(decision, expects=(*decision.expects, guard))
            ready.append((i, event, plan, decision))
        return careful

    async def _claimed_starts(
        self,
        shard: str,
        starts: list[int],
        envelopes: list[Envelope],
        outcomes: list[Outcome | None],
        unread: set[str],
    ) -> list[tuple[int, Event, Plan | None, str | None]]:
        """Starts that name their plan, claimed for this shard in one pipeline; others take the careful
        path (which resolves the active version, or refuses with the reason). Runs this call claimed
        first are added to ``unread``: they have no record to read (creating one that exists after all
        is refused by the store as a duplicate)."""
        named: list[tuple[int, str, dict[str, Any]]] = []
        for i in starts:
            body = start_body(envelopes[i])
            if isinstance(body, str) or not body.digest:
                outcomes[i] = await self._handle(shard, envelopes[i])
            else:
                named.append((i, body.digest, body.context))
        # only approved, not retired versions start runs: one read for the batch
        infos = await self.definitions.digest_info([digest for _, digest, _ in named])
        candidates = []
        for (i, digest, context), info in zip(named, infos, strict=True):
            refusal = await self._refusal(shard, envelopes[i], digest, info)
            if refusal is not None:
                outcomes[i] = refusal
                continue
            try:
                candidates.append((i, await self.store.typed_plan(digest), digest, context))
            except PlanNotFound as exc:
                outcomes[i] = Outcome(rejected=("unknown-definition", str(exc)))
        owners = await self.store.claim_fresh([envelopes[i].run_id for i, *_ in candidates], shard)
        claimed: list[tuple[int, Event, Plan | None, str | None]] = []
        for (i, plan, digest, context), (owner, fresh) in zip(candidates, owners, strict=True):
            envelope = envelopes[i]
            if owner != shard:
                outcomes[i] = Outcome(forward_to=owner)
                continue
            if fresh:
                unread.add(envelope.run_id)
            versions = await self.store.plan_versions(digest)
            event = StartRun(envelope.message_id, envelope.run_id, shard, context, envelope.tenant, versions)
            claimed.append((i, event, plan, digest))
        return claimed

    async def _apply_ready(
        self,
        shard: str,
        ready: list[tuple[int, Event, Plan, Decision]],
        envelopes: list[Envelope],
        outcomes: list[Outcome | None],
        now: int,
        read: dict[str, _Read],
    ) -> None:
        if not ready:
            return
        results = await self.store.apply_many(
            shard,
            [(envelopes[i].run_id, event.message_id, decision, plan) for i, event, plan, decision in ready],
            now,
        )
        for (i, _, plan, decision), result in zip(ready, results, strict=True):
            self._bring_forward(shard, envelopes[i].run_id, read, decision, result)
            if result.code == APPLIED:
                metrics.applied(envelopes[i].run_id, plan, decision, now)
            if result.code == CONFLICT:
                outcomes[i] = await self._handle(shard, envelopes[i])
            elif result.code == NO_RUN:
                outcomes[i] = Outcome(rejected=("unknown-run", f"run {envelopes[i].run_id} does not exist"))
            else:
                outcomes[i] = Outcome(
                    publish=_to_publish(decision, result.code, result.detail), verdict=decision.verdict
                )

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
        read[run_id] = _Read(after, None, kept=True)
        self.records.keep(shard, run_id, after)

    async def handle(self, shard: str, envelope: Envelope) -> Outcome:
        """One message on its own (the path a batch that failed takes, message by message)."""
        return count(envelope.kind.value, await self._handle(shard, envelope))

    async def _handle(self, shard: str, envelope: Envelope) -> Outcome:
        if envelope.kind is Kind.START:
            return await self._start(shard, envelope)
        if envelope.kind in CONTINUES:
            if envelope.shard and envelope.shard != shard:
                return Outcome(forward_to=envelope.shard)
            return await self._continue(shard, envelope)
        return Outcome(rejected=("wrong-kind", f"{envelope.kind.value} messages are not for shard queues"))

    async def _start(self, shard: str, envelope: Envelope) -> Outcome:
        body = start_body(envelope)
        if isinstance(body, str):
            return Outcome(rejected=("malformed", body))
        context = body.context
        try:
            digest = body.digest or await self._chosen_digest(shard, body.definition, envelope.run_id)
        except (PlanNotFound, NotStartable) as exc:
            owner = await self.store.owner(envelope.run_id)
            if owner is not None and owner != shard:
                return Outcome(forward_to=owner)  # a start re-sent for a run of another shard
            refused = await self._refuse(shard, envelope, "", None, str(exc))
            return refused or Outcome(rejected=("unknown-definition", str(exc)))
        (info,) = await self.definitions.digest_info([digest])
        refusal = await self._refusal(shard, envelope, digest, info)
        if refusal is not None:
            return refusal
        try:
            plan = await self.store.typed_plan(digest)
        except PlanNotFound as exc:
            return Outcome(rejected=("unknown-definition", str(exc)))
        owner = await self.store.claim(envelope.run_id, shard)
        if owner != shard:
            return Outcome(forward_to=owner)
        versions = await self.store.plan_versions(digest)
        event = StartRun(envelope.message_id, envelope.run_id, shard, context, envelope.tenant, versions)
        return await self._decide(shard, envelope.run_id, event, plan, digest, None)

    async def _chosen_digest(self, shard: str, definition: str, run_id: str) -> str:
        """A start that names no plan gets the version a client would have chosen for its run id; one
        re-sent for a run of this shard, the run's own (a duplicate)."""
        snapshot = await self.store.snapshot(shard, run_id)
        if snapshot is not None:
            return snapshot.digest
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
        self, shard: str, envelope: Envelope, digest: str, info: DigestInfo | None, why: str
    ) -> Outcome | None:
        """The run is not created; the refusal is kept where status and wait find it. None when the run
        exists (this start is a duplicate and goes the usual way) or lives on another shard (which
        checks again). A claim of this shard without a run (a crash between claim and create, or a run
        whose retention ended) does not make a start a duplicate."""
        owner = await self.store.owner(envelope.run_id)
        if owner is not None and owner != shard:
            return None
        if owner == shard and await self.store.snapshot(shard, envelope.run_id) is not None:
            return None
        await self.store.record_refusal(envelope.run_id, digest, info, why, self.clock_ms())
        return Outcome(rejected=("version-not-startable", f"run {envelope.run_id} not created: {why}"))

    async def _continue(self, shard: str, envelope: Envelope) -> Outcome:
        event = to_event(envelope)
        if isinstance(event, str):
            return Outcome(rejected=("malformed", event))
        loaded = await self._load(shard, envelope.run_id)
        if loaded is None:
            return await self._not_here(shard, envelope)
        return await self._continue_with(shard, envelope.run_id, event, *loaded)

    async def _not_here(self, shard: str, envelope: Envelope) -> Outcome:
        """A continue for a run this shard does not hold. Only a message that names no shard is passed
        on to the run's owner: one that names this shard names the wrong one, and passing it on would
        send it back and forth between the two shards for ever."""
        owner = await self.store.owner(envelope.run_id)
        if owner is not None and owner != shard:
            if not envelope.shard:
                return Outcome(forward_to=owner)
            why = f"run {envelope.run_id} lives on shard {owner}, not on {shard}, which the message names"
            return Outcome(rejected=("wrong-shard", why))
        return Outcome(rejected=("unknown-run", f"run {envelope.run_id} does not exist on {shard}"))

    async def fire_timer(self, shard: str, member: str) -> Outcome:
        """A due timer of this shard: the engine decides what it means, the transition claims it."""
        parsed = clocks.parse_member(member)
        loaded = await self._load(shard, parsed[0]) if parsed is not None else None
        if parsed is None or loaded is None:
            await self.store.drop_timer(shard, member)  # not ours, or its run expired with it still set
            return count("timer", Outcome())
        run_id, clock, stage, fence = parsed
        return count(
            "timer",
            await self._continue_with(
                shard, run_id, TimerFired(f"timer-{member}", clock, stage, fence, member), *loaded
            ),
        )

    async def nudge(self, shard: str, run_id: str, message_id: str) -> Outcome:
        """Re-send what a stranded run waits for (the reconciler's repair), a bag's missing items too."""
        loaded = await self._load(shard, run_id)
        if loaded is None:
            return Outcome(rejected=("unknown-run", f"run {run_id} does not exist on {shard}"))
        plan, snapshot = loaded
        bags = tuple(n for n in snapshot.stages if n in plan.bags)
        if bags:  # which items arrived, read again on every retry: the nudge re-sends the others
            snapshot = dataclasses.replace(snapshot, arrivals=await self.store.arrivals(shard, run_id, bags))
        event = Nudge(message_id)
        decided = await self._decide(shard, run_id, event, plan, snapshot.digest, None, snapshot, bags)
        return count("nudge", decided)

    async def _load(self, shard: str, run_id: str) -> tuple[Plan, RunSnapshot] | None:
        """A run's plan and snapshot, or None if the run does not exist on this shard."""
        snapshot = await self.store.snapshot(shard, run_id)
        if snapshot is None:
            return None
        return await self.store.typed_plan(snapshot.digest), snapshot

    async def _continue_with(
        self, shard: str, run_id: str, event: Event, plan: Plan, snapshot: RunSnapshot
    ) -> Outcome:
        map_stage = event.stage if isinstance(event, BarrierReleased) and event.stage in plan.bags else None
        first = snapshot if map_stage is None else None
        return await self._decide(shard, run_id, event, plan, snapshot.digest, map_stage, first)

    async def _decide(
        self,
        shard: str,
        run_id: str,
        event: Event,
        plan: Plan,
        digest: str,
        map_stage: str | None,
        first: RunSnapshot | None = None,
        members_of: tuple[str, ...] = (),
    ) -> Outcome:
        self.records.forget(shard, run_id)  # this path reads afresh and writes: what is kept is stale
        for attempt in range(MAX_CONFLICT_RETRIES):
            snapshot = (
                first
                if attempt == 0 and first is not None
                else await self.store.snapshot(shard, run_id, map_stage, members_of)
            )
            now = self.clock_ms()
            decision = advance(plan, digest, snapshot, event, now, self.limits)
            if snapshot is None and not decision.create:
                return Outcome(
                    rejected=("unknown-run", f"run {run_id} does not exist"), verdict=decision.verdict
                )
            result = await self.store.apply(shard, run_id, event.message_id, decision, plan, now)
            if result.code == CONFLICT:
                continue
            if result.code == NO_RUN:
                return Outcome(rejected=("unknown-run", f"run {run_id} does not exist"))
            if result.code == APPLIED:
                metrics.applied(run_id, plan, decision, now)
            return Outcome(
                publish=_to_publish(decision, result.code, result.detail), verdict=decision.verdict
            )
        raise RuntimeError(f"run {run_id}: {MAX_CONFLICT_RETRIES} conflicting writes in a row; giving up")


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


def _take(queue: deque[int], envelopes: list[Envelope]) -> list[int]:
    """A run's next message for this round; successful map-item results of one stage travel together,
    because arrivals commute (each checks only its own stage fence and the run's intent)."""
    first = queue.popleft()
    taken = [first]
    if _is_item_success(envelopes[first]):
        stage = envelopes[first].stage
        while queue and _is_item_success(envelopes[queue[0]]) and envelopes[queue[0]].stage == stage:
            taken.append(queue.popleft())
    return taken


def _is_item_success(envelope: Envelope) -> bool:
    return envelope.kind is Kind.RESULT and envelope.item is not None and envelope.body.get("ok") is True


def _needs_map_results(event: Event, plan: Plan) -> bool:
    """A bag's release reads the items' results (the careful path's snapshot), which a batch does not."""
    return isinstance(event, BarrierReleased) and event.stage in plan.bags


def _to_publish(decision: Decision, code: int, detail: str) -> list[Outgoing]:
    if code != APPLIED:
        return []
    messages = list(decision.outgoing)
    if decision.arrival is not None:  # the store's reply to an arrival: how many members are to come
        messages += decision.arrival.continuations(int(detail))
    return messages

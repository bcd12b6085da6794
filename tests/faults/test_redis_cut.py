"""The orchestrator cut off from Redis, through a fault proxy, under load (issue #4).

Invariant 10 (infrastructure half) and invariants 3, 4 and 6 under a network fault between the
orchestrator and Redis, where test_redis_outage kills the server instead. While the orchestrator cannot
reach Redis it must commit nothing and dead-letter nothing (deliveries wait in the broker); once the path
heals, every run must finish with each join and bag released once, one accepted result per attempt, one
effect per task, and nothing left in the outboxes. A lost reply to a transition that did commit must
change nothing either: the retried or redelivered message is a recognised duplicate.

A blackhole here strands the connections it catches for good (see proxy.py): recovering needs the
orchestrator to notice a silent connection by itself, as it must when a firewall, NAT or load balancer
drops a connection's state.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.faults import invariants
from tests.faults.harness import (
    FaultSeed,
    Start,
    busy_queues,
    history_total,
    log_tail,
    mixed_workload,
    sleep_until,
    stack_behind_proxy,
    start_all,
)
from tests.faults.invariants import assert_no_violations
from tests.faults.lifecycle import terminal_count
from tests.faults.proxy import FaultProxy
from tests.integration.stack import Stack, poll

pytestmark = pytest.mark.services

RUNS = 100  # model-ingest runs, of which DURING are started while the cut lasts
DURING = 20
CONVERGE_S = 90.0  # a liveness bound for after the heal, far above what recovery takes; not a timing claim
SETTLE_S = 0.5  # commands forwarded just before the cut may still be running upstream; measure after


def cut_scenario(stack: Stack, proxy: FaultProxy, seed: FaultSeed, fault: str, cut_s: float) -> None:
    rng = seed.rng
    work = mixed_workload(stack, rng, runs=RUNS, during=DURING, bag_items=rng.randint(200, 400))
    # Given runs in flight: the bag and most model-ingest runs started, the cut once a random number of
    # them have finished (so that it finds runs at every stage: finished, mid-way, not yet created)
    start_all(stack.settings, work.before)
    finished_at_cut = rng.randint(1, (RUNS - DURING) // 2)
    poll(
        lambda: terminal_count(stack, work.run_ids) >= finished_at_cut,
        60,
        interval_s=0.02,
        what=f"{finished_at_cut} runs to finish before the cut",
    )
    in_flight = len(work.run_ids) - terminal_count(stack, work.run_ids)
    before = proxy.stats()
    # When the orchestrator's path to Redis is cut
    getattr(proxy, fault)()
    cut_at = time.monotonic()
    print(f"{fault} cut for {cut_s} s with {in_flight} of {len(work.run_ids)} runs not finished")
    time.sleep(SETTLE_S)
    history_at_cut = history_total(stack.redis, stack.prefix)
    # ... and services keep starting runs meanwhile (the client reads Redis directly, the broker holds them)
    start_all(stack.settings, work.during)
    sleep_until(cut_at + cut_s - 0.1)  # measure just before the heal
    history_in_cut = history_total(stack.redis, stack.prefix)
    cut = proxy.stats()
    sleep_until(cut_at + cut_s)
    proxy.set_pass()
    print(f"healed after {time.monotonic() - cut_at:.1f} s; proxy before: {before}; in the cut: {cut}")

    # Then consumption paused: no transition committed while cut off (acks without a commit, or
    # dead-lettering, would show as runs that never finish or as parked messages, checked below), and
    # the cut really caught the orchestrator's connections
    paused = []
    if history_in_cut != history_at_cut:
        paused.append(f"{history_in_cut - history_at_cut} history events appended while cut off")
    caught = cut.stranded if fault == "blackhole" else cut.resets
    if before.bytes_up == 0 or caught == 0:
        paused.append(f"the cut caught no orchestrator connection (proxy: {cut})")
    assert_no_violations(paused, f"the pause during a {fault} cut (seed {seed.seed})")

    # And every run converges once the path heals, with every invariant held and nothing dead-lettered
    pending = invariants.wait_for_convergence(stack.redis, stack.prefix, work.run_ids, CONVERGE_S)
    if pending:
        print(f"orchestrator log ({stack.logs}/orchestrator.log), last lines:")
        print(log_tail(stack, "orchestrator"))
        print(f"proxy now: {proxy.stats()}; busy queues: {busy_queues(stack)}")
    assert_no_violations(
        pending, f"liveness {CONVERGE_S:.0f} s after healing a {cut_s} s {fault} cut (seed {seed.seed})"
    )
    violations = invariants.check_runs(stack.redis, stack.prefix, work.run_ids, all_runs=True)
    violations += invariants.dead_letters(stack.queue_depths())
    log = stack.log("orchestrator")
    if "Redis unreachable" not in log and "Redis failed" not in log:
        violations.append("the orchestrator never noticed that Redis was unreachable")
    assert_no_violations(violations, f"the invariants after a {cut_s} s {fault} cut (seed {seed.seed})")


@pytest.mark.parametrize("fault", ["blackhole", "reset"])
def test_a_5s_cut_under_load_pauses_and_every_run_converges(
    fault: str, fault_seed: FaultSeed, tmp_path: Path
) -> None:
    with stack_behind_proxy(f"cut5-{fault}", tmp_path) as (stack, proxy):
        cut_scenario(stack, proxy, fault_seed, fault, cut_s=5.0)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["blackhole", "reset"])
def test_a_30s_cut_under_load_pauses_and_every_run_converges(
    fault: str, fault_seed: FaultSeed, tmp_path: Path
) -> None:
    with stack_behind_proxy(f"cut30-{fault}", tmp_path) as (stack, proxy):
        cut_scenario(stack, proxy, fault_seed, fault, cut_s=30.0)


# ---- a lost reply ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LostReply:
    """Which transition's reply to lose, and what that transition causes afterwards."""

    stage: str  # the stage whose result the transition applies
    slow: str | None  # a contract slowed down for the target, so that ``stage`` is the join's last arrival
    follow_up: tuple[tuple[str, str], ...]  # (kind, stage) events that must follow exactly once


CASES = {
    # saga_transition: the render result releases the fork (two tasks in the outbox)
    "render-result": LostReply("render-thumbnail", None, ()),
    # saga_arrive: the last branch arrives and the join's release goes to the outbox
    "last-arrival": LostReply(
        "technical-metadata",
        "metadata.extract",
        (("join.released", "derive-join"), ("stage.dispatched", "publish")),
    ),
}


def applies_result(run_id: str, stage: str) -> re.Pattern[bytes]:
    """Matches the FCALL argument (one RESP line: JSON holds no raw CRLF) of the transition that applies
    the first attempt's result of ``stage`` of run ``run_id``, whatever the order of the spec's fields."""
    return re.compile(
        rb"(?m)^(?=[^\r\n]*\"run_id\":\"" + run_id.encode() + rb"\")"
        rb"(?=[^\r\n]*\[\"stage\.completed\",\"" + stage.encode() + rb"\",\"1\")"
    )


def dropped_spec(request: bytes, run_id: str, stage: str) -> dict[str, Any]:
    """That transition's spec, from the bytes whose reply was dropped (which may also hold the end of
    earlier commands on the connection)."""
    found = []
    for line in request.split(b"\r\n"):
        try:
            spec = json.loads(line) if line.startswith(b"{") else None
        except json.JSONDecodeError:
            continue  # the cut-off end of an earlier command
        rows = [row[:3] for row in spec.get("history", [])] if isinstance(spec, dict) else []
        if spec and spec.get("run_id") == run_id and ["stage.completed", stage, "1"] in rows:
            found.append(spec)
    assert len(found) == 1, f"{len(found)} results of {stage} of run {run_id} in {request[:300]!r}..."
    return dict(found[0])


def spec_tasks(spec: dict[str, Any]) -> list[str]:
    """The ids of the tasks a transition put in the outbox."""
    return [mid for mid, payload in spec["outbox"] if json.loads(payload).get("kind") == "task"]


def lost_reply_violations(run: invariants.RunView, spec: dict[str, Any], case: LostReply) -> list[str]:
    """The transition's effect exists exactly once, what it caused happened once, and the result that was
    applied without the orchestrator hearing so came back as a recognised duplicate."""
    found = []
    for kind, stage, attempt, detail in spec["history"]:
        n = sum(
            1
            for e in run.history
            if (e.kind, e.stage, e.attempt, e.detail)
            == (kind, stage, int(attempt) if attempt else None, json.loads(detail))
        )
        if n != 1:
            found.append(f"the dropped transition's {kind} {stage} {detail} is in history {n} times")
    arrivals = [e.detail.get("branch") for e in run.history if e.kind == "branch.arrived"]
    if case.slow and arrivals[-1:] != [case.stage]:
        found.append(f"meant to lose the last arrival's reply, but the branches arrived {arrivals}")
    for kind, stage in case.follow_up:
        if run.count(kind, stage) != 1:
            found.append(f"{kind} {stage} happened {run.count(kind, stage)} times after the lost reply")
    # one outbox entry per message it caused (a release message travels with the arrival; a join's last
    # branch releases the join itself and has none)
    release = spec.get("arrival", {}).get("release")
    caused = [mid for mid, _ in spec["outbox"]] + ([release[0]] if release else [])
    if len(set(caused)) != len(caused):
        found.append(f"the dropped transition wrote duplicate outbox entries: {caused}")
    dispatched = [row for row in spec["history"] if row[0] == "stage.dispatched"]
    tasks = spec_tasks(spec)
    if len(tasks) != len(dispatched):
        found.append(f"{len(tasks)} task outbox entries for {len(dispatched)} dispatches")
    duplicates = [
        e
        for e in run.history
        if e.kind == "callback.rejected"
        and e.detail.get("reason") == "duplicate"
        # recorded by Lua for a re-sent FCALL (with the id), or by the engine for a redelivery
        and (e.detail.get("message_id") == spec["mid"] or e.stage == case.stage)
    ]
    if not duplicates:
        found.append("the result applied under a lost reply was never recorded as a duplicate")
    return found


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_lost_reply_to_an_executed_transition_changes_nothing(
    case: str, fault_seed: FaultSeed, tmp_path: Path
) -> None:
    rng, lost = fault_seed.rng, CASES[case]
    starts = [Start("model-ingest", {"modelId": f"lost-{i}"}, f"lost-{i}") for i in range(5)]
    target = rng.choice(starts)
    with stack_behind_proxy(f"lost-{case}", tmp_path) as (stack, proxy):
        if lost.slow:
            stack.world.set_fault(target.context["modelId"], lost.slow, delay_ms=rng.randint(300, 800))
        # Given the reply to the FCALL that applies the target's result will be lost: the transition
        # commits in Redis, but the orchestrator only sees its connection die
        proxy.drop_reply_after(applies_result(target.run_id, lost.stage))
        # When a light load runs
        start_all(stack.settings, starts, threads=1)
        pending = invariants.wait_for_convergence(stack.redis, stack.prefix, [s.run_id for s in starts], 60)
        if pending:
            print(log_tail(stack, "orchestrator"))
        assert_no_violations(pending, f"liveness after a lost reply (seed {fault_seed.seed})")

        # Then the reply was lost once, for the transition meant, and its effect exists exactly once
        assert proxy.stats().replies_dropped == 1, proxy.stats()
        [request] = proxy.dropped_requests()
        spec = dropped_spec(request, target.run_id, lost.stage)
        [run] = invariants.load_runs(stack.redis, stack.prefix, [target.run_id])
        effect = lost_reply_violations(run, spec, lost)
        ledger = stack.world.effects()
        for key in spec_tasks(spec):
            if key not in ledger:  # a task's message id is its idempotency key
                effect.append(f"task {key}, dispatched by the dropped transition, never acted")
        assert_no_violations(effect, f"the lost reply's effect (seed {fault_seed.seed})")

        # And every invariant holds for every run; nothing is dead-lettered or left in a queue
        violations = invariants.check_runs(
            stack.redis, stack.prefix, [s.run_id for s in starts], all_runs=True
        )
        violations += invariants.dead_letters(stack.queue_depths())
        assert_no_violations(violations, f"the invariants after a lost reply (seed {fault_seed.seed})")
        poll(lambda: not busy_queues(stack), 30, what="every queue to drain")

"""Scaling under load: shards added, orchestrator processes joining and one killed, shards drained and
retired, all while 400 model-ingest runs and a bag of 2,000 items are in flight.

The scenario, on the real services with real processes (``saga`` commands through the CLI):

1. one orchestrator process that follows the shard map (fast.0-3, slow.0-3) and a worker; the bag and
   the first 100 model-ingest runs start;
2. ``saga shards add --class fast --count 4`` while the bag runs: fast.4-7; 100 more runs start, and the
   holder runs (below);
3. two more orchestrator processes, started without ``--shards``: the three divide the shards evenly;
   75 more runs start;
4. the process holding the most unfinished runs is killed with SIGKILL; 50 more runs start; within 30 s
   the two left divide every shard between them and really consume it;
5. ``saga shards drain`` of three fast shards that hold holder runs; ``saga shards retire`` of each is
   refused (exit 1, with what it holds) and changes nothing; 75 more runs start (none may land on a
   draining shard), and starts sent again for runs of the drained shards are forwarded to them and
   recorded there as duplicates;
6. the holders are let go, the drained shards empty, and ``saga shards retire`` of each succeeds: 5 fast
   shards are left, divided evenly between the two living processes.

The holder runs (``scale-holder``, published by this test) make "a shard that still holds work"
deterministic: their one task waits on a task queue of its own that no worker serves, until the test
starts one that does. Without them a retire refused "while the shard holds work" would depend on timing.

Asserted at the end: every run completed with the fault suite's shared invariants (nothing lost, nothing
doubled, one effect per task, no dead letter, nothing rejected); every run's record and history are on
the shard that created it and on no other; the new shards took their share of the starts made after the
add and the drained ones none after the drain; and ``saga shards list --json`` shows it all (states, the
5 + 4 served shards, who serves each, nothing held).
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from orchestrator.provision import compile_files, publish_plans
from orchestrator.store.keys import ShardKeys, index_key
from orchestrator.store.membership import members_key
from tests.faults import invariants
from tests.faults.harness import (
    FaultSeed,
    Start,
    await_convergence,
    invariant_violations,
    mixed_workload,
    start_all,
)
from tests.faults.invariants import assert_no_violations
from tests.faults.lifecycle import active_consumers, is_task_queue, named_amqp_url, wait_until_consuming
from tests.integration.stack import REGISTRY, Stack, poll

pytestmark = [pytest.mark.services, pytest.mark.slow]

SHARDS = 4  # per class at first: fast.0-3, slow.0-3
ADDED = ["fast.4", "fast.5", "fast.6", "fast.7"]
KNOWN = [f"fast.{n}" for n in range(8)] + [f"slow.{n}" for n in range(SHARDS)]
RUNS = 400  # model-ingest runs, started in batches:
BATCHES = (100, 100, 75, 50, 75)  # before the add, after it, after the join, after the kill, after the drains
assert sum(BATCHES) == RUNS
BAG_ITEMS = 2000
LONG_ITEMS, LONG_ITEM_MS = 3, 15_000  # bag items slow enough that the bag still runs at the add
HOLDERS = 24  # over 8 shards: fewer than 3 shards holding one has odds of 1 in 10^13
HOLD_QUEUE = "tasks.scale-hold"
AGAIN = 30  # starts sent again, for runs of the drained shards
TAKEOVER_S = 30.0  # the bound the scenario claims for a killed process's shards
SETTLE_S = 60.0  # liveness bounds, far above what each step takes; not timing claims
CONVERGE_S = 120.0

HOLDER = f"""\
# A run whose one task waits on a task queue that no worker serves until the test starts one that does.
name: scale-holder
version: "1.0.0"
class: fast
entry: hold
context:
  type: object
  properties:
    modelId: {{ type: string, minLength: 1 }}
  required: [modelId]
output:
  modelId: "${{context.modelId}}"
stages:
  - name: hold
    type: worker
    queue: {HOLD_QUEUE}
    worker: thumbnail.render@3
    input: {{ modelId: "${{context.modelId}}" }}
    on_success: completed
    on_failure: failed
"""

Listing = dict[str, Any]  # saga shards list --json
Owners = dict[str, str | None]  # served shard -> the living process whose share it is


# ---- reading the shard map and its members -------------------------------------------------------------


def shards_list(stack: Stack) -> Listing:
    listing: Listing = stack.saga_json("shards", "list")
    return listing


def by_shard(listing: Listing) -> dict[str, dict[str, Any]]:
    return {s["shard"]: s for s in listing["shards"]}


def owners(stack: Stack, listing: Listing) -> Owners:
    """Served shard -> the name of the stack's living process whose share the listing says it is (None:
    no owner, or a member that is no living process). Member ids are ``<host>:<pid>:<random>``."""
    by_pid = {process.pid: name for name, process in stack.processes.items()}
    found: Owners = {}
    for s in listing["shards"]:
        if s["state"] != "retired":
            parts = (s["serving"] or "").rsplit(":", 2)
            found[s["shard"]] = by_pid.get(int(parts[1])) if len(parts) == 3 and parts[1].isdigit() else None
    return found


def uneven(owner: Owners, names: list[str]) -> list[str]:
    """What keeps the split of the served shards over ``names`` from being even: an owner that is not
    one of them, or counts more than one apart in a class or over all classes."""
    problems = [f"{shard} is served by {who}" for shard, who in sorted(owner.items()) if who not in names]
    groups = {c: [s for s in owner if s.startswith(f"{c}.")] for c in ("fast", "slow")}
    groups["all classes"] = list(owner)
    for what, shards in groups.items():
        counts = Counter(owner[s] for s in shards)
        share = [counts.get(n, 0) for n in names]
        if max(share) - min(share) > 1:
            problems.append(f"{what}: {dict(zip(names, share, strict=True))} shards")
    return problems


def even_split(stack: Stack, names: list[str]) -> tuple[Listing, Owners] | None:
    """The listing and its owners once ``saga shards list`` divides every served shard evenly over the
    living processes ``names``, and each of them is the shard queue's active consumer (as the broker
    says); None before."""
    listing = shards_list(stack)
    owner = owners(stack, listing)
    if uneven(owner, names):
        return None
    consuming = active_consumers(stack)
    if any(consuming.get(f"saga.shard.{shard}") != who for shard, who in owner.items()):
        return None
    return listing, owner


def settle(stack: Stack, names: list[str], timeout_s: float, what: str) -> tuple[Listing, Owners]:
    try:
        found: tuple[Listing, Owners] = poll(lambda: even_split(stack, names), timeout_s, 0.5, what)
    except AssertionError:
        owner = owners(stack, shards_list(stack))
        print(f"owners {owner}, uneven {uneven(owner, names)}, active consumers {active_consumers(stack)}")
        raise
    return found


# ---- where runs are ---------------------------------------------------------------------------------


def homes(stack: Stack, run_ids: list[str]) -> dict[str, str | None]:
    """Run -> the shard that created it (the run-id index, written by the creating transition)."""
    found: list[str | None] = stack.redis.mget([index_key(stack.prefix, r) for r in run_ids])  # type: ignore[assignment]
    return dict(zip(run_ids, found, strict=True))


def elsewhere(stack: Stack, run_ids: list[str]) -> list[str]:
    """Runs with a record or a history under a shard other than the one that created them: a run that
    moved, or was created twice. (That the creating shard's record and history hold the whole run, from
    its start to its end, is the shared invariants' part.)"""
    placed = homes(stack, run_ids)
    asked = [(r, s) for r, home in placed.items() for s in KNOWN if s != home]
    with stack.redis.pipeline(transaction=False) as pipe:
        for run_id, shard in asked:
            pipe.exists(
                ShardKeys(stack.prefix, shard).run(run_id), ShardKeys(stack.prefix, shard).history(run_id)
            )
        found = pipe.execute()
    return [
        f"run {run_id} (created on {placed[run_id]}) has keys on {shard}"
        for (run_id, shard), n in zip(asked, found, strict=True)
        if n
    ]


def duplicate_starts(stack: Stack, run_id: str) -> int:
    """How many starts of the run its history records as refused duplicates (by the applied-id set, or by
    the engine finding the run)."""
    return sum(
        e.kind == "callback.rejected"
        and e.detail.get("reason") == "duplicate"
        and (
            e.detail.get("message_id") == f"start-{run_id}"
            or e.detail.get("detail") == "the run already exists"
        )
        for e in invariants.load_run(stack.redis, stack.prefix, run_id, {}).history
    )


def number(shard: str) -> int:
    return int(shard.rsplit(".", 1)[1])


# ---- the scenario ---------------------------------------------------------------------------------------


@dataclass
class Scale:
    stack: Stack
    rng: random.Random
    bag: Start
    batches: list[list[Start]]
    holders: list[Start]
    living: list[str] = field(default_factory=list)
    targets: list[str] = field(default_factory=list)  # the fast shards drained and retired
    again: list[Start] = field(default_factory=list)  # started a second time, after the drains
    duplicates: dict[str, int] = field(default_factory=dict)  # their runs' duplicate starts before that
    steps: list[str] = field(default_factory=list)
    began: float = field(default_factory=time.monotonic)

    @property
    def starts(self) -> list[Start]:
        return [self.bag, *(s for batch in self.batches for s in batch), *self.holders]

    @property
    def run_ids(self) -> list[str]:
        return [s.run_id for s in self.starts]

    def step(self, what: str) -> None:
        self.steps.append(f"{time.monotonic() - self.began:6.1f} s  {what}")
        print(self.steps[-1])

    def orchestrator(self, name: str) -> None:
        self.stack.start_orchestrator(name, extra_env={"SAGA_AMQP_URL": named_amqp_url(self.stack, name)})
        self.living.append(name)

    def status(self, start: Start) -> str | None:
        return self.stack.record(start.run_id).get("status")

    # ---- 1-3: add shards and processes under load --------------------------------------------------

    def grow(self) -> None:
        stack = self.stack
        start_all(stack.settings, [self.bag, *self.batches[0]])
        poll(lambda: self.status(self.bag) == "running", SETTLE_S, what="the bag to be created")
        self.step(f"the bag of {BAG_ITEMS} items and {len(self.batches[0])} runs started")

        added = stack.saga_json("shards", "add", "--class", "fast", "--count", "4")
        assert added == {"added": ADDED}, added
        assert self.status(self.bag) == "running", "the bag finished before the add: no load to scale under"
        self.step("fast.4-7 added while the bag runs")
        start_all(stack.settings, self.batches[1] + self.holders)

        self.orchestrator("orch-b")
        self.orchestrator("orch-c")
        _, owner = settle(stack, self.living, SETTLE_S, "the shards to spread over three processes")
        self.step(f"three processes serve {dict(Counter(owner.values()))} shards")
        start_all(stack.settings, self.batches[2])

    # ---- 4: a process killed ---------------------------------------------------------------------

    def kill(self) -> None:
        """SIGKILL the process whose shards hold the most unfinished runs; the two left must serve every
        shard within TAKEOVER_S."""
        stack = self.stack
        listing = shards_list(stack)
        owner = owners(stack, listing)
        held: Counter[str | None] = Counter()
        for load in listing["shards"]:
            held[owner.get(load["shard"])] += load["unfinished_runs"]
        victim = max(self.living, key=lambda n: held[n])
        assert held[victim], f"no process holds an unfinished run: {held}"
        [member] = {s["serving"] for s in listing["shards"] if owner.get(s["shard"]) == victim}
        killed_at = time.monotonic()
        stack.stop(victim, signal.SIGKILL)
        self.living.remove(victim)
        self.step(f"{victim} killed with SIGKILL, its shards holding {held[victim]} unfinished runs")
        start_all(stack.settings, self.batches[3])

        # The two left drop its member once its lease has ended, and take its shards in the same reading
        # of the map: ask the broker who consumes what from then on (each asking takes seconds)
        poll(
            lambda: (
                not any(stack.redis.zscore(members_key(stack.prefix, c), member) for c in ("fast", "slow"))
            ),
            TAKEOVER_S - (time.monotonic() - killed_at),
            0.1,
            f"{victim}'s membership to end",
        )
        dropped = time.monotonic() - killed_at
        left_s = TAKEOVER_S - (time.monotonic() - killed_at)
        _, owner = settle(stack, self.living, left_s, f"{victim}'s shards to be served again")
        took = time.monotonic() - killed_at
        shares = dict(Counter(owner.values()))
        self.step(
            f"{victim} out of the members {dropped:.1f} s after the kill, its shards served at {took:.1f} s"
        )
        self.step(f"the two left serve {shares} shards")

    # ---- 5-6: drain, retire refused, retire -------------------------------------------------------

    def choose_targets(self) -> Counter[str | None]:
        """Three fast shards that hold holder runs: one of the first four and two added ones when the
        holders allow it (seeded), else any three. Returns the holders per shard."""
        ids = [s.run_id for s in self.holders]
        poll(lambda: all(homes(self.stack, ids).values()), SETTLE_S, what="every holder run to be created")
        held_on = Counter(homes(self.stack, ids).values())
        assert len(held_on) >= 3, f"holders on fewer than three shards: {held_on}"
        first = sorted(s for s in held_on if s and s not in ADDED)
        new = sorted(s for s in held_on if s in ADDED)
        rng = self.rng
        if first and len(new) >= 2:
            chosen = rng.sample(first, 1) + rng.sample(new, 2)
        else:
            chosen = rng.sample(sorted(s for s in held_on if s), 3)
        self.targets = sorted(chosen, key=number)
        return held_on

    def drain(self) -> None:
        stack = self.stack
        held_on = self.choose_targets()
        before = [s for s in self.starts if s not in self.batches[4]]
        for target in self.targets:
            assert stack.saga_json("shards", "drain", target) == {"shard": target, "state": "draining"}
        self.step(f"{', '.join(self.targets)} draining, with {[held_on[t] for t in self.targets]} holders")

        # retire is refused while they hold work, and changes nothing
        assert all(self.status(s) == "running" for s in self.holders), "a holder run got past its gate"
        for target in self.targets:
            refused = stack.saga("shards", "retire", target, "--json")
            assert refused.returncode == 1, (target, refused.returncode, refused.stdout, refused.stderr)
            error = json.loads(refused.stdout)["error"]
            assert error["code"] == "retire_refused", error
            holds = re.search(r"it still holds (\d+) unfinished run\(s\)", error["message"])
            assert holds and int(holds.group(1)) >= held_on[target], error["message"]
            assert error["message"].endswith("nothing was changed"), error["message"]
        loads = by_shard(shards_list(stack))
        for target in self.targets:
            assert loads[target]["state"] == "draining", loads[target]
            assert loads[target]["queued"] is not None, f"{target}'s queue is gone after a refused retire"
        self.step("retire refused for each while it holds work")

        # starts go on, and a start sent again for a run of a drained shard is forwarded to it
        start_all(stack.settings, self.batches[4])
        placed = homes(stack, [s.run_id for s in before])
        on_targets = [s for s in before if placed[s.run_id] in self.targets]
        self.again = self.rng.sample(on_targets, k=min(AGAIN, len(on_targets)))
        self.duplicates = {s.run_id: duplicate_starts(stack, s.run_id) for s in self.again}
        start_all(stack.settings, self.again)
        self.step(
            f"{len(self.batches[4])} runs started after the drains, {len(self.again)} starts sent again"
        )

    def retire(self) -> None:
        stack = self.stack
        # every start sent again has reached its run's shard (forwarded by the active shard it landed
        # on): one still on its way when the shard is retired would find no queue to go to
        poll(
            lambda: all(duplicate_starts(stack, r) > n for r, n in self.duplicates.items()),
            SETTLE_S,
            0.2,
            "every start sent again to be recorded as a duplicate on its run's shard",
        )
        stack.start_worker("release", "--queue", HOLD_QUEUE)  # the holders' gate opens

        def empty() -> bool:
            loads = by_shard(shards_list(stack))
            return all(
                (loads[t]["unfinished_runs"], loads[t]["outbox"], loads[t]["timers"], loads[t]["queued"])
                == (0, 0, 0, 0)
                and not loads[t]["dead_letters"]
                for t in self.targets
            )

        poll(empty, SETTLE_S, 0.5, f"{', '.join(self.targets)} to hold nothing")
        self.step("the drained shards hold nothing")
        for target in self.targets:
            assert stack.saga_json("shards", "retire", target) == {"shard": target, "state": "retired"}
        self.step(f"{', '.join(self.targets)} retired")

    # ---- the checks -----------------------------------------------------------------------------

    def placement(self) -> list[str]:
        """The new shards took their share of the starts made after the add (each at least a third of an
        even share: odds of 1 in 250,000 against; together 30-70 %), the drained shards none of those
        made after the drains, and each fast shard left some (odds of 1 in 3,000,000 against)."""
        placed = homes(self.stack, self.run_ids)
        after_add = [s.run_id for s in self.batches[1] + self.holders + self.batches[2] + self.batches[3]]
        share = Counter(placed[r] for r in after_add)
        found = [
            f"{shard} got {share[shard]} of the {len(after_add)} starts after the add: {share}"
            for shard in ADDED
            if share[shard] < len(after_add) // 8 // 3
        ]
        if not 0.3 < sum(share[s] for s in ADDED) / len(after_add) < 0.7:
            found.append(f"the new shards got {share} of the {len(after_add)} starts after the add")
        after_drain = Counter(placed[s.run_id] for s in self.batches[4])
        left = [s for s in KNOWN if s.startswith("fast.") and s not in self.targets]
        found += [
            f"{t} drained but got {after_drain[t]} starts made after" for t in self.targets if after_drain[t]
        ]
        found += [
            f"{s} got none of the starts after the drains: {after_drain}" for s in left if not after_drain[s]
        ]
        return found

    def final_listing(self, listing: Listing, owner: Owners) -> list[str]:
        """``saga shards list --json`` once everything converged: seed, add, 3 drains, 3 retires; the
        retired shards without queues or owners, the 5 + 4 others active, empty and served evenly by the
        two living processes."""
        found = [] if listing["version"] == 8 else [f"shard map version {listing['version']}, expected 8"]
        loads = by_shard(listing)
        if list(loads) != KNOWN:
            found.append(f"the shard map lists {list(loads)}, expected {KNOWN}")
        for shard, load in sorted(loads.items()):
            if shard in self.targets:
                expected: dict[str, Any] = {"state": "retired", "queued": None, "consumers": None}
                expected["serving"] = None
            else:
                expected = {"state": "active", "queued": 0, "unfinished_runs": 0, "outbox": 0, "timers": 0}
                expected["dead_letters"] = 0
            got = {k: load[k] for k in expected}
            if got != expected:
                found.append(f"saga shards list: {shard} is {got}, expected {expected}")
        if len(owner) != 5 + SHARDS:
            found.append(f"{len(owner)} shards served, expected {5 + SHARDS}: {owner}")
        return found + uneven(owner, self.living)


def test_shards_added_processes_joined_and_killed_shards_drained_and_retired_under_load(
    fault_seed: FaultSeed, tmp_path: Path
) -> None:
    """400 model-ingest runs, a bag of 2,000 items and 24 holder runs, started in batches while fast
    shards go 4 -> 8 -> 5 and orchestrator processes 1 -> 3 -> 2 (one killed). Asserts: retire refused
    while a drained shard holds work, done once it is empty; a killed process's shards served again
    within 30 s; new starts on the new shards and never on a draining one; every run on the shard that
    created it, completed, with every shared invariant; the final ``saga shards list``."""
    rng = fault_seed.rng
    stack = Stack("scale", shard_count=SHARDS)
    try:
        stack.setup()
        holder = tmp_path / "scale-holder.yaml"
        holder.write_text(HOLDER)
        asyncio.run(publish_plans(stack.settings, compile_files([holder], REGISTRY, stack.settings)))
        work = mixed_workload(
            stack, rng, runs=RUNS, during=RUNS - BATCHES[0], bag_items=BAG_ITEMS, tag="scale"
        )
        bag, *first = work.before
        for item in rng.sample(bag.context["modelIds"], k=LONG_ITEMS):
            stack.world.set_fault(item, "thumbnail.render", delay_ms=LONG_ITEM_MS)
        later = iter(work.during)
        batches = [first] + [[next(later) for _ in range(n)] for n in BATCHES[1:]]
        holders = [Start("scale-holder", {"modelId": f"hold-{i}"}, f"hold-{i}") for i in range(HOLDERS)]
        scale = Scale(stack, rng, bag, batches, holders)

        # Given one orchestrator process following the map, and a worker that does not serve the holders
        scale.orchestrator("orch-a")
        stack.start_worker("worker", "--concurrency", "64")
        wait_until_consuming(stack, is_task_queue)
        settle(stack, scale.living, SETTLE_S, "orch-a to serve every shard")
        scale.step("orch-a serves fast.0-3 and slow.0-3")

        # When fast shards are added and processes join, runs starting all along
        scale.grow()
        # ... and one process is killed, its shards served again by the two left
        scale.kill()
        # ... and three fast shards drain, refuse to retire while they hold work, and retire once empty
        scale.drain()
        scale.retire()

        # Then every run completes on the shard that created it, with every invariant holding
        what = f"scaling under load (seed {fault_seed.seed})"
        await_convergence(stack, scale.run_ids, what, CONVERGE_S, logs=(*scale.living, "worker", "release"))
        listing, owner = settle(
            stack, scale.living, SETTLE_S, "the served shards to spread over the two left"
        )
        scale.step(f"converged; the two left serve {dict(Counter(owner.values()))} shards")
        violations = invariant_violations(stack, scale.run_ids)
        violations += elsewhere(stack, scale.run_ids)
        violations += scale.placement()
        violations += scale.final_listing(listing, owner)
        assert_no_violations(violations, f"{what}; steps:\n" + "\n".join(scale.steps))
    finally:
        stack.teardown()

"""The shard map's rules, pure: numbers never reused, moves only forward, a class never without an active
shard, and the topology it gives."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from orchestrator.bus.names import Names
from orchestrator.bus.topology import build_topology
from orchestrator.shardmap import ShardMap, ShardMapRefused, ShardState, balanced, owners, pinned

NAMES = Names()


def test_seed_is_every_class_times_the_count_all_active() -> None:
    seeded = ShardMap.seed(("fast", "slow"), 2)
    assert seeded.version == 1
    assert seeded.active == seeded.served == seeded.known == ["fast.0", "fast.1", "slow.0", "slow.1"]


def test_numbers_continue_after_the_highest_ever_used_and_retired_ones_are_not_reused() -> None:
    grown = ShardMap.seed(("fast",), 2).with_added("fast", 2)
    assert grown.known == ["fast.0", "fast.1", "fast.2", "fast.3"] and grown.version == 2
    retired = grown.with_state("fast.3", ShardState.DRAINING).with_state("fast.3", ShardState.RETIRED)
    again = retired.with_added("fast", 1)
    assert "fast.4" in again.known and again.entry("fast.3").state is ShardState.RETIRED
    assert again.served == ["fast.0", "fast.1", "fast.2", "fast.4"]


@pytest.mark.parametrize(
    ("moves", "says"),
    [
        ([ShardState.RETIRED], "only a draining one retired"),
        ([ShardState.DRAINING, ShardState.DRAINING], "only an active shard can be drained"),
        ([ShardState.DRAINING, ShardState.RETIRED, ShardState.DRAINING], "is retired"),
    ],
)
def test_moves_only_go_forward(moves: list[ShardState], says: str) -> None:
    shard_map = ShardMap.seed(("fast",), 3)
    with pytest.raises(ShardMapRefused, match=says):
        for state in moves:
            shard_map = shard_map.with_state("fast.1", state)


def test_the_last_active_shard_of_a_class_cannot_drain() -> None:
    shard_map = ShardMap.seed(("fast", "slow"), 1)
    with pytest.raises(ShardMapRefused, match=r"last active shard of class fast.*shards add --class fast"):
        shard_map.with_state("fast.0", ShardState.DRAINING)


def test_unknown_shards_and_classes_are_refused_with_what_there_is() -> None:
    shard_map = ShardMap.seed(("fast",), 2)
    with pytest.raises(
        ShardMapRefused, match=r"fast\.9 is not in the shard map \(it has: fast\.0, fast\.1\)"
    ):
        shard_map.with_state("fast.9", ShardState.DRAINING)
    with pytest.raises(ShardMapRefused, match="class 'medium' is not in the shard map"):
        shard_map.with_added("medium", 1)


def test_json_round_trip() -> None:
    shard_map = (
        ShardMap.seed(("fast", "slow"), 2).with_added("slow", 1).with_state("fast.0", ShardState.DRAINING)
    )
    assert ShardMap.from_json(shard_map.to_json()) == shard_map


def test_the_topology_binds_only_active_shards_to_starts_and_has_no_retired_queue() -> None:
    shard_map = ShardMap.seed(("fast",), 3).with_state("fast.1", ShardState.DRAINING)
    shard_map = shard_map.with_state("fast.2", ShardState.DRAINING).with_state("fast.2", ShardState.RETIRED)
    topology = build_topology(NAMES, shard_map, [], 20)
    starts = {b.destination for b in topology.bindings if b.source == "saga.start.fast"}
    runs = {b.destination for b in topology.bindings if b.source == "saga.runs"}
    assert starts == {"saga.shard.fast.0"}
    assert runs == {"saga.shard.fast.0", "saga.shard.fast.1"}
    assert "saga.shard.fast.2" not in {q.name for q in topology.queues}


def test_a_pin_names_served_shards_only() -> None:
    shard_map = ShardMap.seed(("fast", "slow"), 4).with_state("fast.3", ShardState.DRAINING)
    assert pinned(shard_map, "1,3", ("fast",)) == ["fast.1", "fast.3"]
    assert pinned(shard_map, "", ("slow",)) == ["slow.0", "slow.1", "slow.2", "slow.3"]
    with pytest.raises(ShardMapRefused, match=r"\[7\] are not served shards of fast"):
        pinned(shard_map, "0,7", ("fast",))


@given(st.lists(st.tuples(st.sampled_from(["add", "drain", "retire"]), st.integers(0, 9)), max_size=30))
def test_any_sequence_of_changes_keeps_the_rules(steps: list[tuple[str, int]]) -> None:
    shard_map = ShardMap.seed(("fast",), 2)
    ever: set[str] = set(shard_map.known)
    for op, n in steps:
        before = shard_map
        try:
            if op == "add":
                shard_map = shard_map.with_added("fast", 1 + n % 3)
            else:
                state = ShardState.DRAINING if op == "drain" else ShardState.RETIRED
                shard_map = shard_map.with_state(f"fast.{n}", state)
        except ShardMapRefused:
            assert shard_map == before
            continue
        assert shard_map.version == before.version + 1
        assert set(before.known) <= set(shard_map.known)  # nothing is ever forgotten
        new = set(shard_map.known) - set(before.known)
        assert not new & ever  # numbers never reused
        ever |= new
        assert shard_map.in_state(ShardState.ACTIVE)  # never without an active shard
        for entry in before.shards:  # states only move forward
            order = [ShardState.ACTIVE, ShardState.DRAINING, ShardState.RETIRED]
            assert order.index(shard_map.entry(entry.id).state) >= order.index(entry.state)


def _map(fast: int, slow: int) -> ShardMap:
    shard_map = ShardMap.seed(("fast", "slow"), 1)
    for shard_class, count in (("fast", fast), ("slow", slow)):
        if count > 1:
            shard_map = shard_map.with_added(shard_class, count - 1)
    return shard_map


@given(st.integers(1, 40), st.integers(1, 40), st.integers(1, 6))
def test_members_divide_the_shards_evenly_each_once(fast: int, slow: int, n: int) -> None:
    members = [f"p{i}" for i in range(n)]
    shard_map = _map(fast, slow)
    split = owners(shard_map, {"fast": members, "slow": members})
    assert sorted(split) == sorted(shard_map.served)  # every served shard, once
    for shard_class in ("fast", "slow"):
        counts = Counter(m for s, m in split.items() if s.startswith(f"{shard_class}."))
        assert max(counts.values()) - min(counts.get(m, 0) for m in members) <= 1  # even within the class
    totals = Counter(split.values())
    assert max(totals.values()) - min(totals.get(m, 0) for m in members) <= 1  # and over the classes
    assert balanced([f"fast.{i}" for i in range(fast)], []) == {}


@given(st.integers(8, 60), st.integers(2, 8), st.randoms(use_true_random=False))
def test_a_member_joining_or_leaving_moves_few_shards(count: int, n: int, rng: random.Random) -> None:
    assume(count >= 4 * n)  # a few shards each, as a deployment has
    # Given members dividing one class's shards
    shards = [f"fast.{i}" for i in range(count)]
    members = [f"p{i}" for i in range(n)]
    before = balanced(shards, members)
    # When one joins, or one leaves
    joined = balanced(shards, [*members, "newcomer"])
    gone = rng.choice(members)
    left = balanced(shards, [m for m in members if m != gone])
    # Then the others keep most of their shards: at most a quarter of all shards move beyond the
    # newcomer's share or the leaver's (a sorted round-robin moves 60-95 % of them)
    moved_on_join = sum(1 for s in shards if joined[s] != before[s])
    moved_on_leave = sum(1 for s in shards if left[s] != before[s])
    assert moved_on_join <= count / (n + 1) + count / 4
    assert moved_on_leave <= sum(1 for s in shards if before[s] == gone) + count / 4
    # and what the one that left held went to the others
    assert all(left[s] != gone for s in shards)


def test_the_split_is_the_same_whoever_computes_it_and_in_whatever_order() -> None:
    shards = [f"fast.{i}" for i in range(30)]
    members = ["a", "b", "c", "d"]
    assert balanced(shards, members) == balanced(list(reversed(shards)), list(reversed(members)))
    assert balanced(shards, members) == balanced(shards, [*members, "a"])  # a member listed twice

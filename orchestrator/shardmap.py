"""The shard map: which shards exist, per class, and what each may do. Pure; stored by
``orchestrator.store.shardmap_store``.

A shard is ``active`` (its queue is bound to its class's start exchange: new starts land on it),
``draining`` (unbound: no new starts, still served until its runs are finished) or ``retired`` (empty,
its queues deleted; its finished runs stay readable until their retention ends). The only moves are
active -> draining -> retired. Numbers continue after the highest ever used and are never reused, so a
run id's shard never names two different shards over time. Every change makes a new map with the next
version; the store writes it only over the version it was made from.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from orchestrator.bus.names import shard_id, shard_numbers
from orchestrator.errors import SagaError


class ShardState(StrEnum):
    ACTIVE = "active"
    DRAINING = "draining"
    RETIRED = "retired"


class ShardMapRefused(SagaError):
    """A change the shard map does not allow (an unknown shard, a move out of order, a class that is not
    there); names the shard and what to do."""

    code = "shard_refused"
    id_fields = ("shard",)

    def __init__(self, shard: str, why: str) -> None:
        self.shard = shard
        super().__init__(why)


@dataclass(frozen=True, order=True)
class ShardEntry:
    shard_class: str
    number: int
    state: ShardState = ShardState.ACTIVE

    @property
    def id(self) -> str:
        return shard_id(self.shard_class, self.number)


@dataclass(frozen=True)
class ShardMap:
    version: int
    shards: tuple[ShardEntry, ...]

    @classmethod
    def seed(cls, classes: Iterable[str], count: int) -> ShardMap:
        """The first map: ``count`` active shards per class (``SAGA_SHARD_CLASSES``, ``SAGA_SHARD_COUNT``).
        Raises ValueError for settings no map can satisfy."""
        listed = tuple(classes)
        if not listed:
            raise ValueError("at least one shard class is needed")
        if len(set(listed)) != len(listed):
            raise ValueError(f"shard classes are listed twice: {', '.join(listed)}")
        if count < 1:
            raise ValueError(f"shard count must be at least 1, got {count}")
        return cls(1, tuple(ShardEntry(c, n) for c in listed for n in range(count)))

    @property
    def classes(self) -> list[str]:
        return list(dict.fromkeys(e.shard_class for e in self.shards))

    def entry(self, shard: str) -> ShardEntry:
        for entry in self.shards:
            if entry.id == shard:
                return entry
        known = ", ".join(e.id for e in self.shards)
        raise ShardMapRefused(shard, f"shard {shard} is not in the shard map (it has: {known})")

    def in_state(self, *states: ShardState, shard_class: str | None = None) -> list[str]:
        return [
            e.id
            for e in self.shards
            if e.state in states and (shard_class is None or e.shard_class == shard_class)
        ]

    @property
    def active(self) -> list[str]:
        """Shards that take new starts."""
        return self.in_state(ShardState.ACTIVE)

    @property
    def served(self) -> list[str]:
        """Shards an orchestrator must serve: active and draining ones."""
        return self.in_state(ShardState.ACTIVE, ShardState.DRAINING)

    @property
    def known(self) -> list[str]:
        """Every shard that ever held runs, retired ones included (their finished runs are readable)."""
        return [e.id for e in self.shards]

    def with_added(self, shard_class: str, count: int) -> ShardMap:
        if count < 1:
            raise ShardMapRefused(f"{shard_class}.*", f"--count must be at least 1, got {count}")
        if shard_class not in self.classes:
            raise ShardMapRefused(
                f"{shard_class}.*",
                f"shard class {shard_class!r} is not in the shard map (classes: {', '.join(self.classes)})",
            )
        numbers = [e.number for e in self.shards if e.shard_class == shard_class]
        first = max(numbers, default=-1) + 1
        added = tuple(ShardEntry(shard_class, n) for n in range(first, first + count))
        return ShardMap(self.version + 1, tuple(sorted(self.shards + added)))

    def with_state(self, shard: str, state: ShardState) -> ShardMap:
        entry = self.entry(shard)
        allowed = {ShardState.DRAINING: ShardState.ACTIVE, ShardState.RETIRED: ShardState.DRAINING}
        if allowed.get(state) != entry.state:
            raise ShardMapRefused(
                shard,
                f"shard {shard} is {entry.state.value}: only an active shard can be drained and only a "
                "draining one retired",
            )
        actives = self.in_state(ShardState.ACTIVE, shard_class=entry.shard_class)
        if state is ShardState.DRAINING and len(actives) == 1:
            raise ShardMapRefused(
                shard,
                f"shard {shard} is the last active shard of class {entry.shard_class}: new starts would have "
                f"nowhere to go; add one first ('saga shards add --class {entry.shard_class} --count 1')",
            )
        changed = tuple(replace(e, state=state) if e.id == shard else e for e in self.shards)
        return ShardMap(self.version + 1, changed)

    def to_json(self) -> str:
        document = {
            "version": self.version,
            "shards": [
                {"class": e.shard_class, "number": e.number, "state": e.state.value} for e in self.shards
            ],
        }
        return json.dumps(document, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> ShardMap:
        data: dict[str, Any] = json.loads(text)
        shards = (ShardEntry(s["class"], int(s["number"]), ShardState(s["state"])) for s in data["shards"])
        return cls(int(data["version"]), tuple(sorted(shards)))


def pinned(shard_map: ShardMap, spec: str, classes: Iterable[str]) -> list[str]:
    """The served shards an ``orchestrator --class C --shards 0-3`` pin names (every served one of the
    classes for an empty ``spec``); a number the map does not serve is refused."""
    wanted = list(classes)
    numbers = shard_numbers(spec)
    found = []
    for entry in shard_map.shards:
        if entry.shard_class not in wanted or entry.state is ShardState.RETIRED:
            continue
        if numbers is None or entry.number in numbers:
            found.append(entry.id)
    missing = sorted((numbers or set()) - {int(s.rsplit(".", 1)[1]) for s in found})
    if missing:
        raise ShardMapRefused(
            spec, f"shard numbers {missing} are not served shards of {', '.join(wanted)} ('saga shards list')"
        )
    return found


#: Points per member on the assignment ring. More points spread a member's share more evenly round the
#: ring, so fewer shards move when a member joins or leaves; building the ring costs members x points.
RING_POINTS = 64


def _point(text: str) -> int:
    """A position on the ring, the same in every process (Python's own ``hash`` is salted per process)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


@functools.lru_cache(maxsize=16)
def _ring(members: tuple[str, ...]) -> tuple[list[int], list[str]]:
    points = sorted((_point(f"{member}#{i}"), member) for member in members for i in range(RING_POINTS))
    return [p for p, _ in points], [m for _, m in points]


def balanced(
    shards: Iterable[str], members: Iterable[str], totals: Mapping[str, int] | None = None, salt: str = ""
) -> dict[str, str]:
    """Shard -> member, for ``members`` dividing ``shards``: every shard to one member, counts within one
    of each other, and stable, so a member joining or leaving moves about its own share of shards, not
    all of them (each move is a handover of a queue's single active consumer).

    Consistent hashing with bounded loads: each member has ``RING_POINTS`` points on a ring, and each
    shard, taken in the ring order of its own point, goes to the first member clockwise that still has
    room. Room is ``len(shards) // n`` each, plus one for the ``len(shards) % n`` members that hold the
    fewest shards so far (``totals``: what earlier classes gave them; ties broken by ``salt``, the class),
    so that totals over several classes stay within one as well. Every process computes the same answer
    from the same reading."""
    wanted = sorted(set(shards))
    group = tuple(sorted(set(members)))
    if not wanted or not group:
        return {}
    so_far = totals or {}
    base, extra = divmod(len(wanted), len(group))
    by_need = sorted(group, key=lambda m: (so_far.get(m, 0), _point(f"{salt}|{m}")))
    room = {member: base + (1 if i < extra else 0) for i, member in enumerate(by_need)}
    points, owners_at = _ring(group)
    found: dict[str, str] = {}
    for shard in sorted(wanted, key=_point):
        start = bisect.bisect(points, _point(shard))
        for step in range(len(points)):  # ends: the rooms add up to the shards
            member = owners_at[(start + step) % len(points)]
            if room[member]:
                room[member] -= 1
                found[shard] = member
                break
    return found


def owners(shard_map: ShardMap, members: Mapping[str, Iterable[str]]) -> dict[str, str]:
    """Served shard -> the member whose share it is, for the classes ``members`` (class -> live members)
    names. The one place the split is made: a member serving its share and ``saga shards list`` saying who
    serves what read it alike. Classes are divided in the map's order, each knowing what the ones before
    gave every member (:func:`balanced`)."""
    found: dict[str, str] = {}
    totals: dict[str, int] = {}
    for shard_class in shard_map.classes:
        served = shard_map.in_state(ShardState.ACTIVE, ShardState.DRAINING, shard_class=shard_class)
        split = balanced(served, members.get(shard_class, ()), totals, shard_class)
        for member in split.values():
            totals[member] = totals.get(member, 0) + 1
        found.update(split)
    return found

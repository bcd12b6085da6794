"""Every Redis key name, in one place. Pure functions of a prefix and ids.

All keys of one shard carry the shard's hash tag (``{fast.3}``), so a transition's keys share a slot and
the layout runs unchanged on Redis Cluster. Shared data has tags of its own: the run-id index is tagged
by the run id (spreads over the cluster), plans by ``{plans}``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ShardKeys:
    prefix: str
    shard: str

    @property
    def tag(self) -> str:
        return f"{self.prefix}:{{{self.shard}}}"

    def run(self, run_id: str) -> str:
        return f"{self.tag}:run:{run_id}"

    def history(self, run_id: str) -> str:
        return f"{self.tag}:run:{run_id}:history"

    def applied(self, run_id: str) -> str:
        return f"{self.tag}:run:{run_id}:applied"

    def barrier(self, run_id: str, stage: str) -> str:
        """A join's hash of arrived branches (and, for a map opened before bags had the two keys below,
        its item results: such a bag finishes in the form it began)."""
        return f"{self.tag}:run:{run_id}:barrier:{stage}"

    def bag_arrived(self, run_id: str, stage: str) -> str:
        """A map's bitmap of the items that arrived (bit i: item i), its arrivals' dedupe."""
        return f"{self.tag}:run:{run_id}:barrier:{stage}:arrived"

    def bag_results(self, run_id: str, stage: str) -> str:
        """A map's item results in arrival order, each ``<item>:<result JSON>`` (sorted at release)."""
        return f"{self.tag}:run:{run_id}:barrier:{stage}:results"

    def outbox(self) -> str:
        return f"{self.tag}:outbox"

    def runs(self) -> str:
        return f"{self.tag}:runs"

    def timers(self) -> str:
        return f"{self.tag}:timers"

    def live(self) -> str:
        """Plan digest -> this shard's runs of it not yet finished, and ``tenant:<tenant>`` -> its runs
        not yet finished (kept by the transitions)."""
        return f"{self.tag}:live"

    def facet(self, *parts: str) -> str:
        """A listing index of this shard: run ids scored by creation time, for one facet (a state, a
        definition, a definition version, or one of those in a state). Kept by the transitions."""
        return f"{self.tag}:idx:" + ":".join(parts)

    def transition_keys(self, run_id: str, barriers: Sequence[str], bags: Sequence[str] = ()) -> list[str]:
        """KEYS of every transition function, in the order helpers.lua documents: the fixed ones, a hash
        per barrier, then each bag's (map's) bitmap and results list."""
        fixed = [
            self.run(run_id),
            self.history(run_id),
            self.applied(run_id),
            self.outbox(),
            self.runs(),
            self.timers(),
            self.live(),
        ]
        hashes = [self.barrier(run_id, b) for b in barriers]
        return (
            fixed
            + hashes
            + [k for b in bags for k in (self.bag_arrived(run_id, b), self.bag_results(run_id, b))]
        )


def index_key(prefix: str, run_id: str) -> str:
    """run id -> shard, claimed with SET NX before a run is created."""
    return f"{prefix}:index:{{{run_id}}}"


def refused_key(prefix: str, run_id: str) -> str:
    """Why the shard refused to create run ``run_id`` (a start of a plan no run may be created from),
    kept for the run retention so that status and wait can say so. Tagged like the run-id index."""
    return f"{prefix}:refused:{{{run_id}}}"


#: The state of a run id whose start the shard refused (no run was created): final, like a failure.
REFUSED = "refused"


def finished_channel(prefix: str, run_id: str) -> str:
    """The pub/sub channel a run's end is announced on, for whoever waits for it: JSON of its final
    ``state`` (``refused`` for a start that created no run), and its ``output`` (JSON text) and
    ``reason`` where it has them. A channel, not a key: it has no slot."""
    return f"{prefix}:finished:{run_id}"


def plan_key(prefix: str, digest: str) -> str:
    return f"{prefix}:{{plans}}:plan:{digest}"


def active_key(prefix: str, definition: str) -> str:
    return f"{prefix}:{{plans}}:active:{definition}"


def active_pattern(prefix: str) -> str:
    """A SCAN pattern matching every :func:`active_key` of ``prefix`` (its glob characters escaped)."""
    escaped = "".join(f"\\{c}" if c in "*?[]\\" else c for c in prefix)
    return f"{escaped}:{{plans}}:active:*"


def definition_of_active_key(prefix: str, key: str) -> str:
    """``active_key(prefix, name)`` -> ``name``."""
    return key.removeprefix(f"{prefix}:{{plans}}:active:")


def idempotency_key(prefix: str, run_id: str) -> str:
    """The context digest the first start of an idempotency key claimed (SET NX, with the run retention
    as TTL); ``run_id`` is derived from the definition and the key. Tagged like :func:`index_key`."""
    return f"{prefix}:idempotency:{{{run_id}}}"


TENANT_FIELD_PREFIX = "tenant:"  # a field of a shard's live hash: a tenant's unfinished runs (never a digest)


def tenant_field(tenant: str) -> str:
    """The field of a shard's live hash counting ``tenant``'s unfinished runs."""
    return TENANT_FIELD_PREFIX + tenant

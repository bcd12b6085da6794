"""Per-tenant admission at the shards that create runs (``SAGA_TENANT_LIMITS``).

A tenant's limits hold for the whole system, and each shard enforces its share: the limit divided among
the served shards of its class (a run's shard is a hash of its id, so a tenant's starts spread evenly).
Runs in flight are counted by the transitions themselves (``tenant:<tenant>`` in each shard's live hash,
``lua/helpers.lua``); starts per second by a token bucket per shard and tenant, in the process that
consumes the shard (one active consumer: a takeover starts with a full bucket). A start over either is
refused at once, with the reason where ``saga status`` and ``wait`` find it, and parked on
``saga.rejected``: never queued for ever. Pure but for the clock it is given.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

EVERY_TENANT = "*"  # in SAGA_TENANT_LIMITS: the limits of a tenant not named there


class TenantLimit(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_runs: int | None = Field(None, ge=1, description="runs started and not yet ended, at most")
    starts_per_s: float | None = Field(None, gt=0, description="starts a second, at most (1 s of burst)")


@dataclass
class _Bucket:
    tokens: float
    at_s: float


@dataclass
class TenantAdmission:
    """The limits, and the start buckets of the shards this process consumes."""

    limits: Mapping[str, TenantLimit]
    clock_s: Callable[[], float]
    _buckets: dict[tuple[str, str], _Bucket] = field(default_factory=dict)

    def limit_of(self, tenant: str) -> TenantLimit | None:
        return self.limits.get(tenant) or self.limits.get(EVERY_TENANT)

    def refusal(self, shard: str, tenant: str, in_flight: int, shards: int) -> str | None:
        """Why ``shard`` (one of ``shards`` of its class) refuses a start of ``tenant``, which has
        ``in_flight`` runs there not yet ended (None: admitted, and counted against the starts a second)."""
        limit = self.limit_of(tenant)
        if limit is None:
            return None
        shards = max(shards, 1)
        if limit.max_runs is not None:
            share = math.ceil(limit.max_runs / shards)
            if in_flight >= share:
                return (
                    f"tenant {tenant!r} is at its share of {share} runs in flight on shard {shard} (the "
                    f"limit of {limit.max_runs} over {shards} shards, SAGA_TENANT_LIMITS): start it again "
                    "once some have ended, or raise the limit"
                )
        if limit.starts_per_s is not None:
            rate = limit.starts_per_s / shards
            bucket = self._buckets.setdefault((shard, tenant), _Bucket(max(rate, 1.0), self.clock_s()))
            now = self.clock_s()
            bucket.tokens = min(max(rate, 1.0), bucket.tokens + (now - bucket.at_s) * rate)
            bucket.at_s = now
            if bucket.tokens < 1.0:
                return (
                    f"tenant {tenant!r} is over its start rate of {limit.starts_per_s:g}/s (its share on "
                    f"shard {shard}: {rate:g}/s over {shards} shards, SAGA_TENANT_LIMITS): start it again "
                    "in a moment, or raise the limit"
                )
            bucket.tokens -= 1.0
        return None

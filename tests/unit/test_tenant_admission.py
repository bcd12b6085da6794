"""Per-tenant admission at the shards (orchestrator/shard/admission.py): each shard's share of a tenant's
runs in flight and starts a second, with a clock the tests move."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from orchestrator.shard.admission import TenantAdmission, TenantLimit


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def admission(**limits: TenantLimit) -> tuple[TenantAdmission, Clock]:
    clock = Clock()
    return TenantAdmission(dict(limits), clock), clock


@given(st.integers(1, 1000), st.integers(1, 64), st.integers(0, 2000))
def test_a_shard_admits_runs_in_flight_up_to_its_share_of_the_limit(
    limit: int, shards: int, in_flight: int
) -> None:
    gate, _ = admission(acme=TenantLimit(max_runs=limit))
    refusal = gate.refusal("fast.0", "acme", in_flight, shards)
    assert (refusal is None) == (in_flight < math.ceil(limit / shards))
    if refusal is not None:
        assert "tenant 'acme' is at its share of" in refusal and "on shard fast.0" in refusal


def test_tenants_without_limits_of_their_own_take_the_default_and_others_none() -> None:
    gate, _ = admission(**{"*": TenantLimit(max_runs=2), "acme": TenantLimit(max_runs=10)})
    assert gate.refusal("fast.0", "acme", 5, 1) is None
    assert gate.refusal("fast.0", "globex", 2, 1) is not None
    ungated, _ = admission(acme=TenantLimit(max_runs=1))
    assert ungated.refusal("fast.0", "globex", 1_000, 1) is None


@given(st.floats(0.5, 50), st.integers(1, 8), st.lists(st.floats(0, 2), min_size=1, max_size=200))
def test_starts_a_second_never_exceed_the_shards_share_and_a_second_of_burst(
    rate: float, shards: int, gaps: list[float]
) -> None:
    gate, clock = admission(acme=TenantLimit(starts_per_s=rate))
    share = rate / shards
    admitted = 0
    start = clock.now
    for gap in gaps:
        clock.now += gap
        if gate.refusal("fast.0", "acme", 0, shards) is None:
            admitted += 1
    assert admitted <= max(share, 1.0) + share * (clock.now - start) + 1e-6


def test_a_refused_start_says_what_to_do_and_the_bucket_refills() -> None:
    gate, clock = admission(acme=TenantLimit(starts_per_s=1))
    assert gate.refusal("fast.0", "acme", 0, 1) is None
    refusal = gate.refusal("fast.0", "acme", 0, 1)
    assert refusal is not None and "over its start rate of 1/s" in refusal and "again" in refusal
    clock.now += 1.0
    assert gate.refusal("fast.0", "acme", 0, 1) is None
    assert gate.refusal("fast.1", "acme", 0, 1) is None  # each shard its own bucket

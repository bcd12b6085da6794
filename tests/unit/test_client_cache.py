"""The clients' cache of active plans: fresh within its TTL, last known when Redis is unreachable."""

from __future__ import annotations

import json

import pytest

from orchestrator.client import ActivePlan, ActivePlans, active_plan_from
from orchestrator.errors import SagaError


def test_fresh_within_the_ttl_then_stale_but_still_known() -> None:
    plans = ActivePlans(ttl_s=2.0)
    plan = plans.put("model-ingest", ActivePlan("sha256:a", "fast"), now=10.0)
    assert plans.fresh("model-ingest", 11.9) == plan
    assert plans.fresh("model-ingest", 12.0) is None  # an activation reaches new starts within the TTL
    assert plans.last_known("model-ingest") == plan
    assert plans.fresh("other", 10.0) is None and plans.last_known("other") is None


def test_active_plan_from_the_two_reads() -> None:
    raw = json.dumps({"plan": {"class": "slow"}, "versions": {}})
    assert active_plan_from("d", b"sha256:x", raw) == ActivePlan("sha256:x", "slow")
    with pytest.raises(SagaError, match="'d' is not published; run 'saga definitions publish FILE'"):
        active_plan_from("d", None, None)
    with pytest.raises(SagaError, match="missing from Redis; publish the definition again"):
        active_plan_from("d", "sha256:x", None)

"""The clients' cache of definition routing: fresh within its TTL, last known when Redis is unreachable;
plans by digest for good (immutable)."""

from __future__ import annotations

import json

import pytest

from orchestrator.client import ActivePlan, ActivePlans, active_plan_from, state_from
from orchestrator.errors import SagaError
from orchestrator.governance.lifecycle import DefinitionState
from tests.unit.test_engine import compiled


def test_fresh_within_the_ttl_then_stale_but_still_known() -> None:
    cache = ActivePlans(ttl_s=2.0)
    state = cache.put("model-ingest", DefinitionState("model-ingest", revision=3), now=10.0)
    assert cache.fresh("model-ingest", 11.9) == state
    assert cache.fresh("model-ingest", 12.0) is None  # an activation reaches new starts within the TTL
    assert cache.last_known("model-ingest") == state
    assert cache.fresh("other", 10.0) is None and cache.last_known("other") is None


def test_active_plan_from_the_two_reads() -> None:
    plan = compiled("model-ingest").plan
    raw = json.dumps({"plan": {**plan, "class": "slow"}, "versions": {}})
    active = active_plan_from("d", b"sha256:x", raw)
    assert active == ActivePlan("sha256:x", "slow")
    assert active.plan is not None and active.plan.entry == plan["entry"]  # typed once, for every start
    with pytest.raises(SagaError, match="'d' is not published; run 'saga definitions publish FILE'"):
        active_plan_from("d", None, None)
    with pytest.raises(SagaError, match="missing from Redis; publish the definition again"):
        active_plan_from("d", "sha256:x", None)


def test_a_definition_never_published_is_not_found_with_a_suggestion() -> None:
    with pytest.raises(SagaError, match="did you mean 'model-ingest'"):
        state_from("model-ingst", None, ["model-ingest", "other"])

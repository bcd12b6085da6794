"""The metrics helpers (``orchestrator/metrics.py``): what each one counts, the run and stage metrics
derived from real engine decisions (the simulator's), and the /metrics server. Metrics live in the
process's default registry, so every test compares values before and after."""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import REGISTRY

from orchestrator import metrics
from orchestrator.engine.model import CancelRun, Decision, HistoryEntry, Verdict
from orchestrator.shard.processor import Outcome, count
from tests.conftest import ROOT
from tests.unit.engine_sim import Handled, Sim, typed
from tests.unit.test_engine import compiled

RENDER = "thumbnail.render@3"


def value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


class Delta:
    """Sample values now, to compare with later ones."""

    def __init__(self, *samples: tuple[str, dict[str, str]]) -> None:
        self.before = {
            (name, tuple(sorted(labels.items()))): value(name, **labels) for name, labels in samples
        }

    def __call__(self, name: str, **labels: str) -> float:
        return value(name, **labels) - self.before.get((name, tuple(sorted(labels.items()))), 0.0)


def delta(*names: str, **labels: str) -> Delta:
    return Delta(*((name, labels) for name in names))


@pytest.fixture
def dispatches() -> metrics.Dispatches:
    return metrics.Dispatches()


def simulated(
    dispatches: metrics.Dispatches, context: dict[str, Any], **kwargs: Any
) -> tuple[Sim, list[Handled]]:
    """A model-ingest run in the simulator, each transition that took effect counted as a shard does."""
    plan = compiled("model-ingest")
    counted: list[Handled] = []

    def hook(sim: Sim, handled: Handled) -> None:
        if handled.took_effect:
            metrics.applied(sim.run_id, typed(sim.plan), handled.decision, sim.clock, dispatches)
            counted.append(handled)

    sim = Sim(plan.plan, plan.digest, hook=hook, **kwargs)
    sim.start(context)
    return sim, counted


# ---- runs and stages, from decisions ------------------------------------------------------------------


def test_a_completed_run_counts_its_start_its_end_and_each_stage_once(dispatches: metrics.Dispatches) -> None:
    # Given a model-ingest run that misses the cache
    runs = Delta(
        ("saga_runs_started_total", {"definition": "model-ingest", "version": "2.3.0"}),
        (
            "saga_runs_finished_total",
            {"definition": "model-ingest", "version": "2.3.0", "state": "completed"},
        ),
        ("saga_stage_seconds_count", {"contract": RENDER, "outcome": "completed"}),
        ("saga_stage_seconds_count", {"contract": "cache.lookup@1", "outcome": "completed"}),
        ("saga_stage_seconds_sum", {"contract": RENDER, "outcome": "completed"}),
    )
    sim, _ = simulated(dispatches, {"modelId": "miss-1"})
    # When it runs to its end
    sim.run()
    assert sim.status == "completed"
    # Then it was started and finished once, and each stage attempt gave one duration
    assert runs("saga_runs_started_total", definition="model-ingest", version="2.3.0") == 1
    finished = {"definition": "model-ingest", "version": "2.3.0", "state": "completed"}
    assert runs("saga_runs_finished_total", **finished) == 1
    assert runs("saga_stage_seconds_count", contract=RENDER, outcome="completed") == 1
    assert runs("saga_stage_seconds_count", contract="cache.lookup@1", outcome="completed") == 1
    # the simulator's clock moves 1 ms per event: render's task, then its result
    assert 0 < runs("saga_stage_seconds_sum", contract=RENDER, outcome="completed") < 1
    # and a finished run leaves nothing tracked
    assert len(dispatches) == 0


def test_a_failed_stage_and_run_are_counted_as_failed(dispatches: metrics.Dispatches) -> None:
    runs = Delta(
        ("saga_runs_finished_total", {"definition": "model-ingest", "version": "2.3.0", "state": "failed"}),
        ("saga_stage_seconds_count", {"contract": RENDER, "outcome": "failed"}),
    )
    sim, _ = simulated(dispatches, {"modelId": "broken-1"}, fail_stages=frozenset({"render-thumbnail"}))
    sim.run()
    assert sim.status == "failed"
    finished = {"definition": "model-ingest", "version": "2.3.0", "state": "failed"}
    assert runs("saga_runs_finished_total", **finished) == 1
    attempts = len(sim.entries("stage.failed", "render-thumbnail"))
    assert attempts >= 1
    assert runs("saga_stage_seconds_count", contract=RENDER, outcome="failed") == attempts
    assert len(dispatches) == 0


def test_a_cancelled_run_counts_the_cancellation_and_its_stopped_attempts(
    dispatches: metrics.Dispatches,
) -> None:
    runs = Delta(
        ("saga_runs_cancelled_total", {"definition": "model-ingest", "version": "2.3.0"}),
        ("saga_stage_seconds_count", {"contract": RENDER, "outcome": "cancelled"}),
    )
    sim, _ = simulated(dispatches, {"modelId": "miss-2"})
    # Given the run waits for its render task
    sim.deliver(sim.pending.pop(0))  # the start
    sim.deliver(sim.pending.pop(0))  # cache.lookup's task, then its result
    sim.deliver(sim.pending.pop(0))
    assert "render-thumbnail" in {d.stage for d in sim.pending}
    # When an operator cancels it
    sim.handle(CancelRun("cancel-1", "no longer needed", "ops"))
    # Then the cancellation and the attempt it stopped are counted
    assert runs("saga_runs_cancelled_total", definition="model-ingest", version="2.3.0") == 1
    assert runs("saga_stage_seconds_count", contract=RENDER, outcome="cancelled") == 1


def test_an_attempt_dispatched_elsewhere_gives_no_sample(dispatches: metrics.Dispatches) -> None:
    plan = compiled("model-ingest").typed
    ended = Decision(Verdict.APPLIED, (HistoryEntry("stage.completed", "render-thumbnail", 1),))
    before = delta("saga_stage_seconds_count", contract=RENDER, outcome="completed")
    metrics.applied("run-x", plan, ended, 5_000, dispatches)
    assert before("saga_stage_seconds_count", contract=RENDER, outcome="completed") == 0


def test_a_map_item_failure_does_not_end_the_maps_attempt(dispatches: metrics.Dispatches) -> None:
    plan = compiled("model-ingest").typed
    started = Decision(Verdict.APPLIED, (HistoryEntry("stage.dispatched", "render-thumbnail", 1),))
    item = Decision(
        Verdict.APPLIED, (HistoryEntry("stage.failed", "render-thumbnail", 1, {"item": 3, "error": "x"}),)
    )
    metrics.applied("run-m", plan, started, 1_000, dispatches)
    metrics.applied("run-m", plan, item, 1_500, dispatches)
    assert dispatches.end("run-m", "render-thumbnail", 1) == 1_000


def test_dispatches_forget_the_oldest_runs_past_their_bound() -> None:
    tracked = metrics.Dispatches(max_runs=2)
    for n in range(3):
        tracked.start(f"run-{n}", "s", 1, n)
    assert len(tracked) == 2
    assert tracked.end("run-0", "s", 1) is None
    assert tracked.end("run-2", "s", 1) == 2


# ---- the shard's outcomes ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("outcome", "label", "refusal"),
    [
        (Outcome(verdict=Verdict.APPLIED), "applied", None),
        (Outcome(verdict=Verdict.STALE), "stale", "stale"),
        (Outcome(verdict=Verdict.DUPLICATE), "duplicate", "duplicate"),
        (Outcome(forward_to="fast.1"), "forwarded", None),
        # a refusal parked on the rejected queue is counted there, with its reason (Publisher.reject)
        (Outcome(rejected=("unknown-run", "gone"), verdict=Verdict.INVALID), "rejected", None),
        (Outcome(), "ignored", None),
    ],
)
def test_each_outcome_is_counted_once_by_kind_and_what_became_of_it(
    outcome: Outcome, label: str, refusal: str | None
) -> None:
    before = Delta(
        ("saga_transitions_total", {"kind": "result", "outcome": label}),
        *(("saga_callbacks_refused_total", {"reason": r}) for r in ("stale", "duplicate", "invalid")),
    )
    assert count("result", outcome) is outcome
    assert before("saga_transitions_total", kind="result", outcome=label) == 1
    for reason in ("stale", "duplicate", "invalid"):
        assert before("saga_callbacks_refused_total", reason=reason) == (1 if reason == refusal else 0)


# ---- the plain helpers -------------------------------------------------------------------------------


def test_latency_and_size_helpers_observe_their_histograms() -> None:
    before = Delta(
        ("saga_shard_batch_messages_count", {}),
        ("saga_shard_batch_messages_sum", {}),
        ("saga_redis_lua_seconds_count", {"function": "pipeline"}),
        ("saga_publish_confirm_seconds_count", {}),
        ("saga_callbacks_refused_total", {"reason": "bad-signature"}),
    )
    metrics.batch("fast.7", 12)
    metrics.lua_call("pipeline", 0.002)
    metrics.publish_confirmed(0.001)
    metrics.refused("bad-signature")
    assert before("saga_shard_batch_messages_count") == 1
    assert before("saga_shard_batch_messages_sum") == 12
    assert before("saga_redis_lua_seconds_count", function="pipeline") == 1
    assert before("saga_publish_confirm_seconds_count") == 1
    assert before("saga_callbacks_refused_total", reason="bad-signature") == 1


def test_a_shard_is_standby_until_a_batch_arrives_and_drops_its_samples_when_left() -> None:
    shard = "fast.9"
    metrics.shard_state(shard, active=False)
    metrics.shard_depths(shard, 4, 2)
    assert value("saga_shard_consumer", shard=shard, state="standby") == 1
    assert value("saga_shard_consumer", shard=shard, state="active") == 0
    assert value("saga_outbox_entries", shard=shard) == 4
    assert value("saga_timers_due", shard=shard) == 2
    metrics.batch(shard, 1)
    assert value("saga_shard_consumer", shard=shard, state="active") == 1
    assert value("saga_shard_consumer", shard=shard, state="standby") == 0
    metrics.shard_left(shard)
    assert value("saga_shard_consumer", shard=shard, state="active") == 0
    assert REGISTRY.get_sample_value("saga_outbox_entries", {"shard": shard}) is None
    assert REGISTRY.get_sample_value("saga_timers_due", {"shard": shard}) is None


def test_worker_tasks_count_by_outcome_and_time_the_handlers_that_ran() -> None:
    contract = "unit.metrics@1"
    before = Delta(
        *(("saga_worker_tasks_total", {"contract": contract, "outcome": o}) for o in ("completed", "failed")),
        ("saga_worker_tasks_total", {"contract": contract, "outcome": "cancelled"}),
        ("saga_worker_handler_seconds_count", {"contract": contract}),
    )
    metrics.task_done(contract, ok=True, cancelled=False, seconds=0.5)
    metrics.task_done(contract, ok=False, cancelled=False, seconds=0.1)
    metrics.task_done(contract, ok=False, cancelled=True, seconds=None)  # cancelled before it started
    for outcome in ("completed", "failed", "cancelled"):
        assert before("saga_worker_tasks_total", contract=contract, outcome=outcome) == 1
    assert before("saga_worker_handler_seconds_count", contract=contract) == 2


# ---- serving -----------------------------------------------------------------------------------------


@pytest.fixture
def server() -> Iterator[Any]:
    served = metrics.serve_metrics("127.0.0.1", 0)
    yield served
    served.shutdown()
    served.server_close()


def test_the_server_exposes_the_metrics_on_loopback(server: Any) -> None:
    metrics.refused("unit-test-scrape")
    host, port = server.server_address[:2]
    assert host == "127.0.0.1"
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    assert 'saga_callbacks_refused_total{reason="unit-test-scrape"} 1.0' in text
    assert "# TYPE saga_stage_seconds histogram" in text


# ---- the dashboard -----------------------------------------------------------------------------------


def exposed_names() -> set[str]:
    """Every sample name the registry's saga metrics can expose (labelled ones before any sample)."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
    return {
        family.name + suffix
        for family in REGISTRY.collect()
        if family.name.startswith("saga_")
        for suffix in suffixes.get(family.type, ())
    }


def test_the_grafana_dashboard_queries_only_metrics_that_exist() -> None:
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "saga-dashboard.json").read_text(encoding="utf-8"))
    queried = {
        name
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
        for name in re.findall(r"\bsaga_[a-z_]+", target["expr"])
    }
    assert queried, "the dashboard queries nothing"
    assert queried <= exposed_names(), queried - exposed_names()
    # and every metric has a panel
    families = {name.removesuffix("_total").removesuffix("_bucket") for name in queried}
    assert {f.name for f in REGISTRY.collect() if f.name.startswith("saga_")} <= families

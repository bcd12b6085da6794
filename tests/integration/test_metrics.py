"""Prometheus metrics end to end: an orchestrator and a worker serving /metrics on loopback, scraped
after runs, must count exactly what the runs did."""

from __future__ import annotations

import functools
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from orchestrator.client import SyncClient
from tests.integration.own_redis import free_port
from tests.integration.stack import Stack, poll

pytestmark = pytest.mark.services

RUNS = 5
RENDER = "thumbnail.render@3"
SHARDS = {"fast.0", "fast.1", "slow.0", "slow.1"}  # the stack's shard map: two classes, two shards each
Samples = list[tuple[str, dict[str, str], float]]


def scrape(port: int) -> Samples | None:
    """Every sample on http://127.0.0.1:PORT/metrics (None: nothing serves it yet)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
            text = response.read().decode()
    except (urllib.error.URLError, ConnectionError):
        return None
    return [
        (sample.name, sample.labels, sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    ]


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(v for n, got, v in samples if n == name and labels.items() <= got.items())


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[Stack, int, int]]:
    yield from metered(Stack("metrics"))


def metered(stack: Stack) -> Iterator[tuple[Stack, int, int]]:
    """``stack`` set up with an orchestrator and a worker serving metrics: (stack, their two ports)."""
    stack.setup()
    ports = free_port(), free_port()
    try:
        stack.start_orchestrator("orchestrator", "--metrics-port", str(ports[0]))
        stack.start_worker("worker", "--metrics-port", str(ports[1]))
        for port in ports:
            poll(functools.partial(scrape, port), timeout_s=15, what=f"a metrics server on port {port}")
        yield stack, *ports
    finally:
        stack.teardown()


def test_scraped_counts_match_the_runs(stack: tuple[Stack, int, int]) -> None:
    s, orchestrator_port, worker_port = stack
    # Given an orchestrator and a worker serving metrics
    # When N model-ingest runs that miss the cache run to their end
    tag = uuid.uuid4().hex[:8]
    with SyncClient(s.settings) as client:
        run_ids = [client.start("model-ingest", {"modelId": f"metrics-{tag}-{i}"}) for i in range(RUNS)]
        for run_id in run_ids:
            assert client.wait(run_id, timeout_s=20).state == "completed"

    # Then the orchestrator counted N starts and N completions of model-ingest, and every render attempt
    def orchestrator_counted() -> Samples | None:
        """The orchestrator's samples once it counted every run's end and sampled (every second) each
        shard's outbox empty again."""
        found = scrape(orchestrator_port)
        if found is None or total(found, "saga_runs_finished_total", definition="model-ingest") < RUNS:
            return None
        sampled = {labels["shard"] for n, labels, _ in found if n == "saga_outbox_entries"}
        return found if sampled >= SHARDS and total(found, "saga_outbox_entries") == 0 else None

    samples = poll(orchestrator_counted, timeout_s=10, what="the orchestrator's counts")
    assert total(samples, "saga_runs_started_total", definition="model-ingest") == RUNS
    finished = {"definition": "model-ingest", "state": "completed"}
    assert total(samples, "saga_runs_finished_total", **finished) == RUNS
    assert total(samples, "saga_runs_finished_total", state="failed") == 0
    assert total(samples, "saga_transitions_total", outcome="applied") > 0
    assert total(samples, "saga_transitions_total", kind="start", outcome="applied") == RUNS
    stage = {"contract": RENDER, "outcome": "completed"}
    assert total(samples, "saga_stage_seconds_count", **stage) == RUNS
    assert total(samples, "saga_stage_seconds_sum", **stage) > 0
    for histogram in ("saga_shard_batch_messages", "saga_redis_lua_seconds", "saga_publish_confirm_seconds"):
        assert total(samples, f"{histogram}_count") > 0, histogram
    assert total(samples, "saga_shard_consumer", state="active") >= 1
    assert total(samples, "saga_shard_consumer") == len(SHARDS)  # one process: active or standby on each

    # and the worker ran N renders, timed each, and none failed
    worker = scrape(worker_port)
    assert worker is not None
    assert total(worker, "saga_worker_tasks_total", contract=RENDER, outcome="completed") == RUNS
    assert total(worker, "saga_worker_tasks_total", outcome="failed") == 0
    assert total(worker, "saga_worker_handler_seconds_count", contract=RENDER) == RUNS
    assert total(worker, "saga_publish_confirm_seconds_count") > 0


def test_a_metrics_port_in_use_is_a_usage_error(stack: tuple[Stack, int, int]) -> None:
    s, orchestrator_port, _ = stack
    # Given the port is taken (by the running orchestrator's metrics server)
    # When another worker is asked to serve metrics on it
    done = s.saga("worker", "--metrics-port", str(orchestrator_port), timeout_s=20)
    # Then it refuses at once, with exit 2 and the reason
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "cannot serve metrics on 127.0.0.1" in done.stderr

"""Prometheus metrics of the orchestrator and the worker: the metric objects, in the process's default
registry, and the small helpers the hot paths call (each one ``labels(...)`` and an ``inc``/``observe``).

Labels stay bounded: message kinds, verdicts, refusal reasons, shards, definitions and their versions,
contract versions. Never a run id, a message id or an error text.

Run and stage metrics are derived from the decisions a shard applied (:func:`applied`), so they count
what happened to runs exactly once, whichever path applied the transition. A stage's duration runs from
the transition that dispatched an attempt to the one that ended it (completed, failed, timed out or
cancelled), both on the shard's clock; it is measured by the process that applied both, so an attempt
dispatched before a shard changed hands gives no sample rather than a wrong one.

``saga orchestrator`` and ``saga worker`` serve them with ``--metrics-port`` (:func:`serve_metrics`),
beside their ``/healthz`` and ``/readyz`` (``orchestrator/health.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

from prometheus_client import Counter, Gauge, Histogram

from orchestrator import health

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from orchestrator.engine.model import Decision
    from orchestrator.engine.plan import Plan

# Latencies of one Redis call or one publisher confirm: sub-millisecond on a local broker, seconds when
# it struggles.
_FAST_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# A stage or a handler: from milliseconds to an hour.
_SLOW_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)

_Metric = TypeVar("_Metric", Counter, Histogram)
_CHILDREN: dict[tuple[Any, ...], Any] = {}


def _child(metric: _Metric, *labels: str) -> _Metric:
    """``metric.labels(*labels)``, looked up once per label values: ``labels`` checks and locks on every
    call, and the hot paths call it for every message. Only for metrics whose children are never removed
    (the shard gauges are, when a shard is left)."""
    key = (metric, *labels)
    child = _CHILDREN.get(key)
    if child is None:
        child = _CHILDREN[key] = metric.labels(*labels)
    return child


TRANSITIONS = Counter(
    "saga_transitions",
    "Messages and timers a shard handled, by message kind (or timer, nudge) and outcome: the engine's "
    "verdict (applied, duplicate, stale, late, invalid), or forwarded, rejected, ignored.",
    ["kind", "outcome"],
)
REFUSED = Counter(
    "saga_callbacks_refused",
    "Messages refused: parked on the rejected queue with this reason, or recorded in a run's history "
    "with this verdict (duplicate, stale, late, invalid).",
    ["reason"],
)
BATCH_SIZE = Histogram(
    "saga_shard_batch_messages",
    "Deliveries a shard took in one batch.",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
)
LUA_SECONDS = Histogram(
    "saga_redis_lua_seconds",
    "Latency of the Redis Functions calls that change runs, by function (saga_create, saga_transition, "
    "saga_arrive, saga_poison, saga_mark_sent; pipeline: a batch's transitions in one pipeline).",
    ["function"],
    buckets=_FAST_S,
)
CONFIRM_SECONDS = Histogram(
    "saga_publish_confirm_seconds",
    "From publishing a message to the broker's confirm of it.",
    buckets=_FAST_S,
)
OUTBOX = Gauge("saga_outbox_entries", "Outbox entries of a shard not marked sent yet (sampled).", ["shard"])
TIMERS_DUE = Gauge("saga_timers_due", "Timers of a shard due and not fired yet (sampled).", ["shard"])
SHARD_CONSUMER = Gauge(
    "saga_shard_consumer",
    "1 for this process's state on a shard queue it consumes: active (deliveries came: the queue has a "
    "single active consumer) or standby (subscribed, nothing delivered yet); 0 otherwise.",
    ["shard", "state"],
)
RUNS_STARTED = Counter("saga_runs_started", "Runs created.", ["definition", "version"])
RUNS_FINISHED = Counter(
    "saga_runs_finished", "Runs that reached a final state.", ["definition", "version", "state"]
)
RUNS_CANCELLED = Counter(
    "saga_runs_cancelled", "Cancellations of runs applied (saga cancel).", ["definition", "version"]
)
STAGE_SECONDS = Histogram(
    "saga_stage_seconds",
    "A stage attempt from its dispatch to its end, by contract and how it ended "
    "(completed, failed, timed_out, cancelled).",
    ["contract", "outcome"],
    buckets=_SLOW_S,
)
HANDLER_SECONDS = Histogram(
    "saga_worker_handler_seconds", "A worker's handler runs, by contract.", ["contract"], buckets=_SLOW_S
)
WORKER_TASKS = Counter(
    "saga_worker_tasks",
    "Tasks a worker ran, by contract and outcome (completed, failed, cancelled).",
    ["contract", "outcome"],
)
# A container: several messages for one shard in one AMQP message (orchestrator/bus/batch.py).
_CONTAINER = (2, 4, 8, 16, 32, 64, 128, 256)
SHARD_CONTAINERS = Histogram(
    "saga_shard_container_messages",
    "Messages per container a shard received (a worker's reports of one event-loop turn, in one message).",
    buckets=_CONTAINER,
)
WORKER_TASK_CONTAINERS = Histogram(
    "saga_worker_container_tasks",
    "Tasks per container a worker received (an orchestrator packs the tasks for one contract queue it "
    "sends at once, SAGA_PACK_TASKS, or a map's items_per_message); a task sent alone is not counted.",
    buckets=_CONTAINER,
)
WORKER_TASKS_SPILLED = Counter(
    "saga_worker_tasks_spilled",
    "Tasks of a container a worker sent back to their queue one per message, for another worker: they "
    "found no free slot within a second, or the worker was stopping (or could not report them); by contract.",
    ["contract"],
)
WORKER_CONTAINERS = Histogram(
    "saga_worker_container_reports",
    "Reports per container a worker published and had confirmed (those of one event-loop turn for one "
    "shard, in one message); a report sent alone is not counted.",
    buckets=_CONTAINER,
)

# ---- orchestrator ---------------------------------------------------------------------------------


def transition(kind: str, outcome: str) -> None:
    """A message (or timer) a shard handled, and what became of it."""
    _child(TRANSITIONS, kind, outcome).inc()


def refused(reason: str) -> None:
    _child(REFUSED, reason).inc()


def batch(shard: str, size: int) -> None:
    """A shard took a batch of ``size`` deliveries: it is its queue's active consumer."""
    BATCH_SIZE.observe(size)
    if shard not in _ACTIVE:
        shard_state(shard, active=True)


def container(size: int) -> None:
    """A shard received a container of ``size`` messages."""
    SHARD_CONTAINERS.observe(size)


def lua_call(function: str, seconds: float) -> None:
    _child(LUA_SECONDS, function).observe(seconds)


def publish_confirmed(seconds: float) -> None:
    CONFIRM_SECONDS.observe(seconds)


def shard_depths(shard: str, outbox: int, timers_due: int) -> None:
    OUTBOX.labels(shard).set(outbox)
    TIMERS_DUE.labels(shard).set(timers_due)


# the shards this process is the active consumer of, as the gauge says (batch() sets it once)
_ACTIVE: set[str] = set()


def shard_state(shard: str, *, active: bool) -> None:
    if active:
        _ACTIVE.add(shard)
    else:
        _ACTIVE.discard(shard)
    SHARD_CONSUMER.labels(shard, "active").set(1 if active else 0)
    SHARD_CONSUMER.labels(shard, "standby").set(0 if active else 1)


def shard_left(shard: str) -> None:
    """The process no longer consumes the shard's queue: its samples of the shard are dropped (the
    process serving it now reports them)."""
    _ACTIVE.discard(shard)
    SHARD_CONSUMER.labels(shard, "active").set(0)
    SHARD_CONSUMER.labels(shard, "standby").set(0)
    OUTBOX.remove(shard)
    TIMERS_DUE.remove(shard)


class Dispatches:
    """When this process dispatched each attempt still open: run id -> {(stage, attempt): ms}. Bounded:
    past ``max_runs`` the runs tracked longest are forgotten (their attempts give no sample)."""

    def __init__(self, max_runs: int = 100_000) -> None:
        self.max_runs = max_runs
        self._runs: dict[str, dict[tuple[str, int], int]] = {}

    def __len__(self) -> int:
        return len(self._runs)

    def start(self, run_id: str, stage: str, attempt: int, at_ms: int) -> None:
        attempts = self._runs.get(run_id)
        if attempts is None:
            if len(self._runs) >= self.max_runs:
                del self._runs[next(iter(self._runs))]
            attempts = self._runs[run_id] = {}
        attempts[(stage, attempt)] = at_ms

    def end(self, run_id: str, stage: str, attempt: int) -> int | None:
        """When the attempt was dispatched (None: not by this process), forgetting it."""
        attempts = self._runs.get(run_id)
        return None if attempts is None else attempts.pop((stage, attempt), None)

    def forget(self, run_id: str) -> None:
        self._runs.pop(run_id, None)


DISPATCHES = Dispatches()

# history kind -> the outcome of the attempt it ends (a map item's own failure ends no attempt)
_ATTEMPT_ENDS = {
    "stage.completed": "completed",
    "stage.failed": "failed",
    "stage.timed_out": "timed_out",
    "cancellation.requested": "cancelled",
}


def applied(
    run_id: str, plan: Plan, decision: Decision, now_ms: int, dispatches: Dispatches = DISPATCHES
) -> None:
    """Count what a transition the store applied did to its run: created it, finished it, cancelled it,
    dispatched or ended stage attempts."""
    for entry in decision.history:
        kind = entry.kind
        if kind == "stage.dispatched" and entry.stage is not None and entry.attempt is not None:
            dispatches.start(run_id, entry.stage, entry.attempt, now_ms)
        elif kind in _ATTEMPT_ENDS and entry.stage is not None and entry.attempt is not None:
            if "item" in entry.detail and entry.detail["item"] is not None:
                continue
            _attempt_ended(run_id, plan, entry.stage, entry.attempt, _ATTEMPT_ENDS[kind], now_ms, dispatches)
        elif kind == "run.started":
            _child(RUNS_STARTED, plan.name, plan.version).inc()
        elif kind in ("run.completed", "run.failed"):
            _child(RUNS_FINISHED, plan.name, plan.version, kind[4:]).inc()
            dispatches.forget(run_id)
        elif kind == "cancel.requested":
            _child(RUNS_CANCELLED, plan.name, plan.version).inc()


def _attempt_ended(
    run_id: str,
    plan: Plan,
    stage: str,
    attempt: int,
    outcome: str,
    now_ms: int,
    dispatches: Dispatches,
) -> None:
    dispatched_ms = dispatches.end(run_id, stage, attempt)
    spec = plan.work(stage)
    if dispatched_ms is None or spec is None:
        return
    _child(STAGE_SECONDS, spec.contract, outcome).observe(max(0, now_ms - dispatched_ms) / 1000)


# ---- worker ---------------------------------------------------------------------------------------


def task_done(contract: str, *, ok: bool, cancelled: bool, seconds: float | None) -> None:
    """A worker's task ended (``seconds``: how long its handler ran; None: it never started)."""
    outcome = "completed" if ok else "cancelled" if cancelled else "failed"
    _child(WORKER_TASKS, contract, outcome).inc()
    if seconds is not None:
        _child(HANDLER_SECONDS, contract).observe(seconds)


def tasks_packed(size: int) -> None:
    """A worker received a container of ``size`` tasks (packed by the orchestrator)."""
    WORKER_TASK_CONTAINERS.observe(size)


def task_spilled(contract: str) -> None:
    """A worker sent a packed task back to its queue alone (no slot came free in time, or it stops)."""
    _child(WORKER_TASKS_SPILLED, contract).inc()


def reports_batched(size: int) -> None:
    """A worker's container of ``size`` reports was confirmed."""
    WORKER_CONTAINERS.observe(size)


# ---- serving --------------------------------------------------------------------------------------


def serve_metrics(host: str, port: int, readiness: health.Readiness | None = None) -> WSGIServer:
    """Serve ``/metrics`` on ``host:port`` from a daemon thread, and with ``readiness`` ``/healthz`` and
    ``/readyz`` too (:func:`orchestrator.health.serve`); returns the server (its ``server_port`` is the
    port bound, for port 0). Raises OSError when the port cannot be bound."""
    return health.serve(host, port, readiness)

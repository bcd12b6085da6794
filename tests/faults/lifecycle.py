"""Disturbing and watching the stack's processes and the broker: which process is a queue's active
consumer, waiting for a process to die at a crash point, restarting the machine's RabbitMQ.

What these helpers read comes from outside the processes (``rabbitmqctl``, their exit codes and logs,
Redis), so a scenario can prove that its fault really happened rather than assume it.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from orchestrator.store.keys import ShardKeys, index_key
from tests.faults import invariants
from tests.integration.stack import Stack, poll, rabbitmqctl

BROKER_START_TIMEOUT_S = 120


def terminal_count(stack: Stack, run_ids: list[str]) -> int:
    """How many of the runs are terminal (two pipelined reads: this is polled while the load runs)."""
    shards: list[str | None] = stack.redis.mget([index_key(stack.prefix, r) for r in run_ids])  # type: ignore[assignment]
    with stack.redis.pipeline(transaction=False) as pipe:
        for run_id, shard in zip(run_ids, shards, strict=True):
            pipe.hget(ShardKeys(stack.prefix, shard or "none").run(run_id), "status")
        return sum(status in invariants.TERMINAL for status in pipe.execute())


def shard_queue_names(stack: Stack) -> list[str]:
    return sorted(n for n in stack.list_queues("messages") if is_shard_queue(n))


def consumer_counts(stack: Stack, queues: Callable[[str], bool]) -> dict[str, int]:
    """Queue -> its consumers, standbys included, for the queues ``queues`` selects. Counted from
    ``list_consumers``, which asks the queues: the ``consumers`` column of ``list_queues`` is, for a
    quorum queue, a metric refreshed every few seconds, and still counts a consumer that is gone."""
    found = {name: 0 for name in stack.list_queues("messages") if queues(name)}
    for row in _json_rows("list_consumers", "-p", stack.vhost, "queue_name"):
        if row["queue_name"] in found:
            found[row["queue_name"]] += 1
    return found


def is_shard_queue(name: str) -> bool:
    return name.startswith("saga.shard.") and not name.endswith(".dlq")


def is_task_queue(name: str) -> bool:
    """The queues the demo worker consumes: one per task queue and contract version it serves."""
    return name.startswith("saga.task.") and ":" in name


def wait_until_consuming(
    stack: Stack, queues: Callable[[str], bool], at_least: int = 1, timeout_s: float = 60.0
) -> None:
    """Until every queue ``queues`` selects has ``at_least`` consumers (standbys count: SAC lists them)."""

    def ready() -> bool:
        found = consumer_counts(stack, queues)
        return bool(found) and all(n >= at_least for n in found.values())

    poll(ready, timeout_s, interval_s=0.2, what=f"{at_least} consumer(s) on every selected queue")


def named_amqp_url(stack: Stack, name: str) -> str:
    """The stack's broker URL with a connection name, so ``active_consumers`` can tell processes apart
    (the orchestrator appends its heartbeat to a URL that already has a query)."""
    url = stack.env["SAGA_AMQP_URL"]
    return f"{url}{'&' if '?' in url else '?'}name={name}"


def _json_rows(*args: str) -> list[dict[str, Any]]:
    out = rabbitmqctl(*args, "--formatter", "json")
    rows = json.loads(out or "[]")
    return rows if isinstance(rows, list) else []


def _connection_names(stack: Stack) -> dict[str, str | None]:
    """Connection pid -> its connection name, for this stack's vhost."""
    names: dict[str, str | None] = {}
    for row in _json_rows("list_connections", "pid", "client_properties", "vhost"):
        if row.get("vhost") == stack.vhost:
            props = {p[0]: p[2] for p in row.get("client_properties") or [] if len(p) == 3}
            names[row["pid"]] = props.get("connection_name")
    return names


def active_consumers(stack: Stack) -> dict[str, str | None]:
    """Shard queue -> the connection name of its single active consumer (None: unnamed, or no active
    consumer). Three listings joined on Erlang pids: consumer -> channel -> connection."""
    consumers = _json_rows("list_consumers", "-p", stack.vhost, "queue_name", "channel_pid", "active")
    channels = {r["pid"]: r["connection"] for r in _json_rows("list_channels", "pid", "connection", "vhost")}
    names = _connection_names(stack)
    found: dict[str, str | None] = {q: None for q in shard_queue_names(stack)}
    for row in consumers:
        if row.get("active") and is_shard_queue(row["queue_name"]):
            found[row["queue_name"]] = names.get(channels.get(row["channel_pid"], ""))
    return found


def unacked_by_connection(stack: Stack) -> dict[str | None, int]:
    """Connection name -> deliveries its channels hold unacked. Asked of the channels themselves, which
    know at once (a quorum queue's own count is a metric refreshed every few seconds)."""
    names = _connection_names(stack)
    held: dict[str | None, int] = {}
    for row in _json_rows("list_channels", "connection", "messages_unacknowledged", "vhost"):
        if row.get("vhost") == stack.vhost and row.get("messages_unacknowledged"):
            name = names.get(row["connection"])
            held[name] = held.get(name, 0) + int(row["messages_unacknowledged"])
    return held


def wait_for_crash(stack: Stack, name: str, point: str, timeout_s: float) -> list[str]:
    """Wait for process ``name`` to die at crash point ``point``; what is wrong otherwise (it is killed
    then, so that the test goes on to report instead of hanging)."""
    process = stack.processes[name]
    try:
        code = process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stack.stop(name, signal.SIGKILL)
        return [f"{name} never reached crash point {point} within {timeout_s:.0f} s: the test proved nothing"]
    stack.processes.pop(name)
    problems = []
    if code != -signal.SIGKILL:
        problems.append(f"{name} exited with {code}, not killed by SIGKILL at crash point {point}")
    if f"crash point {point} reached" not in stack.log(name):
        problems.append(f"{name}'s log does not say that it reached crash point {point}")
    return problems


# ---- the machine's broker ----------------------------------------------------------------------------


def start_broker() -> None:
    """Start the broker's application (a no-op when it runs) and wait until it serves."""
    for args in (["start_app"], ["await_startup", "--timeout", str(BROKER_START_TIMEOUT_S)]):
        done = subprocess.run(
            ["rabbitmqctl", "-q", *args],
            capture_output=True,
            text=True,
            timeout=BROKER_START_TIMEOUT_S + 30,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"rabbitmqctl {' '.join(args)} failed: {done.stderr.strip()}")


@contextmanager
def broker_restarted(down_s: float) -> Iterator[float]:
    """Stop the machine's RabbitMQ application (every connection of every vhost drops), keep it down
    ``down_s`` seconds, start it again; yields the monotonic time it went down. The broker is shared:
    it is started again in ``finally`` whatever happened (a failed stop included), and waited for."""
    try:
        rabbitmqctl("stop_app")
        went_down = time.monotonic()
        yield went_down
        time.sleep(max(0.0, went_down + down_s - time.monotonic()))
    finally:
        start_broker()


def serve(stack: Stack) -> None:
    """Start the stack's orchestrator and worker and wait until every shard and task queue is consumed."""
    stack.start_orchestrator()
    stack.start_worker()
    wait_until_consuming(stack, is_shard_queue)
    wait_until_consuming(stack, is_task_queue)


def load_in_flight(stack: Stack, run_ids: list[str], finished_first: int) -> None:
    """Wait until ``finished_first`` runs have finished, so that a fault finds runs at every stage
    (finished, mid-way, not created yet)."""
    poll(
        lambda: terminal_count(stack, run_ids) >= finished_first,
        60,
        interval_s=0.02,
        what=f"{finished_first} runs to finish before the fault",
    )

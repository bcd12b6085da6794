"""/healthz and /readyz of real ``saga orchestrator`` and ``saga worker`` processes, on their
``--metrics-port`` beside /metrics (``orchestrator/health.py``).

The stack runs against a redis-server of its own (tests/integration/own_redis.py) so that Redis can be
stopped and started again under the processes, and in a RabbitMQ vhost of its own, whose connections can
be cut (and kept from coming back by revoking the vhost's permissions) without touching anyone else's.
Each probe must go 503 naming what is gone, and 200 again once it is back, with no restart: the
processes reconnect by themselves.
"""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from orchestrator.bus.names import Names
from tests.integration.own_redis import RedisServer, free_port
from tests.integration.stack import Stack, poll
from tests.integration.test_metrics import scrape, total

pytestmark = pytest.mark.services

SHARDS = 4  # the stack's shard map: classes fast and slow, two shards each
Answer = tuple[int, dict[str, Any]]


def probe(port: int, path: str) -> Answer | None:
    """The status and JSON body of http://127.0.0.1:PORT/PATH (None: nothing serves it yet)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=3) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
    except (urllib.error.URLError, ConnectionError):
        return None


def until(port: int, wanted: Callable[[Answer], bool], what: str, timeout_s: float = 30.0) -> Answer:
    """Poll /readyz until its answer is ``wanted``; that answer (the last one is in the failure)."""
    seen: list[Answer | None] = [None]

    def check() -> Answer | None:
        seen[0] = answer = probe(port, "/readyz")
        return answer if answer is not None and wanted(answer) else None

    try:
        return poll(check, timeout_s=timeout_s, interval_s=0.1, what=what)  # type: ignore[no-any-return]
    except AssertionError as exc:
        raise AssertionError(f"{exc}; /readyz last answered {seen[0]}") from None


def ready(answer: Answer) -> bool:
    return answer == (200, {"status": "ready", "problems": []})


def names_problem(prefix: str) -> Callable[[Answer], bool]:
    """A 503 whose problems include one starting with ``prefix``."""

    def check(answer: Answer) -> bool:
        code, body = answer
        return (
            code == 503
            and body["status"] == "not ready"
            and any(p.startswith(prefix) for p in body["problems"])
        )

    return check


@dataclass
class Probed:
    stack: Stack
    redis: RedisServer
    ports: dict[str, int]  # process name -> its metrics port


@pytest.fixture(scope="module")
def probed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Probed]:
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed; the services tests need it")
    redis = RedisServer(Path(tmp_path_factory.mktemp("health-redis")))
    redis.start()
    try:
        stack = Stack("health", redis_url=redis.url)
        stack.setup()
        try:
            ports = {"orchestrator": free_port(), "worker": free_port()}
            stack.start_orchestrator("orchestrator", "--metrics-port", str(ports["orchestrator"]))
            # the demo's effects ledger lives in this Redis too: no task runs here anyway
            stack.start_worker(
                "worker", "--metrics-port", str(ports["worker"]), extra_env={"SAGA_DEMO_EFFECTS": "0"}
            )
            yield Probed(stack, redis, ports)
        finally:
            if not redis._pings():  # a test that failed with Redis down: teardown deletes keys there
                redis.start()
            stack.rabbitmqctl("set_permissions", "-p", stack.vhost, "guest", ".*", ".*", ".*")
            stack.teardown()
    finally:
        redis.stop()


def consumers(stack: Stack, queue: str) -> list[bool]:
    """Whether each consumer of ``queue`` is the active one (single active consumer)."""
    out = stack.rabbitmqctl("list_consumers", "-p", stack.vhost, "queue_name", "active")
    return [
        fields[1] == "true" for fields in (line.split() for line in out.splitlines()) if fields[0] == queue
    ]


def test_alive_and_ready_once_consuming_a_standby_too(probed: Probed) -> None:
    stack, ports = probed.stack, probed.ports
    # Given an orchestrator following the shard map and a worker, serving their metrics port
    # Then each is alive, and ready once it consumes
    for name, port in ports.items():
        until(port, ready, f"the {name} to be ready")
        assert probe(port, "/healthz") == (200, {"status": "ok"}), name
    # and /metrics is served as before, beside them
    samples = scrape(ports["orchestrator"])
    assert samples is not None
    assert total(samples, "saga_shard_consumer") == SHARDS  # it consumes every shard: active or standby
    worker_samples = scrape(ports["worker"])
    assert worker_samples is not None
    assert any(name.startswith("saga_publish_confirm_seconds") for name, _, _ in worker_samples)

    # When a second orchestrator is pinned to a shard the first one already consumes
    ports["standby"] = free_port()
    stack.start_orchestrator(
        "standby", "--class", "fast", "--shards", "0", "--metrics-port", str(ports["standby"])
    )
    # Then it is ready as the queue's standby consumer (single active consumer: the first one stays active)
    until(ports["standby"], ready, "the standby orchestrator to be ready")
    assert sorted(consumers(stack, Names().shard_queue("fast.0"))) == [False, True]


def test_not_ready_naming_redis_while_it_is_down_and_ready_again_once_back(probed: Probed) -> None:
    stack, redis, ports = probed.stack, probed.redis, probed.ports
    # Given the processes ready
    for name, port in ports.items():
        until(port, ready, f"the {name} to be ready")
    # When Redis goes away
    redis.kill()
    # Then each says it is not ready, naming Redis, and is still alive
    for name, port in ports.items():
        until(port, names_problem("Redis: "), f"the {name}'s /readyz to name Redis")
        assert probe(port, "/healthz") == (200, {"status": "ok"}), name
    # and an orchestrator, whose shard loops give their deliveries back and wait, says it does not consume
    until(ports["orchestrator"], names_problem("not consuming shard queue(s) "), "the orchestrator to stop")
    # When Redis is back (same port, its data kept)
    redis.start()
    # Then each is ready again, with no restart
    for name, port in ports.items():
        until(port, ready, f"the {name} to be ready again")
    assert all(process.poll() is None for process in stack.processes.values())


def consumed_task_queues(stack: Stack) -> set[str]:
    """The task queues that have a consumer now (list_consumers is live; list_queues' counts lag)."""
    out = stack.rabbitmqctl("list_consumers", "-p", stack.vhost, "queue_name")
    return {line.split()[0] for line in out.splitlines() if line.strip() and ".task." in line.split()[0]}


def test_not_ready_naming_rabbitmq_while_cut_off_and_ready_again_once_back(probed: Probed) -> None:
    stack, ports = probed.stack, probed.ports
    for name, port in ports.items():
        until(port, ready, f"the {name} to be ready")
    served = consumed_task_queues(stack)
    assert served, "the worker consumes no task queue"
    # When the broker closes every connection of the stack's vhost, and refuses new ones meanwhile
    stack.rabbitmqctl("clear_permissions", "-p", stack.vhost, "guest")
    try:
        stack.rabbitmqctl("close_all_connections", "--vhost", stack.vhost, "--limit", "1000", "health test")
        # Then each says it is not ready, naming RabbitMQ
        for name, port in ports.items():
            until(port, names_problem("RabbitMQ: not connected"), f"the {name}'s /readyz to name RabbitMQ")
    finally:
        stack.rabbitmqctl("set_permissions", "-p", stack.vhost, "guest", ".*", ".*", ".*")
    # When it lets them in again, each reconnects, consumes again and is ready
    for name, port in ports.items():
        until(port, ready, f"the {name} to be ready again")
    assert all(process.poll() is None for process in stack.processes.values())
    assert sorted(consumers(stack, Names().shard_queue("fast.0"))) == [False, True]
    # and the worker, ready, consumes every task queue it did before (its readiness is not only its word)
    poll(lambda: consumed_task_queues(stack) == served, 15, what="the worker's task queues consumed again")

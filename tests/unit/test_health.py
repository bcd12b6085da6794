"""The probes of ``saga orchestrator`` and ``saga worker`` (``orchestrator/health.py``): the pure readiness
logic, one check of fakes, and the HTTP server that answers /healthz and /readyz from another thread
while the event loop is busy, and still serves /metrics as before."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from orchestrator import health, metrics
from orchestrator.health import Readiness, Status, problems, shard_consumption

FINE = Status(redis=None, broker=None, consuming=None)


# ---- the pure logic ------------------------------------------------------------------------------------


def test_before_the_first_check_nothing_is_ready() -> None:
    assert problems(Status(), now=0.0) == [
        "Redis: not checked yet",
        "RabbitMQ: not connected",
        "not consuming yet",
    ]


def test_a_fresh_reading_with_nothing_wrong_is_ready() -> None:
    status = Status(redis=None, broker=None, consuming=None, checked_at=100.0, valid_s=7.0)
    assert problems(status, now=107.0) == []


def test_each_problem_is_named() -> None:
    status = Status(
        redis="Connection refused", broker="not connected", consuming="not consuming shard queue(s) fast.0"
    )
    assert problems(status, now=0.0) == [
        "Redis: Connection refused",
        "RabbitMQ: not connected",
        "not consuming shard queue(s) fast.0",
    ]


def test_a_reading_nobody_refreshed_goes_stale() -> None:
    # Given a reading that was fine, valid for 7 s
    status = Status(redis=None, broker=None, consuming=None, checked_at=100.0, valid_s=7.0)
    # When nothing refreshed it for 10 s (the event loop blocked, or the watcher died)
    found = problems(status, now=110.0)
    # Then the process is not ready, and the probe says why
    assert len(found) == 1
    assert found[0].startswith("not checked for 10 s")


def test_a_stopping_process_is_not_ready_whatever_it_last_saw() -> None:
    readiness = Readiness()
    readiness.set(Status(redis=None, broker=None, consuming=None, checked_at=time.monotonic(), valid_s=7.0))
    assert readiness.problems() == []
    readiness.stopping()
    assert readiness.problems() == ["stopping"]
    assert readiness.problems(now=time.monotonic() + 3600) == ["stopping"]  # it never goes stale instead


@pytest.mark.parametrize(
    ("share", "subscribed", "expected"),
    [
        (None, set(), "not consuming yet: this process's share of the shards is not read yet"),
        (None, {"fast.0"}, "not consuming yet: this process's share of the shards is not read yet"),
        (set(), set(), None),  # a follower with an empty share consumes all it should
        ({"fast.0", "slow.1"}, {"fast.0", "slow.1"}, None),  # active or standby: both count
        ({"fast.0"}, {"fast.0", "fast.1"}, None),  # a shard still being left does not matter
        ({"slow.1", "fast.0", "fast.1"}, {"fast.1"}, "not consuming shard queue(s) fast.0, slow.1"),
    ],
)
def test_an_orchestrator_consumes_when_every_shard_of_its_share_is_subscribed(
    share: set[str] | None, subscribed: set[str], expected: str | None
) -> None:
    assert shard_consumption(share, subscribed) == expected


# ---- one check, on fakes -------------------------------------------------------------------------------


@dataclass
class FakeConnection:
    """What readiness looks at on an aio-pika connection."""

    connected: asyncio.Event = field(default_factory=asyncio.Event)
    is_closed: bool = False


def checks(ping: Any, connection: FakeConnection, consuming: str | None = None) -> health.Checks:
    return health.Checks(ping, connection, lambda: consuming)  # type: ignore[arg-type]


async def pong() -> bool:
    return True


async def refused() -> bool:
    raise ConnectionRefusedError("Error 111 connecting to 127.0.0.1:1. Connection refused.")


async def hang() -> bool:
    await asyncio.sleep(3600)
    return True


def test_a_check_of_a_healthy_process_is_ready() -> None:
    async def go() -> Status:
        connection = FakeConnection()
        connection.connected.set()
        return await health.check(checks(pong, connection), timeout_s=1.0)

    status = asyncio.run(go())
    assert problems(status, now=time.monotonic()) == []
    assert status.valid_s == health.CHECK_INTERVAL_S + 1.0 + health.STALE_GRACE_S


def test_a_check_names_redis_refusing_and_a_broker_reconnecting() -> None:
    async def go() -> Status:
        # a robust connection that lost the broker: not closed for good, but not connected either
        return await health.check(checks(refused, FakeConnection(), "not consuming yet"), timeout_s=1.0)

    assert problems(asyncio.run(go()), now=time.monotonic()) == [
        "Redis: Error 111 connecting to 127.0.0.1:1. Connection refused.",
        "RabbitMQ: not connected",
        "not consuming yet",
    ]


def test_a_redis_that_does_not_answer_fails_the_check_within_its_timeout() -> None:
    async def go() -> Status:
        connection = FakeConnection()
        connection.connected.set()
        connection.is_closed = True  # closed for good (the process is closing it)
        return await health.check(checks(hang, connection), timeout_s=0.2)

    started = time.monotonic()
    status = asyncio.run(go())
    assert time.monotonic() - started < 2
    assert problems(status, now=time.monotonic()) == [
        "Redis: no answer to PING within 0.2 s",
        "RabbitMQ: not connected",
    ]


def test_the_watcher_follows_redis_going_and_coming_back() -> None:
    async def go() -> list[list[str]]:
        connection = FakeConnection()
        connection.connected.set()
        answers: asyncio.Queue[Any] = asyncio.Queue()  # what each PING of the watcher does, in turn
        readiness = Readiness()

        async def ping() -> bool:
            answer = await answers.get()
            return bool(await answer())

        async def reading(after: float) -> list[str]:
            """The problems of the first reading taken after ``after``."""
            async with asyncio.timeout(10):
                while (readiness.status.checked_at or 0.0) <= after:
                    await asyncio.sleep(0.005)
            return readiness.problems()

        watching = asyncio.create_task(health.watch(readiness, checks(ping, connection), 30.0, 0.01))
        seen = []
        for answer in (pong, refused, pong):  # Redis answers, goes away, comes back
            asked_at = time.monotonic()
            await answers.put(answer)
            seen.append(await reading(asked_at))
        watching.cancel()
        return seen

    assert asyncio.run(go()) == [[], ["Redis: Error 111 connecting to 127.0.0.1:1. Connection refused."], []]


# ---- the HTTP side ---------------------------------------------------------------------------------------


@pytest.fixture
def served() -> Iterator[tuple[Readiness, int]]:
    readiness = Readiness()
    server = metrics.serve_metrics("127.0.0.1", 0, readiness)
    yield readiness, server.server_port
    server.shutdown()
    server.server_close()


def get(port: int, path: str, method: str = "GET") -> tuple[int, bytes]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_healthz_answers_while_the_process_runs(served: tuple[Readiness, int]) -> None:
    _, port = served
    code, body = get(port, "/healthz")
    assert (code, json.loads(body)) == (200, {"status": "ok"})


def test_readyz_says_what_is_not_ready_then_ready(served: tuple[Readiness, int]) -> None:
    readiness, port = served
    # Given a process whose loop has not checked anything yet
    code, body = get(port, "/readyz")
    assert code == 503
    assert json.loads(body) == {
        "status": "not ready",
        "problems": ["Redis: not checked yet", "RabbitMQ: not connected", "not consuming yet"],
    }
    # When its loop finds everything fine
    readiness.set(FINE)
    # Then the probe says ready
    code, body = get(port, "/readyz")
    assert (code, json.loads(body)) == (200, {"status": "ready", "problems": []})


def test_the_probes_take_only_get_and_head(served: tuple[Readiness, int]) -> None:
    readiness, port = served
    readiness.set(FINE)
    assert get(port, "/readyz", "HEAD") == (200, b"")
    code, _ = get(port, "/readyz", "POST")
    assert code == 405


def test_metrics_are_served_as_before(served: tuple[Readiness, int]) -> None:
    _, port = served
    metrics.refused("unit-test-health-scrape")
    code, body = get(port, "/metrics")
    assert code == 200
    assert 'saga_callbacks_refused_total{reason="unit-test-health-scrape"} 1.0' in body.decode()


def test_a_blocked_loop_does_not_block_the_probe_and_its_stale_reading_fails_it(
    served: tuple[Readiness, int],
) -> None:
    readiness, port = served
    readiness.set(Status(redis=None, broker=None, consuming=None, checked_at=time.monotonic(), valid_s=0.3))
    answers: list[tuple[int, bytes, float]] = []

    def probe() -> None:
        time.sleep(0.6)  # the reading is stale by now
        started = time.monotonic()
        code, body = get(port, "/readyz")
        answers.append((code, body, time.monotonic() - started))

    async def blocked() -> None:
        prober = threading.Thread(target=probe)
        prober.start()
        time.sleep(1.2)  # a handler that never yields: the loop runs nothing meanwhile
        prober.join()

    asyncio.run(blocked())
    ((code, body, took_s),) = answers
    assert code == 503 and b"not checked for" in body and took_s < 1.0


def test_the_probe_answers_while_the_loop_waits_on_a_hung_redis(served: tuple[Readiness, int]) -> None:
    readiness, port = served
    readiness.set(Status(redis=None, broker=None, consuming=None, checked_at=time.monotonic(), valid_s=60.0))
    answers: list[tuple[int, float]] = []

    async def go() -> None:
        connection = FakeConnection()
        connection.connected.set()
        watching = asyncio.create_task(health.watch(readiness, checks(hang, connection), timeout_s=30.0))
        await asyncio.sleep(0.1)  # the watcher is inside its PING, which will not answer for 30 s

        def probe() -> None:  # as Docker's healthcheck would, from outside the loop
            started = time.monotonic()
            code, _ = get(port, "/readyz")
            answers.append((code, time.monotonic() - started))

        prober = threading.Thread(target=probe)
        prober.start()
        while prober.is_alive():
            await asyncio.sleep(0.01)
        watching.cancel()

    asyncio.run(go())
    # the last reading is served at once: the probe never waits on Redis or the loop
    assert len(answers) == 1
    code, took_s = answers[0]
    assert code == 200
    assert took_s < 1.0

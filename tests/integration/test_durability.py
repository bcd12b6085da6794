"""Durability modes against real Redis servers of the test's own (free loopback ports, temporary
directories, stopped after): one with AOF and fsync always, one with appendfsync everysec, one with no
persistence at all. The shared Redis is not touched."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis

from orchestrator.durability import DurabilityRefused, Role, Verdict, check_startup, gather
from orchestrator.keys.ring import Scope
from orchestrator.settings import DEVELOPMENT_SIGNING_KEY, Settings
from tests.integration.own_redis import free_port
from tests.integration.rings import active, write_ring
from tests.integration.stack import ROOT, poll

pytestmark = pytest.mark.services

OWN_KEY = "k1:" + "a-production-secret-of-our-own-0123"
OWN_USER, OWN_PASSWORD = "saga-checks", "a-password-of-our-own"
NO_BROKER = "amqp://guest:guest@127.0.0.1:1/"  # a refusal must come before any broker is needed
OWN_BROKER = "amqp://saga-orchestrator:pw@127.0.0.1:1/"  # not guest: production refuses guest


def _answers(url: str) -> bool:
    client = redis.Redis.from_url(url, socket_connect_timeout=0.5)
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False
    finally:
        client.close()


@contextmanager
def redis_server(directory: Path, *persistence: str) -> Iterator[str]:
    directory.mkdir()
    port = free_port()
    log = (directory / "redis.log").open("wb")
    process = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(directory), *persistence],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        poll(lambda: process.poll() is None and _answers(url), 10, what=f"redis-server on port {port}")
        # production mode refuses Redis's default user: the checks run as a user of their own
        with redis.Redis.from_url(url) as admin:
            admin.execute_command("ACL", "SETUSER", OWN_USER, "on", f">{OWN_PASSWORD}", "~*", "&*", "+@all")
        yield f"redis://{OWN_USER}:{OWN_PASSWORD}@127.0.0.1:{port}/0"
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        log.close()


@pytest.fixture(scope="module")
def durable(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    base = tmp_path_factory.mktemp("redis")
    with redis_server(base / "always", "--appendonly", "yes", "--appendfsync", "always", "--save", "") as url:
        yield url


@pytest.fixture(scope="module")
def everysec(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    base = tmp_path_factory.mktemp("redis")
    with redis_server(
        base / "everysec", "--appendonly", "yes", "--appendfsync", "everysec", "--save", ""
    ) as url:
        yield url


@pytest.fixture(scope="module")
def volatile(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    base = tmp_path_factory.mktemp("redis")
    with redis_server(base / "volatile", "--appendonly", "no", "--save", "") as url:
        yield url


@pytest.fixture(scope="module")
def ring_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A key ring of scoped keys (production refuses unscoped ones)."""
    path = tmp_path_factory.mktemp("ring") / "ring.yaml"
    return write_ring(path, [active("orch", Scope.ORCHESTRATOR), active("dispatch", Scope.DISPATCH)])


def production(redis_url: str, keys: tuple[str, ...] | None = None, ring: Path | None = None) -> Settings:
    """Production settings on ``redis_url``: a user of its own on the broker, and the key ring ``ring``
    (else the unscoped ``keys``, which production refuses)."""
    if keys is not None or ring is None:
        return Settings(
            mode="production", redis_url=redis_url, amqp_url=OWN_BROKER, signing_keys=keys or (OWN_KEY,)
        )
    return Settings(mode="production", redis_url=redis_url, amqp_url=OWN_BROKER, key_ring_file=str(ring))


def test_the_facts_come_from_the_server(durable: str, volatile: str) -> None:
    found = gather(production(durable), Role.ORCHESTRATOR)
    assert (found.aof_enabled, found.appendfsync, found.redis_error) == (True, "always", None)
    assert gather(production(volatile), Role.ORCHESTRATOR).aof_enabled is False


def test_production_orchestrator_starts_on_redis_with_aof_and_fsync_always(
    durable: str, ring_file: Path
) -> None:
    assert check_startup(production(durable, ring=ring_file), Role.ORCHESTRATOR) == Verdict((), ())


def test_production_orchestrator_refuses_redis_without_persistence(volatile: str) -> None:
    with pytest.raises(DurabilityRefused, match="aof_enabled:0") as refused:
        check_startup(production(volatile), Role.ORCHESTRATOR)
    assert volatile.rpartition("@")[2] in str(refused.value) and OWN_PASSWORD not in str(refused.value)


def test_production_orchestrator_warns_on_fsync_everysec(
    everysec: str, ring_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="orchestrator.durability"):
        verdict = check_startup(production(everysec, ring=ring_file), Role.ORCHESTRATOR)
    assert verdict.refusals == ()
    assert [r.getMessage() for r in caplog.records] == list(verdict.warnings)
    assert "appendfsync everysec" in caplog.text


def test_production_orchestrator_refuses_redis_it_cannot_reach() -> None:
    with pytest.raises(DurabilityRefused, match="cannot tell whether Redis"):
        check_startup(production(f"redis://127.0.0.1:{free_port()}/0"), Role.ORCHESTRATOR)


def test_production_worker_needs_no_durable_redis_but_its_own_keys(volatile: str, ring_file: Path) -> None:
    assert check_startup(production(volatile, ring=ring_file), Role.WORKER) == Verdict((), ())
    with pytest.raises(DurabilityRefused, match="'dev' is the development default"):
        check_startup(production(volatile, (DEVELOPMENT_SIGNING_KEY,)), Role.WORKER)


# ---- through the CLI: the refusal is wired into the commands that start processes -----------------------


def saga(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SAGA_")}
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *args],
        cwd=ROOT,
        env={**environ, "SAGA_AMQP_URL": NO_BROKER, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_saga_orchestrator_in_production_exits_2_naming_what_to_fix(volatile: str) -> None:
    done = saga(
        "orchestrator",
        env={
            "SAGA_MODE": "production",
            "SAGA_REDIS_URL": volatile,
            "SAGA_SIGNING_KEYS": DEVELOPMENT_SIGNING_KEY,
        },
    )
    assert done.returncode == 2, done.stderr
    assert "the orchestrator refuses to start in production mode" in done.stderr
    assert "aof_enabled:0" in done.stderr and "'dev' is the development default" in done.stderr
    assert "Traceback" not in done.stderr


def test_saga_worker_in_production_refuses_the_development_key(volatile: str) -> None:
    done = saga("worker", env={"SAGA_MODE": "production", "SAGA_REDIS_URL": volatile})
    assert done.returncode == 2, done.stderr
    assert "the worker refuses to start" in done.stderr and "SAGA_SIGNING_KEYS" in done.stderr


def test_saga_orchestrator_in_development_warns_once_then_starts(volatile: str) -> None:
    # It gets as far as the broker, which is not there: the start-up check let it through.
    done = saga("orchestrator", env={"SAGA_REDIS_URL": volatile})
    warnings = [line for line in done.stderr.splitlines() if "development mode" in line]
    assert len(warnings) == 1, done.stderr
    assert "every run on a Redis restart" in warnings[0] and "forge" in warnings[0]
    assert "cannot reach RabbitMQ" in done.stderr

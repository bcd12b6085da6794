"""Least privilege against the real services: ``saga provision`` makes a Redis user and a RabbitMQ user
per role (orchestrator/access.py); an orchestrator, a worker and a client then run in production mode,
each as its own user with its own scoped key, and a run completes; and each user is refused what its
role does not need (NOPERM from Redis, ACCESS_REFUSED from RabbitMQ)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator
from pathlib import Path

import aio_pika
import aiormq
import pytest
import redis

from orchestrator.access import AccessRole, acl_file
from orchestrator.client import SyncClient
from orchestrator.keys.ring import Scope
from tests.faults.invariants import assert_sound
from tests.integration.own_redis import RedisServer
from tests.integration.refusals import NAMES
from tests.integration.rings import active, write_ring
from tests.integration.stack import ROOT, Stack, rabbitmqctl

pytestmark = pytest.mark.services

ROLES = ("orchestrator", "worker", "client", "server", "admin")
RING = [
    active("orch", Scope.ORCHESTRATOR),
    active("dispatch", Scope.DISPATCH),
    active("pool", Scope.WORKER, contracts=["*"]),
    active("client", Scope.CLIENT, tenants=["default"]),
]


def role_env(folder: Path, role: str) -> dict[str, str]:
    lines = (folder / f"{role}.env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line)


@pytest.fixture(scope="module")
def provisioned(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, Path]]:
    folder = tmp_path_factory.mktemp("least")
    server = RedisServer(folder)
    server.start()
    write_ring(folder / "ring.yaml", RING)
    stack = Stack("least", redis_url=server.url, env={"SAGA_KEY_RING_FILE": str(folder / "ring.yaml")})
    try:
        stack.setup()  # the topology and the definitions, as the administrator
        done = stack.saga("provision", "--secrets-dir", str(folder / "secrets"))
        assert done.returncode == 0, done.stderr
        assert "password" not in done.stdout + done.stderr.replace("password files", "")
        production = {"SAGA_MODE": "production"}
        stack.start_orchestrator(extra_env={**role_env(folder / "secrets", "orchestrator"), **production})
        stack.start_worker(extra_env={**role_env(folder / "secrets", "worker"), **production})
        yield stack, folder / "secrets"
    finally:
        stack.teardown()
        for role in ROLES:
            with contextlib.suppress(Exception):  # a user provisioning never made
                rabbitmqctl("delete_user", f"{stack.prefix}-{role}")
        server.stop()


def test_each_role_runs_as_its_own_user_in_production_mode(provisioned: tuple[Stack, Path]) -> None:
    stack, secrets = provisioned
    env = role_env(secrets, "client")
    settings = stack.settings.model_copy(
        update={"redis_url": env["SAGA_REDIS_URL"], "amqp_url": env["SAGA_AMQP_URL"]}
    )
    with SyncClient(settings.model_copy(update={"key_ring_file": stack.env["SAGA_KEY_RING_FILE"]})) as client:
        run_id = client.start("model-ingest", {"modelId": "least-1"})
        assert client.wait(run_id, timeout_s=60).state == "completed"
    for name in ("orchestrator", "worker"):
        assert "refuses to start" not in stack.log(name), stack.log(name)
    assert_sound(stack.redis, stack.prefix, [run_id])


def _redis_as(secrets: Path, role: str) -> redis.Redis:
    return redis.Redis.from_url(role_env(secrets, role)["SAGA_REDIS_URL"], decode_responses=True)


def test_the_orchestrators_redis_user_may_not_flush_configure_or_touch_other_keys(
    provisioned: tuple[Stack, Path],
) -> None:
    stack, secrets = provisioned
    with _redis_as(secrets, "orchestrator") as orchestrator:
        assert orchestrator.get(f"{stack.prefix}:{{shardmap}}:map")  # its own keys: yes
        for refused in (
            orchestrator.flushall,
            lambda: orchestrator.config_get("appendonly"),
            lambda: orchestrator.keys("*"),
            lambda: orchestrator.get("someone-else:secret"),
            lambda: orchestrator.execute_command("ACL", "LIST"),  # (DEBUG is off on the server itself)
        ):
            with pytest.raises(redis.exceptions.NoPermissionError):
                refused()
    with _redis_as(secrets, "worker") as worker:
        with pytest.raises(redis.exceptions.NoPermissionError):
            worker.hgetall(f"{stack.prefix}:{{fast.0}}:live")  # run state is the orchestrator's
        with pytest.raises(redis.exceptions.NoPermissionError):
            worker.execute_command("FCALL", "saga_transition", "0")
    with _redis_as(secrets, "client") as client:
        assert client.get(f"{stack.prefix}:index:{{x}}") is None  # it reads
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.set(f"{stack.prefix}:{{fast.0}}:live", "1")  # but writes only its claims


async def _ignore(message: aio_pika.abc.AbstractIncomingMessage) -> None:
    return None


async def _refused(url: str, act: str) -> str:
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel()
        with pytest.raises(aiormq.exceptions.ChannelAccessRefused) as caught:
            if act == "start":
                exchange = await channel.get_exchange(NAMES.start_exchange("fast"), ensure=False)
                await exchange.publish(aio_pika.Message(b"{}"), routing_key="x")
                await channel.get_exchange(NAMES.runs_exchange, ensure=True)  # the refusal arrives by now
            else:
                queue = await channel.get_queue(NAMES.shard_queue("fast.0"), ensure=False)
                await queue.consume(_ignore)
        return str(caught.value)
    finally:
        await connection.close()


def test_a_workers_rabbitmq_user_may_not_start_runs_or_read_shard_queues(
    provisioned: tuple[Stack, Path],
) -> None:
    _, secrets = provisioned
    url = role_env(secrets, "worker")["SAGA_AMQP_URL"]
    assert "ACCESS_REFUSED" in asyncio.run(_refused(url, "start"))
    assert "ACCESS_REFUSED" in asyncio.run(_refused(url, "consume"))
    client = role_env(secrets, "client")["SAGA_AMQP_URL"]
    assert "ACCESS_REFUSED" in asyncio.run(_refused(client, "consume"))


def test_provisioning_again_keeps_each_roles_password(provisioned: tuple[Stack, Path]) -> None:
    stack, secrets = provisioned
    before = {role: role_env(secrets, role) for role in ROLES}
    done = stack.saga("provision", "--secrets-dir", str(secrets))
    assert done.returncode == 0, done.stderr
    assert {role: role_env(secrets, role) for role in ROLES} == before
    assert oct((secrets / "orchestrator.env").stat().st_mode & 0o777) == "0o600"


def test_the_composes_redis_acl_file_loads_and_refuses_what_each_role_may_not(tmp_path: Path) -> None:
    """deploy/redis-users.acl (docker-compose's Redis) is what saga provision writes for the placeholder
    passwords, and a real redis-server takes it: the default user is off, and each role is held to its
    rules."""
    acl = ROOT / "deploy" / "redis-users.acl"
    passwords = {role: f"{role.value}-dev-password" for role in AccessRole}
    assert acl.read_text() == acl_file("saga", passwords), (
        "deploy/redis-users.acl is out of date: run saga provision --no-redis --no-rabbitmq --secrets-dir "
        "/tmp/placeholders --password ROLE:ROLE-dev-password (every role) "
        "--redis-acl-file deploy/redis-users.acl"
    )
    server = RedisServer(tmp_path, "--aclfile", str(acl))
    server.start(as_user=("saga-admin", "admin-dev-password"))
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as anonymous:
            anonymous.sendall(b"PING\r\n")
            assert anonymous.recv(100).startswith(b"-NOAUTH")
        url = f"redis://saga-orchestrator:orchestrator-dev-password@127.0.0.1:{server.port}/0"
        with redis.Redis.from_url(url) as orchestrator:
            assert orchestrator.set("saga:{x}:y", "1")
            with pytest.raises(redis.exceptions.NoPermissionError):
                orchestrator.flushall()
    finally:
        server.stop()

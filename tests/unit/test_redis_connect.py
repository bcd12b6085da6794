"""Which Redis client a SAGA_REDIS_URL gives, and how a cluster URL is read (no server needed)."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import SSLConnection, UnixDomainSocketConnection
from redis.exceptions import DataError

from orchestrator.durability import redis_location
from orchestrator.settings import Settings, redis_client
from orchestrator.store.connect import (
    BadRedisUrl,
    _HiredisPackedConnection,
    async_client,
    is_cluster,
    is_cluster_url,
    parse_cluster_url,
)


def test_a_cluster_url_lists_its_startup_nodes() -> None:
    parsed = parse_cluster_url("redis+cluster://127.0.0.1:7000, 10.0.0.2:7001/0")
    assert parsed.nodes == (("127.0.0.1", 7000), ("10.0.0.2", 7001))
    assert parsed.username is None and parsed.password is None and not parsed.ssl


def test_credentials_and_tls() -> None:
    parsed = parse_cluster_url("rediss+cluster://app:s%40cret@h1:7000,h2:7000")
    assert parsed.nodes == (("h1", 7000), ("h2", 7000))
    assert (parsed.username, parsed.password, parsed.ssl) == ("app", "s@cret", True)


@pytest.mark.parametrize(
    "url", ["redis+cluster://", "redis+cluster://h1", "redis+cluster://h1:x", "redis+cluster://h1:7000/3"]
)
def test_a_bad_cluster_url_is_refused_with_its_form(url: str) -> None:
    with pytest.raises(BadRedisUrl, match=r"redis\+cluster://host:port"):
        parse_cluster_url(url)


def test_only_the_cluster_schemes_are_clusters() -> None:
    assert is_cluster_url("redis+cluster://h:1") and is_cluster_url("REDISS+CLUSTER://h:1")
    assert not is_cluster_url("redis://h:6379/0") and not is_cluster_url("unix:///tmp/r.sock")


def test_settings_give_a_cluster_client_for_a_cluster_url_and_a_plain_one_otherwise() -> None:
    cluster = redis_client(Settings(redis_url="redis+cluster://127.0.0.1:7000,127.0.0.1:7001"))
    plain = redis_client(Settings(redis_url="redis://127.0.0.1:6379/0"))
    assert isinstance(cluster, RedisCluster) and is_cluster(cluster)
    assert [(n.host, n.port) for n in cluster.startup_nodes] == [("127.0.0.1", 7000), ("127.0.0.1", 7001)]
    assert isinstance(plain, aioredis.Redis) and not is_cluster(plain)
    assert is_cluster(async_client("redis+cluster://h:1"))


def test_messages_name_a_cluster_by_its_nodes_never_its_password() -> None:
    assert redis_location("redis+cluster://u:pw@h1:7000,h2:7001") == "cluster h1:7000,h2:7001"
    assert redis_location("redis+cluster://") == "<unparseable SAGA_REDIS_URL>"


def test_a_plain_redis_url_packs_commands_with_hiredis_as_redis_py_would_in_python() -> None:
    client = async_client("redis://127.0.0.1:6379/0")
    connection_class = client.connection_pool.connection_class
    assert connection_class is _HiredisPackedConnection
    packed = connection_class(host="127.0.0.1", port=6379)
    python = aioredis.Connection(host="127.0.0.1", port=6379)
    for command in (
        ("FCALL", "saga_transition", 2, "saga:{fast.0}:run:r", b"raw", '{"mid":"m","é":1.5}'),
        ("FUNCTION LOAD", "REPLACE", "#!lua name=saga"),  # a command of two words goes as two
        ("HSET", "k", "f", 12345678901234567890),
    ):
        assert b"".join(packed.pack_command(*command)) == b"".join(python.pack_command(*command)), command
    with pytest.raises(DataError):  # as redis-py refuses a value it cannot send
        packed.pack_command("SET", "k", None)


def test_tls_and_socket_urls_keep_the_connection_class_redis_py_picks() -> None:
    assert async_client("rediss://127.0.0.1:6380/0").connection_pool.connection_class is SSLConnection
    unix = async_client("unix:///tmp/redis.sock").connection_pool.connection_class
    assert unix is UnixDomainSocketConnection

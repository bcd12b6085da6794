"""The one place Redis clients are made: a plain Redis or a Redis Cluster, as ``SAGA_REDIS_URL`` says.

``redis://`` / ``rediss://`` (and ``unix://``) give a ``Redis``; ``redis+cluster://h1:p1,h2:p2`` (TLS:
``rediss+cluster://``, credentials as ``user:password@`` before the first node) gives a ``RedisCluster``
whose startup nodes are those listed (any one that answers is enough: the client discovers the rest and
follows MOVED, ASK and TRYAGAIN itself). A cluster has one database, so a path other than ``/0`` is
refused.

The cluster client answers the same commands, so both are typed as ``Redis`` for their callers; the few
things that differ on a cluster (loading the Functions library on every primary, per-node replies to
INFO) are done by the helpers here. Every key a multi-key command or a Lua call names shares one hash tag
(``orchestrator/store/keys.py``), so no command needs to cross slots.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import unquote

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode as AsyncClusterNode
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import RedisClusterException

from orchestrator.errors import SagaError

CLUSTER_SCHEMES = {"redis+cluster": False, "rediss+cluster": True}  # scheme -> TLS
#: What "Redis is unreachable" may look like: a cluster client that reaches no node, or cannot map a slot
#: to a node (mid-failover), raises RedisClusterException, which is not a RedisError.
REDIS_ERRORS: tuple[type[Exception], ...] = (redis.RedisError, RedisClusterException)


class BadRedisUrl(SagaError):
    """Raised when a ``redis+cluster://`` URL names no node, a node without a port, or a database."""

    code = "bad_redis_url"

    def __init__(self, problem: str) -> None:
        super().__init__(
            f"SAGA_REDIS_URL: {problem}; a cluster is given as redis+cluster://host:port[,host:port...]"
        )


@dataclass(frozen=True)
class ClusterUrl:
    nodes: tuple[tuple[str, int], ...]
    username: str | None = None
    password: str | None = None
    ssl: bool = False

    def options(self) -> dict[str, Any]:
        found: dict[str, Any] = {"username": self.username, "password": self.password}
        if self.ssl:
            found["ssl"] = True
        return found


def is_cluster_url(url: str) -> bool:
    return url.partition("://")[0].lower() in CLUSTER_SCHEMES


def parse_cluster_url(url: str) -> ClusterUrl:
    """``redis+cluster://[user:password@]host:port[,host:port...][/0]`` -> its parts."""
    scheme, _, rest = url.partition("://")
    location, _, path = rest.partition("/")
    if path.split("?", 1)[0] not in ("", "0"):
        raise BadRedisUrl(f"a cluster has only database 0, not {path!r}")
    userinfo, _, hosts = location.rpartition("@")
    username, _, password = userinfo.partition(":") if userinfo else ("", "", "")
    nodes = []
    for part in filter(None, (h.strip() for h in hosts.split(","))):
        host, _, port = part.rpartition(":")
        if not host or not port.isdigit():
            raise BadRedisUrl(f"node {part!r} is not host:port")
        nodes.append((host.strip("[]"), int(port)))
    if not nodes:
        raise BadRedisUrl("no node given")
    return ClusterUrl(
        tuple(nodes),
        unquote(username) or None,
        unquote(password) or None,
        CLUSTER_SCHEMES[scheme.lower()],
    )


def async_client(url: str, **options: Any) -> aioredis.Redis:
    """An asyncio client for ``url``: a ``RedisCluster`` for a cluster URL (typed as ``Redis``: it
    answers the same commands), else ``Redis.from_url``. ``options`` go to every connection."""
    if not is_cluster_url(url):
        return aioredis.Redis.from_url(url, **options)
    parsed = parse_cluster_url(url)
    nodes = [AsyncClusterNode(host, port) for host, port in parsed.nodes]
    return cast(aioredis.Redis, AsyncRedisCluster(startup_nodes=nodes, **parsed.options(), **options))


def sync_client(url: str, **options: Any) -> redis.Redis:
    """The blocking twin of :func:`async_client`."""
    if not is_cluster_url(url):
        return redis.Redis.from_url(url, **options)
    parsed = parse_cluster_url(url)
    nodes = [ClusterNode(host, port) for host, port in parsed.nodes]  # type: ignore[no-untyped-call]
    return cast(redis.Redis, RedisCluster(startup_nodes=nodes, **parsed.options(), **options))


def is_cluster(client: object) -> bool:
    return isinstance(client, AsyncRedisCluster | RedisCluster)


async def load_function_library(client: aioredis.Redis, source: str) -> None:
    """FUNCTION LOAD REPLACE ``source``: on every primary of a cluster (an FCALL runs on the primary of
    its keys' slot, and functions are per server), else on the one server."""
    if isinstance(client, AsyncRedisCluster):
        await client.execute_command(
            "FUNCTION LOAD", "REPLACE", source, target_nodes=AsyncRedisCluster.PRIMARIES
        )
    else:
        await client.function_load(source, replace=True)  # type: ignore[misc]


def info_of_every_primary(client: redis.Redis, section: str) -> list[dict[str, Any]]:
    """INFO ``section`` of the server, or of each primary of a cluster."""
    if isinstance(client, RedisCluster):
        replies = client.info(section, target_nodes=RedisCluster.PRIMARIES)
        return [dict(r) for r in cast(dict[str, Any], replies).values()]
    return [dict(cast(dict[str, Any], client.info(section)))]


def config_of_every_primary(client: redis.Redis, name: str) -> list[str | None]:
    """CONFIG GET ``name`` of the server, or of each primary of a cluster."""
    if isinstance(client, RedisCluster):
        replies = cast(dict[str, Any], client.config_get(name, target_nodes=RedisCluster.PRIMARIES))
        return [r.get(name) for r in replies.values()]
    return [cast(dict[str, Any], client.config_get(name)).get(name)]

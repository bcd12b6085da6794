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

from collections import deque
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import unquote

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode as AsyncClusterNode
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.asyncio.connection import Connection
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import HiredisRespSerializer
from redis.exceptions import ClusterError, RedisClusterException, TryAgainError
from redis.utils import HIREDIS_AVAILABLE

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


class _NewestFirst(deque[Connection]):
    """A node's free connections, handed out newest first (LIFO, as redis-py's ConnectionPool does)."""

    def popleft(self) -> Connection:
        return self.pop()


class _ClusterClient(AsyncRedisCluster):
    """redis-py's asyncio ``RedisCluster``, mended in two ways for a slot being migrated and in one for a
    new client's first commands (found with redis-py 7.4.1 by tests/cluster/test_cluster_cases.py and
    test_cluster_client.py, pinned by the latter; redis-py's 8.0 has the same code).

    * **ASK is followed.** redis-py sends ``ASKING`` and then the redirected command to the importing node
      as two pooled commands, and a node hands out its *oldest* free connection and takes it back at the
      end. With two or more connections to that node free (any busy client), the command goes out on a
      connection that never said ASKING: the importing node answers MOVED back to the source, the source
      ASK again, and after 16 rounds the call fails with ``ClusterError("TTL exhausted.")``. That is every
      command on a key already moved (or not created yet) for as long as the migration lasts. Handing
      out the newest free connection first makes the command reuse the ASKING connection: it is given
      back and taken again with no await in between, so no other task can take it meanwhile.
    * **A TRYAGAIN that outlasts the redirection budget is a TRYAGAIN.** A multi-key call (every FCALL of
      a transition) whose keys are split between the two nodes, or not all created yet, gets TRYAGAIN
      until the migration ends; after 16 tries redis-py raises ``ClusterError("TTL exhausted.")``, which
      the shard service would count as a failed transition (requeued, then poisoned). Raised as
      ``TryAgainError`` instead, it is what the service already treats as "the cluster is resharding":
      deliveries go back and the shard waits, as for Redis down.
    * **A new client knows the slots before its first command.** redis-py picks a command's node before
      it reads the cluster's slots, and with no slots known it sends a keyed command to a random node,
      relying on MOVED. Every fifth MOVED closes every connection of the client: a busy client's first
      commands (many at once) then close each other's connections mid-handshake, and fail with
      "Connection closed by server" once their retries run out. Reading the slots first sends each
      command to its key's node from the start.
    """

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        if self._initialize:  # see the class's docstring: a keyed command must not go to a random node
            await self.initialize()
        return await super().execute_command(*args, **kwargs)

    async def _execute_command(self, target_node: AsyncClusterNode, *args: Any, **kwargs: Any) -> Any:
        for node in self.nodes_manager.nodes_cache.values():  # nodes come and go: checked on each call
            if type(node._free) is not _NewestFirst:
                node._free = _NewestFirst(node._free, maxlen=node._free.maxlen)
        try:
            return await super()._execute_command(target_node, *args, **kwargs)
        except ClusterError as exc:
            if type(exc) is not ClusterError:  # its subclasses (ClusterDownError) say what they are
                raise
            raise TryAgainError(f"slot still moving after every retry: {exc}") from exc


class _HiredisPackedConnection(Connection):
    """A plain TCP connection that writes commands with hiredis's C packer. redis-py's blocking client
    does so when hiredis is installed; its asyncio connection packs every argument in Python, which was
    the largest single cost of an orchestrator's transition calls (each FCALL names a dozen keys)."""

    _packer = HiredisRespSerializer()

    def pack_command(self, *args: Any) -> list[bytes]:
        return cast(list[bytes], self._packer.pack(*args))


def async_client(url: str, **options: Any) -> aioredis.Redis:
    """An asyncio client for ``url``: a ``RedisCluster`` for a cluster URL (typed as ``Redis``: it
    answers the same commands; see :class:`_ClusterClient`), else ``Redis.from_url``. ``options`` go
    to every connection. A ``redis://`` connection packs commands with hiredis where it can; TLS and
    Unix-socket URLs keep the connection class redis-py picks for them."""
    if not is_cluster_url(url):
        # the test redis-py's blocking client makes before it packs with hiredis
        if url.partition("://")[0].lower() == "redis" and HIREDIS_AVAILABLE:
            options = {"connection_class": _HiredisPackedConnection, **options}
        return aioredis.Redis.from_url(url, **options)
    parsed = parse_cluster_url(url)
    nodes = [AsyncClusterNode(host, port) for host, port in parsed.nodes]
    return cast(aioredis.Redis, _ClusterClient(startup_nodes=nodes, **parsed.options(), **options))


def sync_client(url: str, **options: Any) -> redis.Redis:
    """The blocking twin of :func:`async_client`."""
    if not is_cluster_url(url):
        return redis.Redis.from_url(url, **options)
    parsed = parse_cluster_url(url)
    nodes = [ClusterNode(host, port) for host, port in parsed.nodes]  # type: ignore[no-untyped-call]
    return cast(redis.Redis, RedisCluster(startup_nodes=nodes, **parsed.options(), **options))


def is_cluster(client: object) -> bool:
    return isinstance(client, AsyncRedisCluster | RedisCluster)


def announces_run_ends(client: object) -> bool:
    """Whether runs' ends are announced on pub/sub channels through ``client``'s Redis (the stores that
    publish and the clients that subscribe decide alike): not on a Redis Cluster, whose asyncio client
    redis-py gives no pub/sub, so a client there could not hear them."""
    return not is_cluster(client)


# uvloop refuses a write on a transport the peer has reset with this ("unable to perform operation on
# <TCPTransport closed=True ...>"), where asyncio's loop raises ConnectionResetError and redis-py makes it
# its ConnectionError: on a connection that skips redis-py's health check it means the same lost connection
CLOSED_TRANSPORT = RuntimeError


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

"""A Redis Cluster of a test module's own: three primaries (no replicas) on free loopback ports, nothing
persisted, in a temporary folder removed afterwards."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import redis
from redis.cluster import ClusterNode, RedisCluster

from tests.integration.stack import poll

BUS_OFFSET = 10_000  # a cluster node also listens on port + 10000 (the cluster bus)


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_ports(count: int, first: int = 7100, last: int = 7999) -> list[int]:
    """``count`` ports from ``first`` on whose cluster-bus ports are free too."""
    found: list[int] = []
    for port in range(first, last):
        if _free(port) and _free(port + BUS_OFFSET):
            found.append(port)
            if len(found) == count:
                return found
    raise RuntimeError(f"no {count} free ports (and bus ports) in {first}-{last}")


class LocalCluster:
    """``start()`` launches the servers, joins them into one cluster and waits for ``cluster_state:ok``;
    ``stop()`` shuts them down (nosave) and removes their folder."""

    def __init__(self, primaries: int = 3) -> None:
        self.ports = free_ports(primaries)
        self.folder = Path(tempfile.mkdtemp(prefix="saga-cluster-"))

    @property
    def url(self) -> str:
        """The ``SAGA_REDIS_URL`` of this cluster: every primary a startup node."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def start(self) -> None:
        for port in self.ports:
            subprocess.run(
                [
                    "redis-server", "--port", str(port), "--bind", "127.0.0.1",
                    "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
                    "--dir", str(self.folder), "--save", "", "--appendonly", "no",
                    "--daemonize", "yes", "--logfile", str(self.folder / f"{port}.log"),
                ],
                check=True,
                capture_output=True,
            )  # fmt: skip
        for port in self.ports:
            poll(lambda p=port: self._pings(p), 10, what=f"redis-server on port {port}")
        nodes = [f"127.0.0.1:{p}" for p in self.ports]
        subprocess.run(
            ["redis-cli", "--cluster", "create", *nodes, "--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=60,
        )
        for port in self.ports:
            poll(lambda p=port: self._ok(p), 30, what=f"cluster_state:ok on port {port}")

    def stop(self) -> None:
        for port in self.ports:
            subprocess.run(
                ["redis-cli", "-p", str(port), "shutdown", "nosave"],
                capture_output=True,
                timeout=10,
                check=False,
            )
        shutil.rmtree(self.folder, ignore_errors=True)

    def client(self) -> RedisCluster:
        """A blocking cluster client (decoding replies, as the tests' helpers expect)."""
        return RedisCluster(
            startup_nodes=[ClusterNode("127.0.0.1", p) for p in self.ports], decode_responses=True
        )

    def node(self, port: int) -> redis.Redis:
        """A plain client of one node (for commands aimed at that node alone)."""
        return redis.Redis("127.0.0.1", port, decode_responses=True)

    def _pings(self, port: int) -> bool:
        try:
            with redis.Redis("127.0.0.1", port, socket_connect_timeout=0.2, socket_timeout=0.2) as c:
                return bool(c.ping())
        except redis.RedisError:
            return False

    def _ok(self, port: int) -> bool:
        with self.node(port) as c:
            info = c.cluster("info")
        # every node must also know every slot's owner before clients trust CLUSTER SLOTS
        return info.get("cluster_state") == "ok" and int(info.get("cluster_slots_assigned", 0)) == 16384

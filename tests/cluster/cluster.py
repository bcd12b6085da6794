"""A Redis Cluster of a test module's own: three primaries (by default no replicas; ``replicas=1`` gives each
primary one) on free loopback ports, nothing persisted, in a temporary folder removed afterwards.

Besides starting and stopping, it does to the cluster what an operator or a fault would, by talking to the
nodes themselves (never through a cluster client, which would hide what the nodes say): find which node
serves a slot, kill a primary (SIGKILL) and wait for its replica to take over, fail over on purpose
(``CLUSTER FAILOVER``), and move one slot to another primary the way ``redis-cli --cluster reshard`` does.
"""

from __future__ import annotations

import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from redis.cluster import ClusterNode, RedisCluster
from redis.crc import key_slot as crc_slot

from tests.integration.stack import poll

BUS_OFFSET = 10_000  # a cluster node also listens on port + 10000 (the cluster bus)
SLOTS = 16384


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_ports(count: int, first: int = 7100, last: int = 7999, companion: int = BUS_OFFSET) -> list[int]:
    """``count`` ports in ``first``-``last`` whose companion ports (``port + companion``: a Redis node's
    cluster bus, a RabbitMQ node's distribution port) are free too. The search starts at a random port
    of the range (and wraps), so that two test sessions starting clusters at the same moment rarely
    reach for the same ports (``start`` checks that every server it talks to is its own)."""
    found: list[int] = []
    span = last - first
    offset = random.randrange(span)
    for i in range(span):
        port = first + (offset + i) % span
        if _free(port) and _free(port + companion):
            found.append(port)
            if len(found) == count:
                return found
    raise RuntimeError(f"no {count} free ports (and ports {companion} above them) in {first}-{last}")


@dataclass(frozen=True)
class Node:
    """One line of CLUSTER NODES."""

    id: str
    port: int
    flags: frozenset[str]
    primary_id: str | None  # a replica's primary
    slots: tuple[tuple[int, int], ...]  # (first, last) ranges a primary serves

    @property
    def is_primary(self) -> bool:
        return "master" in self.flags

    @property
    def failed(self) -> bool:
        return "fail" in self.flags or "fail?" in self.flags

    def serves(self, slot: int) -> bool:
        return any(first <= slot <= last for first, last in self.slots)


def parse_nodes(text: str) -> list[Node]:
    """CLUSTER NODES -> nodes (migrating/importing markers like ``[42->-id]`` are left out of ``slots``)."""
    found = []
    for line in text.strip().splitlines():
        parts = line.split()
        address, flags, primary = parts[1], frozenset(parts[2].split(",")), parts[3]
        ranges = []
        for item in parts[8:]:
            if item.startswith("["):
                continue
            first, _, last = item.partition("-")
            ranges.append((int(first), int(last or first)))
        port = int(address.split("@")[0].rpartition(":")[2])
        found.append(Node(parts[0], port, flags, None if primary == "-" else primary, tuple(ranges)))
    return found


class LocalCluster:
    """``start()`` launches the servers, joins them into one cluster (``replicas`` per primary) and waits
    for ``cluster_state:ok`` and, with replicas, for every replica to be in sync; ``stop()`` shuts them
    down (nosave; SIGKILL if one does not go) and removes their folder.

    ``node_timeout_ms``: ``cluster-node-timeout`` (Redis's default is 15 s); a failover begins about that
    long after a primary stopped answering, so the failover tests set it small. ``full_coverage``:
    ``cluster-require-full-coverage`` (Redis's default, yes: while any slot has no live primary, every
    node refuses every command with CLUSTERDOWN)."""

    def __init__(
        self,
        primaries: int = 3,
        replicas: int = 0,
        node_timeout_ms: int | None = None,
        full_coverage: bool = True,
    ) -> None:
        self.primaries = primaries
        self.replicas = replicas
        self.node_timeout_ms = node_timeout_ms
        self.full_coverage = full_coverage
        self.ports = free_ports(primaries * (1 + replicas))
        self.folder = Path(tempfile.mkdtemp(prefix="saga-cluster-"))
        self.processes: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        """The ``SAGA_REDIS_URL`` of this cluster: every node a startup node (a dead one is skipped)."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def start(self) -> None:
        options = ["--cluster-node-timeout", str(self.node_timeout_ms)] if self.node_timeout_ms else []
        if not self.full_coverage:
            options += ["--cluster-require-full-coverage", "no"]
        for port in self.ports:
            log = (self.folder / f"{port}.out").open("ab")
            self.processes[port] = subprocess.Popen(
                [
                    "redis-server", "--port", str(port), "--bind", "127.0.0.1",
                    "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
                    *options,
                    "--dir", str(self.folder), "--save", "", "--appendonly", "no",
                    "--logfile", str(self.folder / f"{port}.log"),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
            log.close()
        for port in self.ports:
            poll(lambda p=port: self._ours(p), 10, what=f"our redis-server on port {port}")
        nodes = [f"127.0.0.1:{p}" for p in self.ports]
        replicas = ["--cluster-replicas", str(self.replicas)]
        subprocess.run(
            ["redis-cli", "--cluster", "create", *nodes, *replicas, "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=60,
        )
        for port in self.ports:
            poll(lambda p=port: self._ok(p), 30, what=f"cluster_state:ok on port {port}")
        if self.replicas:
            for port in self.ports:
                poll(lambda p=port: self.in_sync(p), 30, what=f"node {port} in sync with its primary")

    def stop(self) -> None:
        for port, process in self.processes.items():
            if process.poll() is None:
                subprocess.run(
                    ["redis-cli", "-p", str(port), "shutdown", "nosave"],
                    capture_output=True,
                    timeout=10,
                    check=False,
                )
        for process in self.processes.values():
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
        shutil.rmtree(self.folder, ignore_errors=True)

    def client(self) -> RedisCluster:
        """A blocking cluster client (decoding replies, as the tests' helpers expect)."""
        return RedisCluster(
            startup_nodes=[ClusterNode("127.0.0.1", p) for p in self.live_ports()], decode_responses=True
        )

    def node(self, port: int) -> redis.Redis:
        """A plain client of one node (for commands aimed at that node alone)."""
        return redis.Redis("127.0.0.1", port, decode_responses=True, socket_timeout=10)

    def live_ports(self) -> list[int]:
        return [p for p in self.ports if self.processes[p].poll() is None]

    # ---- topology ------------------------------------------------------------------------------------

    def nodes(self, asked: int | None = None) -> list[Node]:
        """CLUSTER NODES as node ``asked`` (default: the first live one) sees the cluster."""
        with self.node(asked if asked is not None else self.live_ports()[0]) as c:
            return parse_nodes(c.execute_command("CLUSTER", "NODES"))

    def node_id(self, port: int) -> str:
        with self.node(port) as c:
            return str(c.execute_command("CLUSTER", "MYID"))

    def primary_of_slot(self, slot: int, asked: int | None = None) -> int:
        """The port of the primary that serves ``slot``, as node ``asked`` sees it."""
        owners = [n.port for n in self.nodes(asked) if n.is_primary and not n.failed and n.serves(slot)]
        if len(owners) != 1:
            raise AssertionError(f"slot {slot} is served by {owners}, not by one primary")
        return owners[0]

    def primary_of_key(self, key: str) -> int:
        return self.primary_of_slot(key_slot(key))

    def replicas_of(self, port: int) -> list[int]:
        nodes = self.nodes()
        primary = next(n for n in nodes if n.port == port)
        return [n.port for n in nodes if n.primary_id == primary.id and not n.failed]

    def primary_ports(self) -> list[int]:
        return sorted(n.port for n in self.nodes() if n.is_primary and not n.failed)

    def everyone_agrees(self, check: Callable[[list[Node]], bool]) -> bool:
        """Whether ``check`` holds of the cluster as every live node sees it (gossip converges)."""
        for port in self.live_ports():
            try:
                if not check(self.nodes(port)):
                    return False
            except redis.RedisError:
                return False
        return True

    # ---- faults and operations ---------------------------------------------------------------------

    def kill(self, port: int) -> None:
        """SIGKILL the server on ``port``: no shutdown, nothing flushed, its connections reset."""
        process = self.processes[port]
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)

    def wait_promoted(self, replica: int, timeout_s: float = 60.0) -> None:
        """Until ``replica`` is a primary in every live node's view and every live node says the cluster
        is ok (all slots served)."""

        def promoted(nodes: list[Node]) -> bool:
            return any(n.port == replica and n.is_primary and n.slots for n in nodes)

        poll(
            lambda: self.everyone_agrees(promoted) and all(self._ok(p) for p in self.live_ports()),
            timeout_s,
            interval_s=0.1,
            what=f"node {replica} promoted to primary with every node agreeing",
        )

    def failover(self, replica: int, timeout_s: float = 60.0) -> None:
        """A coordinated ``CLUSTER FAILOVER`` on ``replica``: its primary stops taking writes, the replica
        catches up with its replication stream, then takes over (no acknowledged write is lost); the old
        primary becomes its replica."""
        with self.node(replica) as c:
            c.execute_command("CLUSTER", "FAILOVER")
        self.wait_promoted(replica, timeout_s)

    def migrate_slot(
        self,
        slot: int,
        target: int,
        *,
        batch: int = 10,
        pause_s: float = 0.0,
        opened: Callable[[], None] | None = None,
    ) -> int:
        """Move ``slot`` to primary ``target`` as ``redis-cli --cluster reshard`` does: SETSLOT IMPORTING on
        the target, MIGRATING on the source; MIGRATE ... KEYS the slot's keys ``batch`` at a time (with
        ``pause_s`` between batches, so that clients meet the slot mid-migration for a while) until the
        source has none left; then SETSLOT NODE on the target, the source and every other primary.
        ``opened`` is called once the slot is migrating, before any key moved. Returns how many keys
        moved."""
        source = self.primary_of_slot(slot)
        if source == target:
            raise ValueError(f"slot {slot} is already served by {target}")
        source_id, target_id = self.node_id(source), self.node_id(target)
        moved = 0
        with self.node(source) as src, self.node(target) as dst:
            dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
            src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
            if opened is not None:
                opened()
            while keys := src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, batch):
                # no REPLACE: a key on both sides would be a bug worth an error, not something to hide
                src.execute_command("MIGRATE", "127.0.0.1", target, "", 0, 10_000, "KEYS", *keys)
                moved += len(keys)
                time.sleep(pause_s)
        for port in [target, source, *(p for p in self.primary_ports() if p not in (source, target))]:
            with self.node(port) as c:
                c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
        poll(
            lambda: self.everyone_agrees(
                lambda nodes: any(n.port == target and n.serves(slot) for n in nodes)
            ),
            30,
            interval_s=0.1,
            what=f"every node to see slot {slot} on {target}",
        )
        return moved

    # ---- readiness -----------------------------------------------------------------------------------

    def _ours(self, port: int) -> bool:
        """Our server answers on ``port`` (its data folder is ours: not another session's server)."""
        if self.processes[port].poll() is not None:
            raise AssertionError(f"redis-server on port {port} exited: {self._tail(port)}")
        try:
            with redis.Redis("127.0.0.1", port, socket_connect_timeout=0.2, socket_timeout=0.2) as c:
                folder = c.config_get("dir").get("dir")
        except redis.RedisError:
            return False
        if folder is None or Path(str(folder)).resolve() != self.folder.resolve():
            raise AssertionError(f"the server on port {port} is not ours (its folder is {folder})")
        return True

    def _ok(self, port: int) -> bool:
        with self.node(port) as c:
            info = c.cluster("info")
        # every node must also know every slot's owner before clients trust CLUSTER SLOTS
        return info.get("cluster_state") == "ok" and int(info.get("cluster_slots_assigned", 0)) == SLOTS

    def in_sync(self, port: int) -> bool:
        """A primary: as many replicas as asked for are online; a replica: its link is up, sync done."""
        with self.node(port) as c:
            info = c.info("replication")
        if info.get("role") == "master":
            return int(info.get("connected_slaves", 0)) >= self.replicas
        return info.get("master_link_status") == "up" and not info.get("master_sync_in_progress")

    def _tail(self, port: int) -> str:
        log = self.folder / f"{port}.log"
        return "\n".join(log.read_text(errors="replace").splitlines()[-5:]) if log.exists() else ""


def key_slot(key: str) -> int:
    """The cluster slot of ``key`` (hash tags included)."""
    return int(crc_slot(key.encode()))


@contextmanager
def running_cluster(**options: Any) -> Iterator[LocalCluster]:
    """A started :class:`LocalCluster` (``options`` as its constructor takes them), stopped and its folder
    removed afterwards, also when starting it failed half-way."""
    found = LocalCluster(**options)
    try:
        found.start()
        yield found
    finally:
        found.stop()

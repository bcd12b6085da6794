"""A RabbitMQ cluster of a test module's own: three extra nodes on free loopback ports beside the machine's
broker, which stays as it is.

Each node has its own node name, AMQP and distribution ports, data and log folders, config file and
enabled-plugins file; they share the machine's Erlang cookie (they run as the ``rabbitmq`` user, as the
machine's node does, so ``rabbitmqctl -n NODE`` reaches them). ``start()`` boots the first node, joins the
others to it and waits until all three run; ``stop()`` stops them and removes their folder."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tests.cluster.cluster import free_ports
from tests.integration.stack import poll, rabbitmqctl

SERVER = "/usr/lib/rabbitmq/bin/rabbitmq-server"
DIST_OFFSET = 20_000  # RabbitMQ's own default: the distribution port is the AMQP port + 20000
PLUGINS = "[rabbitmq_consistent_hash_exchange]."


@dataclass(frozen=True)
class Node:
    name: str  # e.g. saga-t5681@localhost
    port: int
    folder: Path

    @property
    def pid_file(self) -> Path:
        return self.folder / "pid"

    def pid(self) -> int | None:
        """The node's Erlang VM: from its pid file, or (a node killed mid-boot writes none) the process
        started with its node name."""
        try:
            return int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            pass
        wanted = f"RABBITMQ_NODENAME={self.name}".encode()
        for entry in Path("/proc").iterdir():
            try:
                if (
                    entry.name.isdigit()
                    and wanted in (entry / "environ").read_bytes().split(b"\0")
                    and b"beam" in (entry / "cmdline").read_bytes()
                ):
                    return int(entry.name)
            except OSError:
                continue
        return None


class LocalRabbitCluster:
    def __init__(self, size: int = 3) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="saga-rabbit-"))
        self.nodes = [
            Node(f"saga-t{port}@localhost", port, self.folder / str(port))
            for port in free_ports(size, 5681, 5799, companion=DIST_OFFSET)
        ]
        self.stopped: set[str] = set()

    @property
    def hosts(self) -> str:
        """Every node's host:port, comma-separated: the host list of a SAGA_AMQP_URL."""
        return ",".join(f"127.0.0.1:{node.port}" for node in self.nodes)

    def live(self) -> list[Node]:
        return [node for node in self.nodes if node.name not in self.stopped]

    def ctl(self, *args: str, node: Node | None = None) -> str:
        """``rabbitmqctl ARGS`` on ``node`` (default: the first live one)."""
        return rabbitmqctl(*args, node=(node or self.live()[0]).name)

    # ---- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> None:
        rabbitmq = pwd.getpwnam("rabbitmq")
        for node in self.nodes:
            self._boot(node, rabbitmq.pw_uid, rabbitmq.pw_gid)
        for node in self.nodes:
            # await_startup needs the VM up: until it registers, the node is "not running at all"
            poll(lambda n=node: self._pings(n), 60, interval_s=0.5, what=f"{node.name} to answer")
            self.ctl("await_startup", "--timeout", "120", node=node)
        first = self.nodes[0]
        for node in self.nodes[1:]:
            self.ctl("stop_app", node=node)
            self.ctl("join_cluster", first.name, node=node)
            self.ctl("start_app", node=node)
        poll(self._all_running, 60, interval_s=0.5, what="every node of the test cluster to run")

    def _boot(self, node: Node, uid: int, gid: int) -> None:
        for sub in ("mnesia", "log"):
            (node.folder / sub).mkdir(parents=True, exist_ok=True)
        (node.folder / "enabled_plugins").write_text(PLUGINS)
        (node.folder / "rabbitmq.conf").write_text(
            f"listeners.tcp.local = 127.0.0.1:{node.port}\n"
            "cluster_partition_handling = pause_minority\n"  # a lone node stops rather than diverge
        )
        for path in (self.folder, node.folder, *node.folder.rglob("*")):
            os.chown(path, uid, gid)
        env = {
            **os.environ,
            "HOME": "/var/lib/rabbitmq",  # the machine's cookie lives there
            "RABBITMQ_NODENAME": node.name,
            "RABBITMQ_NODE_PORT": str(node.port),
            "RABBITMQ_DIST_PORT": str(node.port + DIST_OFFSET),
            "RABBITMQ_MNESIA_BASE": str(node.folder / "mnesia"),
            "RABBITMQ_LOG_BASE": str(node.folder / "log"),
            "RABBITMQ_CONFIG_FILE": str(node.folder / "rabbitmq.conf"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(node.folder / "enabled_plugins"),
            "RABBITMQ_PID_FILE": str(node.pid_file),
        }
        subprocess.run(
            ["runuser", "-u", "rabbitmq", "--", SERVER, "-detached"],
            env=env,
            cwd="/var/lib/rabbitmq",
            check=True,
            capture_output=True,
            timeout=60,
        )

    def kill(self, node: Node) -> None:
        """Stop ``node`` hard: SIGKILL its Erlang VM, as a crashed machine would."""
        pid = node.pid()
        assert pid is not None, f"no pid file for {node.name}"
        os.kill(pid, signal.SIGKILL)
        self.stopped.add(node.name)

    def stop(self) -> None:
        for node in self.nodes:
            pid = node.pid()
            if pid is None:
                continue
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)  # nothing here is worth a graceful stop
        shutil.rmtree(self.folder, ignore_errors=True)

    def _pings(self, node: Node) -> bool:
        try:
            self.ctl("ping", node=node)
        except RuntimeError:
            return False
        return True

    def _all_running(self) -> bool:
        try:
            out = self.ctl("eval", "length(rabbit_nodes:all_running()).")
        except RuntimeError:
            return False
        return out.strip() == str(len(self.live()))

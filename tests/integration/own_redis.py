"""A redis-server of a test's own: a free loopback port, its own data folder, persisting like production
(AOF, fsync on every write), so a test can kill it (-9) and start it again with nothing acknowledged lost.
"""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import redis

from tests.integration.stack import poll


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class RedisServer:
    """A redis-server on a free loopback port, persisting like production (AOF, fsync on every write)."""

    def __init__(self, folder: Path, *extra: str) -> None:
        """``extra``: more redis-server arguments (``--aclfile FILE``)."""
        self.folder = folder
        self.port = free_port()
        self.extra = extra
        self.process: subprocess.Popen[bytes] | None = None
        self.user: tuple[str, str] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, as_user: tuple[str, str] | None = None) -> None:
        """Start it; ``as_user``: (user, password) to ping it as, where the default user is off."""
        self.user = as_user or self.user
        self.process = subprocess.Popen(
            [
                "redis-server",
                "--bind",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--dir",
                str(self.folder),
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
                "--save",
                "",
                *self.extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        poll(self._pings, 10, what=f"redis-server on port {self.port}")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)

    def kill(self) -> None:
        """kill -9: no shutdown, no final fsync; ``start`` brings it back on the same port and data dir."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.kill()
        self.process.wait(timeout=10)

    def _pings(self) -> bool:
        try:
            username, password = self.user or (None, None)
            with redis.Redis.from_url(
                self.url, socket_connect_timeout=0.2, socket_timeout=0.2, username=username, password=password
            ) as client:
                return bool(client.ping())
        except redis.RedisError:
            return False

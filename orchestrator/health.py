"""``/healthz`` and ``/readyz`` of ``saga orchestrator`` and ``saga worker``, served beside ``/metrics`` on
the ``--metrics-port`` server.

``/healthz`` answers 200 while the process runs. ``/readyz`` answers 200 when Redis answers a PING, the
RabbitMQ connection is open and the process consumes what it should, else 503 with the problems named:
``{"status": "not ready", "problems": ["Redis: ...", "RabbitMQ: not connected", "not consuming ..."]}``.

Two sides, so that a probe can never hang or disturb the process it asks about. The HTTP server runs in
a daemon thread (prometheus_client's WSGI server, the one that served ``/metrics`` alone before) and only
*reads* a :class:`Readiness`: an immutable :class:`Status` swapped under a lock. The asyncio side,
:func:`watch`, pings Redis (bounded by a timeout), looks at the broker connection and asks the service
whether it consumes, once a second, and publishes what it found. The probe thread never touches Redis,
RabbitMQ or the event loop. A status carries when it was taken: a loop too blocked to refresh it (or a
watcher that died) turns ``/readyz`` 503 by itself instead of reporting an old "ready" for ever.

Both processes reconnect on their own (Redis: the shard loops wait for it; RabbitMQ: the robust
connection), so readiness goes false when either goes away and true again when it is back, with nothing
to restart. What "consuming" means is the service's: :func:`shard_consumption` for the orchestrator, the
worker's subscription for a worker.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer
    from wsgiref.types import StartResponse, WSGIApplication, WSGIEnvironment

    from aio_pika.abc import AbstractConnection

log = logging.getLogger(__name__)

#: How often the asyncio side refreshes the status.
CHECK_INTERVAL_S = 1.0
#: Slack on top of one check cycle (interval + Redis timeout) before a status counts as stale: a busy
#: loop that is merely late must not flap the probe.
STALE_GRACE_S = 5.0


# ---- the status and its pure logic -----------------------------------------------------------------


@dataclass(frozen=True)
class Status:
    """What the asyncio side last found. Each field is None when fine, else what is wrong, in words
    a probe's reader understands. Immutable, so the HTTP thread can hold one while the loop swaps in
    the next."""

    redis: str | None = "not checked yet"
    broker: str | None = "not connected"
    consuming: str | None = "not consuming yet"
    # time.monotonic() when taken, and for how long it may be believed (None: not a live reading, such
    # as the one before the first check or the one of a process stopping, so it cannot go stale)
    checked_at: float | None = None
    valid_s: float = 0.0


def problems(status: Status, now: float) -> list[str]:
    """Why the process is not ready (empty: it is), as ``/readyz`` lists them."""
    found = []
    if status.redis is not None:
        found.append(f"Redis: {status.redis}")
    if status.broker is not None:
        found.append(f"RabbitMQ: {status.broker}")
    if status.consuming is not None:
        found.append(status.consuming)
    if status.checked_at is not None and now - status.checked_at > status.valid_s:
        found.append(
            f"not checked for {now - status.checked_at:.0f} s: the process's event loop is not running "
            "its checks (blocked, e.g. by a handler that does not yield: see the process's log)"
        )
    return found


def shard_consumption(share: set[str] | None, subscribed: set[str]) -> str | None:
    """Whether an orchestrator consumes what it should (None: it does). ``share``: the shards it is to
    serve (None: a follower that has not read its share of the map yet); ``subscribed``: the shard
    queues it has a consumer on. A standby consumer of a single-active-consumer queue is subscribed, and
    counts: it takes over the moment the active one goes. A follower whose share is empty (more members
    than shards) consumes all it should."""
    if share is None:
        return "not consuming yet: this process's share of the shards is not read yet"
    missing = share - subscribed
    if missing:
        return f"not consuming shard queue(s) {', '.join(sorted(missing))}"
    return None


def broker_connected(connection: AbstractConnection) -> bool:
    """Whether an aio-pika connection is open now. A robust connection that lost the broker is not
    ``is_closed`` (that means closed for good) while it reconnects; ``connected`` is cleared meanwhile."""
    return connection.connected.is_set() and not connection.is_closed


class Readiness:
    """The one :class:`Status` shared by the asyncio side (writes) and the HTTP thread (reads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._status = Status()

    @property
    def status(self) -> Status:
        with self._lock:
            return self._status

    def set(self, status: Status) -> None:
        with self._lock:
            self._status = status

    def stopping(self) -> None:
        """The process is draining: not ready, whatever Redis and the broker say."""
        with self._lock:
            self._status = replace(self._status, consuming="stopping", checked_at=None)

    def problems(self, now: float | None = None) -> list[str]:
        return problems(self.status, time.monotonic() if now is None else now)


# ---- the asyncio side --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Checks:
    """How :func:`watch` finds out, each called on the event loop: ``ping_redis`` (raises when Redis
    does not answer), ``broker`` (the RabbitMQ connection) and ``consuming`` (None: it consumes; else
    the problem, in words)."""

    ping_redis: Callable[[], Awaitable[Any] | Any]
    broker: AbstractConnection
    consuming: Callable[[], str | None]


async def check(checks: Checks, timeout_s: float) -> Status:
    """One reading: Redis pinged (for at most ``timeout_s``), the broker connection and the consumers
    looked at. Valid for one more cycle plus :data:`STALE_GRACE_S`."""
    redis: str | None = None
    try:
        async with asyncio.timeout(timeout_s):
            answer = checks.ping_redis()
            if inspect.isawaitable(answer):  # redis-py's types allow a sync answer
                await answer
    except TimeoutError:
        redis = f"no answer to PING within {timeout_s:g} s"
    except Exception as exc:  # any failure means not ready; the message says which
        redis = str(exc) or type(exc).__name__
    broker = None if broker_connected(checks.broker) else "not connected"
    return Status(
        redis=redis,
        broker=broker,
        consuming=checks.consuming(),
        checked_at=time.monotonic(),
        valid_s=CHECK_INTERVAL_S + timeout_s + STALE_GRACE_S,
    )


async def watch(
    readiness: Readiness, checks: Checks, timeout_s: float, interval_s: float = CHECK_INTERVAL_S
) -> None:
    """Refresh ``readiness`` every ``interval_s`` until cancelled. A check that fails unexpectedly is
    logged and tried again; the status it could not refresh goes stale, so the probe fails meanwhile."""
    while True:
        try:
            readiness.set(await check(checks, timeout_s))
        except Exception:
            log.exception("the readiness check failed; trying again")
        await asyncio.sleep(interval_s)


# ---- the HTTP side -------------------------------------------------------------------------------------


def wsgi_app(readiness: Readiness, fallback: WSGIApplication) -> WSGIApplication:
    """``/healthz`` and ``/readyz`` from ``readiness``; every other path to ``fallback`` (the metrics,
    unchanged). Reads the status only: it never waits on Redis, RabbitMQ or the event loop."""

    def app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path not in ("/healthz", "/readyz"):
            return fallback(environ, start_response)
        if environ.get("REQUEST_METHOD") not in ("GET", "HEAD"):
            start_response("405 Method Not Allowed", [("Allow", "GET, HEAD"), ("Content-Length", "0")])
            return [b""]
        body: dict[str, Any]
        if path == "/healthz":
            code, body = "200 OK", {"status": "ok"}
        else:
            found = readiness.problems()
            code = "503 Service Unavailable" if found else "200 OK"
            body = {"status": "not ready" if found else "ready", "problems": found}
        data = json.dumps(body).encode()
        start_response(
            code,
            [
                ("Content-Type", "application/json"),
                ("Content-Length", str(len(data))),
                ("Cache-Control", "no-store"),
            ],
        )
        return [b"" if environ.get("REQUEST_METHOD") == "HEAD" else data]

    return app


class _QuietHandler(WSGIRequestHandler):
    """No line on stderr per request (a probe every few seconds would drown the process's own logs)."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


def serve(host: str, port: int, readiness: Readiness | None = None) -> WSGIServer:
    """Serve the default registry's metrics (prometheus_client's WSGI app, any path but the two below)
    and, given ``readiness``, ``/healthz`` and ``/readyz``, on ``host:port`` from a daemon thread. This
    is prometheus_client's ``start_http_server`` (a thread per request, the address family ``host``
    needs, IPv6 included) with the dispatcher in front. Returns the server (its ``server_port`` is the
    port bound, for port 0); raises OSError when the port cannot be bound."""
    app = make_wsgi_app()
    if readiness is not None:
        app = wsgi_app(readiness, app)
    family, address = _family(host, port)

    class Server(ThreadingWSGIServer):  # a class per call, as prometheus_client does: its family is bound
        address_family = family

    server = make_server(address, port, app, Server, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="saga-metrics-http", daemon=True).start()
    return server


def _family(host: str, port: int) -> tuple[socket.AddressFamily, str]:
    """The address family and address to bind ``host`` with (as prometheus_client picks them)."""
    family, _, _, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    return family, str(address[0])

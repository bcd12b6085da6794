"""A TCP proxy for fault injection between a process under test and a server (Redis, here).

It runs in the test process, on a background thread with its own asyncio loop, listens on a free loopback
port and forwards to one upstream ``host:port``. Faults are switched at runtime from the test thread;
each switch is applied on the proxy's loop before the call returns, so "once ``blackhole()`` has returned,
nothing gets through" holds without sleeping.

Modes:

* ``set_pass()``: forward both ways.
* ``blackhole()``: a network partition that loses the connections it catches. Every open connection, and
  every connection accepted while it lasts, is held open and *stranded*: nothing is forwarded either way,
  nothing is answered, nothing is closed. Stranded connections stay dead after the heal, as when a
  firewall, NAT or load balancer forgot their state: a client must notice by itself (socket timeout,
  health check) and connect again; connections made after the heal pass. This is the strict form of a
  partition: a client that survives it also survives one whose connections resume.
* ``reset()``: every open connection, and every new one while it lasts, is closed with a TCP RST
  (``SO_LINGER`` 0), on both sides.
* ``delay(ms)``: every chunk, in both directions, is delivered ``ms`` after it was read, in order (latency,
  not a throughput limit: chunks do not queue behind each other's delay).
* ``drop_reply_after(pattern)``: one shot. The next client->server chunk that matches ``pattern`` (bytes it
  contains, or a compiled ``re.Pattern[bytes]`` found in it) is forwarded; the server's replies on that
  connection are swallowed until every command sent up to and including that chunk has been answered
  (the proxy counts RESP values both ways, so "the command ran upstream" is a fact, not a guess), then the
  connection is reset on both sides. The client never hears back. Then the proxy is back to ``pass``.

Either side closing closes both (no half-close: Redis clients do not use it). Counters (``stats()``) let a
test prove that its fault happened. ``FaultProxy`` is a context manager; stopping it resets every
connection, closes the listening socket and joins the thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import struct
import threading
from collections.abc import Coroutine
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Self, TypeVar

CHUNK = 65_536
TAIL = 8_192  # a pattern may start this far back in earlier reads
SWITCH_TIMEOUT_S = 10.0
T = TypeVar("T")


class Mode(Enum):
    PASS = "pass"
    BLACKHOLE = "blackhole"
    RESET = "reset"
    DELAY = "delay"
    DROP_REPLY = "drop-reply-after"


@dataclass(frozen=True)
class ProxyStats:
    accepted: int = 0  # client connections accepted
    bytes_up: int = 0  # client -> server, forwarded
    bytes_down: int = 0  # server -> client, forwarded
    replies_dropped: int = 0  # drop_reply_after: connections whose replies were swallowed, then reset
    resets: int = 0  # connections closed with RST (reset(), drop_reply_after, stop, a refused upstream)
    stranded: int = 0  # connections a blackhole caught (they stay dead)
    open: int = 0  # client connections open now


class RespCounter:
    """Counts complete top-level RESP values in a byte stream fed in arbitrary pieces.

    Enough of RESP2/RESP3 to find value boundaries: aggregates (``* ~ > %``) nest, blobs (``$ = !``)
    are skipped by length, every other line is one value (which also covers inline commands)."""

    def __init__(self) -> None:
        self.count = 0
        self._buffer = bytearray()
        self._skip = 0  # blob bytes (and their CRLF) still to come
        self._open: list[int] = []  # elements still missing in each open aggregate, innermost last

    @property
    def at_boundary(self) -> bool:
        return not self._buffer and not self._skip and not self._open

    def feed(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        pos = 0
        while pos < len(buffer):
            if self._skip:
                step = min(self._skip, len(buffer) - pos)
                pos += step
                self._skip -= step
                if not self._skip:
                    self._value_done()
                continue
            end = buffer.find(b"\r\n", pos)
            if end < 0:
                break
            kind, header = bytes(buffer[pos : pos + 1]), buffer[pos + 1 : end]
            pos = end + 2
            if kind in (b"*", b"~", b">", b"%"):
                n = int(header) * (2 if kind == b"%" else 1)
                if n > 0:
                    self._open.append(n)
                else:
                    self._value_done()  # empty or null aggregate
            elif kind in (b"$", b"=", b"!"):
                n = int(header)
                if n >= 0:
                    self._skip = n + 2
                else:
                    self._value_done()  # null bulk string
            else:
                self._value_done()
        del buffer[:pos]

    def _value_done(self) -> None:
        while self._open:
            self._open[-1] -= 1
            if self._open[-1]:
                return
            self._open.pop()
        self.count += 1


@dataclass(eq=False)
class _Link:
    """One client connection and its upstream connection."""

    client_reader: asyncio.StreamReader
    client_writer: asyncio.StreamWriter
    upstream_writer: asyncio.StreamWriter | None = None
    stranded: bool = False
    closed: bool = False
    requests: RespCounter = field(default_factory=RespCounter)
    replies: RespCounter = field(default_factory=RespCounter)
    # drop_reply_after matched on this link: swallow replies; once the request stream is at a command
    # boundary, hold the client's further bytes and reset when ``owed`` replies have arrived
    swallowing: bool = False
    owed: int | None = None
    dropped: bytearray = field(default_factory=bytearray)  # what was sent from the match to the boundary
    tail: bytes = b""  # the last TAIL bytes before this read: a pattern split over reads still matches
    tasks: set[asyncio.Task[None]] = field(default_factory=set)


def _abort(writer: asyncio.StreamWriter | None) -> None:
    """Close with RST: SO_LINGER on with a zero timeout, then close without flushing."""
    if writer is None:
        return
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class FaultProxy:
    def __init__(self, upstream_host: str, upstream_port: int, listen_host: str = "127.0.0.1") -> None:
        if listen_host not in ("127.0.0.1", "::1"):
            raise ValueError("the fault proxy listens on a loopback address only")
        self.upstream = (upstream_host, upstream_port)
        self.listen_host = listen_host
        self.port = 0
        self._mode = Mode.PASS
        self._delay_s = 0.0
        self._pattern: bytes | re.Pattern[bytes] | None = None
        self._links: set[_Link] = set()
        self._handlers: set[asyncio.Task[None]] = set()
        self._stopping = False
        self._lock = threading.Lock()  # guards what the test thread reads: counters, dropped requests
        self._counts = {name: 0 for name in ProxyStats.__dataclass_fields__ if name != "open"}
        self._dropped_requests: list[bytes] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None

    # ---- lifecycle (test thread) --------------------------------------------------------------------

    def start(self) -> Self:
        ready = threading.Event()
        failure: list[BaseException] = []

        def main() -> None:
            loop = asyncio.new_event_loop()
            try:
                self._server = loop.run_until_complete(
                    asyncio.start_server(self._accept, self.listen_host, 0, limit=CHUNK)
                )
                self.port = int(self._server.sockets[0].getsockname()[1])
                self._loop = loop
            except BaseException as exc:
                failure.append(exc)
                loop.close()
                return
            finally:
                ready.set()
            try:
                loop.run_forever()
            finally:
                loop.close()

        self._thread = threading.Thread(target=main, name=f"fault-proxy-{self.upstream[1]}", daemon=True)
        self._thread.start()
        ready.wait(SWITCH_TIMEOUT_S)
        if failure:
            raise failure[0]
        if self._loop is None:
            raise RuntimeError("the fault proxy did not start listening")
        return self

    def stop(self) -> None:
        """Reset every connection, close the listening socket, stop the loop and join the thread."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        try:
            self._call(self._shutdown())
        finally:
            self._loop = None
            loop.call_soon_threadsafe(loop.stop)
            thread.join(SWITCH_TIMEOUT_S)
            self._thread = None
        if thread.is_alive():
            raise RuntimeError("the fault proxy's thread did not stop")

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def address(self) -> tuple[str, int]:
        return self.listen_host, self.port

    def redis_url(self, db: int = 0) -> str:
        return f"redis://{self.listen_host}:{self.port}/{db}"

    # ---- faults (test thread) -----------------------------------------------------------------------

    @property
    def mode(self) -> Mode:
        return self._mode

    def set_pass(self) -> None:
        self._call(self._switch(Mode.PASS))

    def blackhole(self) -> None:
        self._call(self._switch(Mode.BLACKHOLE))

    def reset(self) -> None:
        self._call(self._switch(Mode.RESET))

    def delay(self, ms: float) -> None:
        if ms < 0:
            raise ValueError("a delay cannot be negative")
        self._call(self._switch(Mode.DELAY, delay_s=ms / 1000))

    def drop_reply_after(self, pattern: bytes | re.Pattern[bytes]) -> None:
        if not (pattern.pattern if isinstance(pattern, re.Pattern) else pattern):
            raise ValueError("an empty pattern would match every chunk")
        self._call(self._switch(Mode.DROP_REPLY, pattern=pattern))

    def reset_stranded(self) -> None:
        """Reset the connections a blackhole stranded: at teardown, a client stuck on one gets unstuck
        (and so can exit) instead of waiting forever."""
        self._call(self._reset_links(only_stranded=True))

    def stats(self) -> ProxyStats:
        with self._lock:
            return ProxyStats(**self._counts, open=len(self._links))

    def dropped_requests(self) -> list[bytes]:
        """What drop_reply_after forwarded and never let the client hear about: per drop, the bytes from
        the matching chunk (with the tail of the one before) to the end of the command."""
        with self._lock:
            return list(self._dropped_requests)

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        loop = self._loop
        if loop is None:
            coro.close()
            raise RuntimeError("the fault proxy is not running")
        return asyncio.run_coroutine_threadsafe(coro, loop).result(SWITCH_TIMEOUT_S)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    # ---- the proxy's loop ---------------------------------------------------------------------------

    async def _switch(
        self, mode: Mode, *, delay_s: float = 0.0, pattern: bytes | re.Pattern[bytes] | None = None
    ) -> None:
        self._mode, self._delay_s, self._pattern = mode, delay_s, pattern
        if mode is Mode.BLACKHOLE:
            for link in self._links:
                self._strand(link)
        elif mode is Mode.RESET:
            await self._reset_links(only_stranded=False)

    def _strand(self, link: _Link) -> None:
        if not link.stranded:
            link.stranded = True
            self._count("stranded")

    async def _reset_links(self, *, only_stranded: bool) -> None:
        for link in list(self._links):
            if link.stranded or not only_stranded:
                self._close(link, reset=True)

    async def _shutdown(self) -> None:
        self._stopping = True  # from now on _accept resets whatever reaches it
        loop = asyncio.get_running_loop()
        sockets = self._server.sockets if self._server is not None else ()
        # Stop accepting before closing. asyncio turns a connection the kernel accepted into a transport a
        # few loop turns later, and if the server closed meanwhile that fails and leaks the socket (open,
        # silent) in Python 3.11. So: no new accept()s; let those under way reach _accept; then close
        # the listening socket, and the kernel resets whatever still waits in its backlog.
        for sock in sockets:
            loop.remove_reader(sock.fileno())
        for _ in range(5):
            await asyncio.sleep(0.01)
        if self._server is not None:
            self._server.close()
        tasks = [task for link in list(self._links) for task in link.tasks]
        await self._reset_links(only_stranded=False)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._handlers:  # their connections are closed: they end on their own
            await asyncio.wait(list(self._handlers), timeout=SWITCH_TIMEOUT_S)
        if self._server is not None:
            await self._server.wait_closed()
        await asyncio.sleep(0.01)  # the transports' own close callbacks run before the loop stops

    def _close(self, link: _Link, *, reset: bool) -> None:
        if link.closed:
            return
        link.closed = True
        self._links.discard(link)
        if reset:
            self._count("resets")
            _abort(link.client_writer)
            _abort(link.upstream_writer)
        else:
            link.client_writer.close()
            if link.upstream_writer is not None:
                link.upstream_writer.close()
        current = asyncio.current_task()
        for task in link.tasks:
            if task is not current:
                task.cancel()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._count("accepted")
        link = _Link(reader, writer)
        # Not in link.tasks: asyncio (3.11) logs a cancelled connection handler as an error, so this task
        # is never cancelled; closing the link ends its read, and stop() waits for it.
        this = asyncio.current_task()
        if this is not None:
            self._handlers.add(this)
            this.add_done_callback(self._handlers.discard)
        self._links.add(link)
        if self._mode is Mode.RESET or self._stopping:
            self._close(link, reset=True)
            return
        if self._mode is Mode.BLACKHOLE:
            self._strand(link)
        else:
            try:
                upstream_reader, link.upstream_writer = await asyncio.wait_for(
                    asyncio.open_connection(*self.upstream, limit=CHUNK), SWITCH_TIMEOUT_S
                )
            except (OSError, TimeoutError):
                self._close(link, reset=True)  # upstream refused: the client sees its connection reset
                return
            if link.closed:  # reset() or stop() while we were connecting
                _abort(link.upstream_writer)
                return
            self._spawn(link, self._pump(link, upstream_reader, writer, upstream=False))
        # Client -> server runs in this task. A stranded link only reads and discards, so that it is
        # released when the client gives up on it and closes.
        await self._pump(link, reader, link.upstream_writer, upstream=True)

    def _spawn(self, link: _Link, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        link.tasks.add(task)
        task.add_done_callback(link.tasks.discard)

    async def _pump(
        self,
        link: _Link,
        source: asyncio.StreamReader,
        target: asyncio.StreamWriter | None,
        *,
        upstream: bool,
    ) -> None:
        """Read chunks from one side; hand each, stamped with its due time, to a delivery task."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()
        if target is not None:
            self._spawn(link, self._deliver(link, queue, target, upstream=upstream))
        try:
            while not link.closed:
                try:
                    data = await source.read(CHUNK)
                except (ConnectionError, OSError):
                    break
                if not data:
                    break
                if link.stranded or target is None:
                    continue  # a blackhole forwards nothing, either way
                forward = self._inspect_request(link, data) if upstream else self._inspect_reply(link, data)
                if forward:
                    queue.put_nowait((loop.time() + self._delay_s, data))
        finally:
            if link.stranded:
                if upstream:  # only the client giving up ends a stranded link: it must hear nothing
                    self._close(link, reset=False)
            elif target is None:
                self._close(link, reset=False)
            else:
                queue.put_nowait(None)  # close once what was read before the close has been delivered

    def _inspect_request(self, link: _Link, data: bytes) -> bool:
        """Client -> server bookkeeping; returns whether to forward the chunk."""
        if link.owed is not None:
            return False  # the dropped command is complete: hold whatever the client sends next
        link.requests.feed(data)
        if link.swallowing:
            link.dropped += data
        elif self._mode is Mode.DROP_REPLY and self._matches(link, data):
            self._mode, self._pattern = Mode.PASS, None  # one shot
            link.swallowing = True  # before the chunk leaves: its reply cannot slip through
            link.dropped += link.tail + data
        link.tail = (link.tail + data)[-TAIL:]
        if link.swallowing and link.requests.at_boundary:
            link.owed = link.requests.count
            with self._lock:
                self._dropped_requests.append(bytes(link.dropped))
        return True

    def _inspect_reply(self, link: _Link, data: bytes) -> bool:
        """Server -> client bookkeeping; returns whether to forward the chunk."""
        link.replies.feed(data)
        if not link.swallowing:
            return True
        if link.owed is not None and link.replies.count >= link.owed:
            self._count("replies_dropped")
            self._close(link, reset=True)  # every command up to the dropped one ran; nobody is told
        return False

    def _matches(self, link: _Link, data: bytes) -> bool:
        pattern = self._pattern
        window = link.tail + data
        if isinstance(pattern, re.Pattern):
            return pattern.search(window) is not None
        return pattern is not None and pattern in window

    async def _deliver(
        self,
        link: _Link,
        queue: asyncio.Queue[tuple[float, bytes] | None],
        target: asyncio.StreamWriter,
        *,
        upstream: bool,
    ) -> None:
        loop = asyncio.get_running_loop()
        counter = "bytes_up" if upstream else "bytes_down"
        try:
            while True:
                item = await queue.get()
                if item is None:  # the source side closed: close both
                    if not link.stranded:
                        self._close(link, reset=False)
                    return
                due, data = item
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if link.stranded or link.closed:
                    continue
                target.write(data)
                await target.drain()
                self._count(counter, len(data))
        except (ConnectionError, OSError):
            self._close(link, reset=True)

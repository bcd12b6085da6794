"""The fault proxy itself, with redis-py through it against the real Redis on 127.0.0.1:6379.

Clients here are built with retries off: redis-py retries a command on a connection error by default,
which would hide the very fault a test injects (a dropped reply would be answered by the retry).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tests.faults.proxy import FaultProxy, Mode, RespCounter

pytestmark = pytest.mark.services

CHUNK_SIZE = 65_536

UPSTREAM = ("127.0.0.1", 6379)


@pytest.fixture
def proxy() -> Iterator[FaultProxy]:
    with FaultProxy(*UPSTREAM) as p:
        yield p


@pytest.fixture
def direct() -> Iterator[redis.Redis]:
    client = redis.Redis(*UPSTREAM, decode_responses=True)
    yield client
    client.close()


@pytest.fixture
def key(direct: redis.Redis) -> Iterator[str]:
    """A key of this test's own, deleted afterwards."""
    name = f"faultproxy:{uuid.uuid4().hex}"
    yield name
    direct.delete(name, *(f"{name}:{i}" for i in range(3)))


def through(proxy: FaultProxy, timeout_s: float = 2.0) -> redis.Redis:
    return redis.Redis(
        *proxy.address,
        decode_responses=True,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
    )


def raw(proxy: FaultProxy, timeout_s: float = 2.0) -> socket.socket:
    sock = socket.create_connection(proxy.address, timeout=timeout_s)
    sock.settimeout(timeout_s)
    return sock


def test_pass_forwards_both_ways_and_counts(proxy: FaultProxy, direct: redis.Redis, key: str) -> None:
    client = through(proxy)
    assert client.set(key, "v1")
    assert client.get(key) == "v1"
    assert direct.get(key) == "v1"  # it really reached the upstream
    stats = proxy.stats()
    assert stats.accepted == 1 and stats.open == 1
    assert stats.bytes_up > len(key) and stats.bytes_down > 0
    client.close()


def test_blackhole_times_out_old_and_new_connections_and_strands_them(
    proxy: FaultProxy, direct: redis.Redis, key: str
) -> None:
    client = through(proxy, timeout_s=0.3)
    assert client.ping()
    old = raw(proxy, timeout_s=0.3)
    old.sendall(b"PING\r\n")
    assert old.recv(64) == b"+PONG\r\n"
    # When the proxy blackholes
    proxy.blackhole()
    # Then an open connection hears nothing, and neither does a new one (accepted, never answered)
    with pytest.raises(redis.TimeoutError):
        client.ping()
    with pytest.raises(redis.TimeoutError):
        through(proxy, timeout_s=0.3).ping()
    old.sendall(f"SET {key} during-blackhole\r\n".encode())
    with pytest.raises(TimeoutError):
        old.recv(64)
    # And after the heal, connections made meanwhile stay dead, new ones pass, and nothing sent into the
    # blackhole ever reached the server
    proxy.set_pass()
    old.sendall(b"PING\r\n")
    with pytest.raises(TimeoutError):
        old.recv(64)
    assert through(proxy).ping()
    assert direct.get(key) is None
    assert proxy.stats().stranded >= 3
    old.close()
    client.close()


def test_reset_refuses_old_and_new_connections_with_rst(proxy: FaultProxy) -> None:
    client = through(proxy)
    assert client.ping()
    old = raw(proxy)
    old.sendall(b"PING\r\n")
    assert old.recv(64) == b"+PONG\r\n"
    proxy.reset()
    with pytest.raises(ConnectionResetError):  # an RST, not an orderly close (recv would return b"")
        old.recv(64)
    with pytest.raises(redis.ConnectionError):
        client.ping()
    with pytest.raises(redis.ConnectionError):
        through(proxy).ping()
    assert proxy.stats().resets >= 3
    proxy.set_pass()
    assert through(proxy).ping()
    old.close()
    client.close()


def test_delay_adds_latency_each_way_and_keeps_order(proxy: FaultProxy, key: str) -> None:
    client = through(proxy)
    assert client.ping()  # connected before the delay, so only the round trip is measured
    proxy.delay(150)
    started = time.monotonic()
    assert client.ping()
    # One request chunk and one reply chunk, each held 150 ms: a lower bound only, never an upper one
    assert time.monotonic() - started >= 0.3
    pipe = client.pipeline(transaction=False)
    for i in range(50):
        pipe.rpush(key, i)
    assert pipe.execute() == list(range(1, 51))
    assert client.lrange(key, 0, -1) == [str(i) for i in range(50)]
    client.close()


def test_drop_reply_after_runs_the_command_but_the_client_never_hears(
    proxy: FaultProxy, direct: redis.Redis, key: str
) -> None:
    client = through(proxy)
    assert client.ping()
    proxy.drop_reply_after(b"SET")
    with pytest.raises(redis.ConnectionError):
        client.set(key, "applied")
    assert direct.get(key) == "applied"  # the command ran upstream
    stats = proxy.stats()
    assert stats.replies_dropped == 1 and stats.resets == 1
    assert proxy.mode is Mode.PASS  # one shot
    assert client.set(key, "again")  # a new connection: nothing is dropped any more
    assert proxy.stats().replies_dropped == 1
    [dropped] = proxy.dropped_requests()
    assert b"SET" in dropped and b"applied" in dropped
    client.close()


def test_drop_reply_after_waits_for_the_answers_to_everything_up_to_the_match(
    proxy: FaultProxy, direct: redis.Redis, key: str
) -> None:
    # Given a pipeline far larger than one read (64 KiB) whose answers start to flow back before the
    # proxy has even read the matching command
    client = through(proxy)
    big = "x" * 300_000
    proxy.drop_reply_after(b"marker-after-a-big-value")
    pipe = client.pipeline(transaction=False)
    pipe.set(f"{key}:0", big)
    pipe.set(f"{key}:1", "marker-after-a-big-value")
    with pytest.raises(redis.ConnectionError):
        pipe.execute()
    # Then the reset came only once the server had answered the matching command too: both ran
    assert direct.strlen(f"{key}:0") == len(big)
    assert direct.get(f"{key}:1") == "marker-after-a-big-value"
    assert proxy.stats().replies_dropped == 1
    client.close()


class SlowSecondAnswer:
    """A stand-in upstream for one connection: answers the first command at once and the second only
    when told to, so a test can see whether the proxy resets before the answer it waits for."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.answer_second = threading.Event()
        self.commands = RespCounter()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        conn.settimeout(10)
        with conn:
            while self.commands.count < 2:
                self.commands.feed(conn.recv(CHUNK_SIZE))
            conn.sendall(b"+OK\r\n")
            self.answer_second.wait(10)
            with contextlib.suppress(OSError):
                conn.sendall(b"+OK\r\n")
                conn.recv(CHUNK_SIZE)  # until the proxy resets

    def close(self) -> None:
        self.answer_second.set()
        self.thread.join(10)
        self.listener.close()


def test_drop_reply_after_resets_only_after_the_matching_command_is_answered() -> None:
    upstream = SlowSecondAnswer()
    try:
        with FaultProxy("127.0.0.1", upstream.port) as proxy:
            client = raw(proxy, timeout_s=0.5)
            proxy.drop_reply_after(b"second")
            client.sendall(b"*1\r\n$5\r\nfirst\r\n*1\r\n$6\r\nsecond\r\n")  # pipelined
            # While only the first is answered, the connection stays up and the client hears nothing
            with pytest.raises(TimeoutError):
                client.recv(64)
            assert upstream.commands.count == 2 and proxy.stats().replies_dropped == 0
            # Once the second is answered, the answer is swallowed and the connection reset
            upstream.answer_second.set()
            with pytest.raises(ConnectionResetError):
                client.recv(64)
            assert proxy.stats().replies_dropped == 1
            client.close()
    finally:
        upstream.close()


def test_switching_modes_from_another_thread_under_traffic(proxy: FaultProxy, key: str) -> None:
    """Mode switches race with traffic on the proxy's loop; pass and delay must never corrupt a stream."""
    errors: list[BaseException] = []
    stop = threading.Event()

    def traffic(n: int) -> None:
        client = through(proxy, timeout_s=5)
        try:
            i = 0
            while not stop.is_set():
                assert client.set(f"{key}:{n}", str(i))
                assert client.get(f"{key}:{n}") == str(i)
                i += 1
        except BaseException as exc:
            errors.append(exc)
        finally:
            client.close()

    threads = [threading.Thread(target=traffic, args=(n,)) for n in range(3)]
    for thread in threads:
        thread.start()
    for i in range(40):
        if i % 2:
            proxy.delay(5)
        else:
            proxy.set_pass()
        time.sleep(0.01)
    stop.set()
    for thread in threads:
        thread.join(10)
    assert errors == []
    assert proxy.stats().bytes_up > 0


def test_stop_closes_every_socket_and_the_thread() -> None:
    proxy = FaultProxy(*UPSTREAM).start()
    client = raw(proxy)
    client.sendall(b"PING\r\n")
    assert client.recv(64) == b"+PONG\r\n"
    proxy.blackhole()
    stranded = raw(proxy)
    proxy.stop()
    with pytest.raises(ConnectionResetError):
        client.recv(64)
    with pytest.raises(ConnectionResetError):
        stranded.recv(64)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(proxy.address, timeout=1)
    assert not [t for t in threading.enumerate() if t.name.startswith("fault-proxy-")]
    client.close()
    stranded.close()
    with pytest.raises(RuntimeError):
        proxy.blackhole()  # a stopped proxy says so instead of silently doing nothing


def test_resp_counter_finds_value_boundaries_in_any_split() -> None:
    stream = (
        b"*3\r\n$5\r\nFCALL\r\n$1\r\nf\r\n$-1\r\n"  # an array whose last element is a null bulk
        b"+OK\r\n:42\r\n-ERR no\r\n*0\r\n*-1\r\n"
        b"*2\r\n*2\r\n:1\r\n$2\r\n\r\n\r\n:7\r\n"  # nested, with a blob that holds a CRLF
        b"%1\r\n+k\r\n$1\r\nv\r\n"  # a RESP3 map
        b"PING\r\n"  # an inline command
    )
    expected = 9
    whole = RespCounter()
    whole.feed(stream)
    assert (whole.count, whole.at_boundary) == (expected, True)
    for size in (1, 2, 3, 7):
        pieces = RespCounter()
        for i in range(0, len(stream), size):
            pieces.feed(stream[i : i + size])
        assert (pieces.count, pieces.at_boundary) == (expected, True), size
    partial = RespCounter()
    partial.feed(stream[:-3])
    assert (partial.count, partial.at_boundary) == (expected - 1, False)

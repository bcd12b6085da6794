"""Connections to RabbitMQ: to one node, or to any live node of a cluster.

``SAGA_AMQP_URL`` may name several nodes, comma-separated, either as whole URLs
(``amqp://u:p@h1:5672/v,amqp://u:p@h2:5672/v``) or as several hosts in one URL
(``amqp://u:p@h1:5672,h2:5673/v``: the credentials, virtual host and options apply to every node).

A long-lived process holds a :class:`FailoverConnection`: aio-pika's robust connection, which restores its
channels, queues and consumers after a reconnect, but which always dials the same URL. Ours moves to the
next node each time the connection closes or an attempt fails, so losing the node it was on costs one
reconnect interval, not an outage until that node returns. Short-lived commands use :func:`connect_once`,
which tries each node in turn."""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import Sequence
from typing import Any

import aio_pika
import aio_pika.abc
import pika
from aio_pika.exceptions import CONNECTION_EXCEPTIONS
from aiormq.exceptions import AMQPConnectionError, ChannelInvalidStateError
from yarl import URL

_SCHEMES = ("amqp://", "amqps://")
# the credentials run to the last '@' before the path: a password may hold an '@' of its own
_SCHEME = re.compile(r"^(amqps?://)([^/]*@)?([^/?]*)(.*)$")
_ENCODE = "percent-encode ',' and '@' in a password (%2C, %40)"
_HOST = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[\w.-]+)(:\d+)?$")

#: Seconds between attempts after a connection is lost (aio-pika's default is 5): with several nodes the
#: next attempt goes to another node, so there is no reason to wait long.
RECONNECT_INTERVAL_S = 1


class NoBrokerReachable(AMQPConnectionError):
    """None of the several nodes of ``SAGA_AMQP_URL`` accepted a connection (with one node, that node's
    own error is raised, so the broker's words, such as an unknown vhost, reach the user)."""

    def __str__(self) -> str:
        return str(self.args[0])


def node_urls(spec: str) -> list[str]:
    """The URL of every node in ``spec``, in order. One node: ``[spec]`` unchanged.

    Raises ValueError for a spec that names no node, has an empty entry or mixes forms."""
    parts = [part.strip() for part in spec.split(",")]
    if not any(parts):
        raise ValueError("SAGA_AMQP_URL is empty: give amqp://user:password@host:port/vhost")
    if "" in parts:
        raise ValueError(f"SAGA_AMQP_URL {redacted(spec)!r} has an empty entry between commas")
    whole = [part.startswith(_SCHEMES) for part in parts]
    if not whole[0]:
        raise ValueError(f"SAGA_AMQP_URL must start with amqp:// or amqps://, got {redacted(parts[0])!r}")
    if all(whole):
        return parts
    if any(whole[1:]):
        raise ValueError(
            f"SAGA_AMQP_URL {redacted(spec)!r}: list whole URLs or the hosts of one URL, not a mix "
            f"({_ENCODE})"
        )
    # "amqp://u:p@h1:5672,h2:5673/v": the scheme and credentials come before the first host, the path and
    # options after the last one.
    match = _SCHEME.match(",".join(parts))
    assert match is not None  # the first entry starts with a scheme
    scheme, credentials, hosts, rest = match.groups()
    for host in hosts.split(","):
        if not _HOST.match(host):
            raise ValueError(f"SAGA_AMQP_URL {redacted(spec)!r}: {host!r} is not a host[:port] ({_ENCODE})")
    return [f"{scheme}{credentials or ''}{host}{rest}" for host in hosts.split(",")]


def redacted(spec: str) -> str:
    """``spec`` with every password replaced by ``***`` (and no options), for messages and logs."""
    return re.sub(r"://([^:@/]*):[^/]*@", r"://\1:***@", re.sub(r"\?[^,]*", "", spec))


def with_options(url: str, **options: object) -> str:
    """``url`` with query options added where it does not already set them (it wins)."""
    parsed = URL(url)
    merged = {key: str(value) for key, value in options.items()}
    merged.update(parsed.query)
    return str(parsed.with_query(merged))


class FailoverConnection(aio_pika.RobustConnection):
    """A robust connection that moves round ``nodes`` each time its connection closes or an attempt
    fails (aio-pika calls the close hook for both)."""

    def __init__(self, url: URL, *, nodes: Sequence[str] = (), **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        self._nodes = [URL(node) for node in nodes] or [self.url]
        self._current = next((i for i, node in enumerate(self._nodes) if node == self.url), 0)

    async def _on_connection_close(self, closing: asyncio.Future[Any]) -> None:
        self._current = (self._current + 1) % len(self._nodes)
        self.url = self._nodes[self._current]
        await super()._on_connection_close(closing)


async def connect_robust(
    spec: str, *, heartbeat_s: int | None = None, timeout_s: float = 10
) -> aio_pika.abc.AbstractRobustConnection:
    """A connection that reconnects (to another node where there are several) for a long-lived process.

    The first connection tries every node in turn, from a random one, so that a cluster's processes spread
    their connections over its nodes; raises :class:`NoBrokerReachable` when none answers."""
    options: dict[str, object] = {"reconnect_interval": RECONNECT_INTERVAL_S}
    if heartbeat_s is not None:
        options["heartbeat"] = heartbeat_s
    nodes = [with_options(url, **options) for url in node_urls(spec)]
    first = random.randrange(len(nodes))
    nodes = nodes[first:] + nodes[:first]
    failures: list[BaseException] = []
    for url in nodes:
        connection = FailoverConnection(URL(url), nodes=nodes)
        try:
            await connection.connect(timeout_s)
        except CONNECTION_EXCEPTIONS as exc:
            await connection.close()
            failures.append(exc)
            continue
        return connection
    raise _unreachable(nodes, failures)


async def connect_once(spec: str, *, timeout_s: float = 10) -> aio_pika.abc.AbstractConnection:
    """A plain connection to the first node of ``spec`` that answers, for a short-lived command."""
    nodes = node_urls(spec)
    failures: list[BaseException] = []
    for url in nodes:
        try:
            return await aio_pika.connect(url, timeout=timeout_s)
        except CONNECTION_EXCEPTIONS as exc:
            failures.append(exc)
    raise _unreachable(nodes, failures)


async def untracked_channel(
    connection: aio_pika.abc.AbstractConnection, wait_s: float = 5.0
) -> aio_pika.abc.AbstractChannel:
    """A confirm-mode channel (unroutable mandatory messages raise) that a robust connection does not
    track, so it is never reopened behind its owner's back.

    aio-pika reopens every channel it tracks after a reconnect, with its consumers, even one its owner
    closed (its restore clears the closed state). A loop that opens channels of its own after trouble
    would then have a second consumer on a channel nobody reads; on a single-active-consumer queue that
    one may be the consumer that gets every delivery. Raises ChannelInvalidStateError while the
    connection is down (after waiting up to ``wait_s`` for it to come back)."""
    connected: asyncio.Event | None = getattr(connection, "connected", None)
    try:
        if connected is not None:
            await asyncio.wait_for(connected.wait(), wait_s)
        channel = aio_pika.Channel(connection, publisher_confirms=True, on_return_raises=True)
        await channel.initialize()
    except (RuntimeError, TimeoutError) as exc:  # aio-pika's "connection closed" is a RuntimeError
        raise ChannelInvalidStateError(f"no open connection to RabbitMQ to open a channel on: {exc}") from exc
    return channel


def blocking_parameters(spec: str) -> list[pika.URLParameters]:
    """pika's parameters for every node; ``pika.BlockingConnection`` tries them in order."""
    return [pika.URLParameters(url) for url in node_urls(spec)]


def _unreachable(nodes: list[str], failures: list[BaseException]) -> BaseException:
    if len(failures) == 1:
        return failures[0]
    reasons = "; ".join(
        f"{redacted(url)}: {exc or type(exc).__name__}" for url, exc in zip(nodes, failures, strict=True)
    )
    return NoBrokerReachable(
        f"no RabbitMQ node could be connected to ({reasons}): start RabbitMQ or fix SAGA_AMQP_URL "
        "(nodes comma-separated)"
    )

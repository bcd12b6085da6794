"""Dead letters: list, show, replay and purge what the broker dead-lettered and what saga refused.

Where they are:

* ``<queue>.dlq`` (DESIGN section 4): the broker moves a message there from a shard or task queue when it is
  rejected without requeue or goes over the queue's delivery limit; its ``x-death`` header says from which
  queue and why.
* ``saga.rejected``: messages an orchestrator or a worker refused before any write (forged, malformed,
  oversized). ``Publisher.reject`` records ``x-saga-reason``, ``x-saga-detail`` and ``x-saga-source``, the
  queue the message was refused on.

Reading without consuming: AMQP 0-9-1 has no peek. We ``basic.get`` without acking, then close the channel,
which hands every unacked message back to the head of its queue in its order (a crash of this process does
the same). On a quorum queue each hand-back counts as a delivery (``x-delivery-count`` goes up), and a queue
with an ``x-delivery-limit`` would dead-letter a message inspected often enough (or drop it, having no
dead-letter exchange of its own). So only ``.dlq`` queues and ``saga.rejected`` are ever read here: the
topology declares them with no delivery limit and no dead-letter exchange (``bus/topology.py``,
``_plain``), so reading them cannot push a message anywhere. Live shard and task queues are refused: reading
them would also take deliveries away from their consumers. At most the messages ready when a read starts are
read, so a queue that keeps filling cannot keep a read going.

Replaying publishes a copy back to the queue the message came from, each envelope in it issued again under
this process's signing key (``bus/reissue.py``: a shard refuses what was issued too long ago), on a
confirm channel with ``mandatory``
(an unroutable copy comes back as an error instead of vanishing), and acks the dead-letter copy only after
the broker confirmed the new one: a failure at any point leaves the message where it was. A crash between
the confirm and the ack leaves it in both places; message ids are deterministic, so its consumer recognises
the second copy as a duplicate.

Purging deletes every ready message of a namespace's dead-letter queues for good (``queue.purge`` on a
passive declare): for letters a human decided are not worth replaying. Only dead-letter queues are ever
purged, by the same guard as reading; messages another reader holds unacked at that moment are not ready,
so they stay.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import re
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import aio_pika
import aiormq
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage, AbstractQueue
from pamqp import commands as spec

from orchestrator.bus import batch
from orchestrator.bus.names import DLQ_SUFFIX, Names
from orchestrator.bus.reissue import Reissue, reissued
from orchestrator.bus.topology import Topology
from orchestrator.errors import SagaError
from orchestrator.keys.reload import data_key, signer_for
from orchestrator.redaction import Redactor, letter_secrets
from orchestrator.settings import Settings, redis_client
from orchestrator.store.redis_store import PlanNotFound, RedisStore
from orchestrator.wire.bodies import DEFAULT_TENANT

#: Headers ``Publisher.reject`` sets on a message it parks on saga.rejected.
REASON_HEADER = "x-saga-reason"
DETAIL_HEADER = "x-saga-detail"
SOURCE_HEADER = "x-saga-source"
#: Set on a replayed copy: where it was replayed from, for whoever finds it dead-lettered again.
REPLAYED_FROM_HEADER = "x-saga-replayed-from"
#: The broker's dead-letter bookkeeping and our refusal headers describe the dead copy, not the replayed one;
#: the broker writes fresh ones if the copy dies again.
_DEATH_HEADERS = frozenset(
    {
        "x-death",
        "x-first-death-exchange",
        "x-first-death-queue",
        "x-first-death-reason",
        "x-last-death-exchange",
        "x-last-death-queue",
        "x-last-death-reason",
        "x-delivery-count",
        REASON_HEADER,
        DETAIL_HEADER,
        SOURCE_HEADER,
    }
)
GET_TIMEOUT_S = 10.0
CONFIRM_TIMEOUT_S = 30.0


class DeadLetterError(SagaError):
    """Raised when a dead-letter command cannot do what it was asked; names the ids and what to do."""

    code = "dead_letter_error"


class NotADeadLetterQueue(DeadLetterError):
    """Raised when asked to read a queue that is neither a ``<queue>.dlq`` nor saga.rejected."""

    code = "not_a_dead_letter_queue"
    id_fields = ("queue",)

    def __init__(self, queue: str, names: Names) -> None:
        self.queue = queue
        super().__init__(
            f"queue {queue!r} is not a dead-letter queue of namespace {names.namespace!r}: reading a live "
            "queue would take deliveries from its consumers and spend their delivery limit; name a "
            f"'{names.namespace}.<queue>{DLQ_SUFFIX}' queue or {names.rejected_queue} ('saga dead-letters "
            "list' shows them all; SAGA_NAMESPACE picks the namespace)"
        )


class QueueNotFound(DeadLetterError):
    """Raised when a dead-letter queue asked for does not exist on the broker's vhost."""

    code = "queue_not_found"
    id_fields = ("queue",)

    def __init__(self, queue: str) -> None:
        self.queue = queue
        super().__init__(
            f"queue {queue!r} does not exist on this vhost: check the name and SAGA_AMQP_URL, or run "
            "'saga topology apply'"
        )


class MessageNotFound(DeadLetterError):
    """Raised when no message with the id is on any of the queues searched."""

    code = "message_not_found"
    id_fields = ("message_id",)

    def __init__(self, message_id: str, queues: list[str]) -> None:
        self.message_id = message_id
        self.queues = queues
        where = queues[0] if len(queues) == 1 else f"any of {len(queues)} dead-letter queues"
        super().__init__(
            f"message {message_id!r} is not on {where}: 'saga dead-letters list' shows the ids there are"
        )


class NotReplayable(DeadLetterError):
    """Raised when nothing on a dead letter says which queue it belongs back on."""

    code = "not_replayable"
    id_fields = ("message_id", "queue")

    def __init__(self, message_id: str, queue: str, why: str) -> None:
        self.message_id = message_id
        self.queue = queue
        super().__init__(f"message {message_id!r} on {queue} cannot be replayed: {why}; it stays on {queue}")


# ---- the pure part -------------------------------------------------------------------------------------


REJECTED_SUFFIX = ".rejected"


def is_dead_letter_queue(queue: str) -> bool:
    """A ``.dlq`` queue or a namespace's rejected queue, in any namespace: what may be read safely."""
    return queue.endswith((DLQ_SUFFIX, REJECTED_SUFFIX))


#: What AMQP 0-9-1 accepts as a queue name (at most 255 bytes of these): anything else the client
#: library refuses before it reaches the broker.
QUEUE_NAME = re.compile(r"[A-Za-z0-9_.:@#,/ -]{1,255}")


def require_dead_letter_queue(queue: str, names: Names) -> str:
    if not QUEUE_NAME.fullmatch(queue) or not names.is_dead_letter_queue(queue):
        raise NotADeadLetterQueue(queue, names)
    return queue


def dead_letter_queues(topology: Topology, names: Names) -> list[str]:
    """Every ``.dlq`` queue of the topology in the namespace, then the namespace's rejected queue."""
    dlqs = [q.name for q in topology.queues if names.is_dead_letter_queue(q.name)]
    return [*(q for q in dlqs if q != names.rejected_queue), names.rejected_queue]


@dataclass(frozen=True)
class DeadLetter:
    """One message on a dead-letter queue, as ``list`` shows it.

    ``message_id`` is the envelope's id when the body is one (saga.rejected copies lose the AMQP property,
    which the client library then fills with a random id: ``amqp_message_id``), else the AMQP id, else a
    digest of the body. ``reason`` is the broker's (``rejected``, ``delivery_limit``, ...; ``death_count``
    times) or saga's refusal reason with its ``detail``. ``origin`` is the queue it belongs back on, if
    known. ``delivery_count`` counts how often it was handed back to its dead-letter queue (inspections)."""

    queue: str
    message_id: str
    amqp_message_id: str | None
    kind: str | None
    run_id: str | None
    stage: str | None
    reason: str
    detail: str | None
    death_count: int | None
    origin: str | None
    delivery_count: int
    tenant: str | None = None  # the envelope's, as its body claims it (None: no envelope)

    def summary(self) -> dict[str, Any]:
        return {
            "message_id": self.message_id,
            "amqp_message_id": self.amqp_message_id,
            "kind": self.kind,
            "run_id": self.run_id,
            "stage": self.stage,
            "reason": self.reason,
            "detail": self.detail,
            "death_count": self.death_count,
            "origin": self.origin,
            "delivery_count": self.delivery_count,
            "tenant": self.tenant,
        }

    def matches(self, message_id: str) -> bool:
        return message_id in (self.message_id, self.amqp_message_id)


@dataclass(frozen=True)
class Detail:
    """A dead letter with everything ``show`` prints: its properties, headers and body."""

    letter: DeadLetter
    properties: dict[str, Any]
    headers: dict[str, Any]
    body: bytes = field(repr=False)

    def document(self) -> dict[str, Any]:
        return {
            "queue": self.letter.queue,
            **self.letter.summary(),
            "properties": self.properties,
            "headers": self.headers,
            **body_document(self.body),
        }


def _text(value: object) -> str | None:
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if value is None:
        return None
    return str(value)


def _envelope_fields(body: bytes) -> Mapping[str, Any]:
    """The body as a JSON object if it is one; saga bodies are envelopes. Never raises: anything can be
    dead-lettered, garbage included."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _field(fields: Mapping[str, Any], name: str) -> str | None:
    value = fields.get(name)
    return value if isinstance(value, str) and value else None


def _last_death(headers: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The newest ``x-death`` entry: the broker keeps the list most recent first."""
    deaths = headers.get("x-death")
    if isinstance(deaths, list | tuple) and deaths and isinstance(deaths[0], Mapping):
        return deaths[0]
    return None


def _why(headers: Mapping[str, Any]) -> tuple[str, str | None, int | None, str | None]:
    """(reason, detail, death count, origin queue) from the broker's or saga's headers."""
    death = _last_death(headers)
    if death is not None:
        count = death.get("count")
        return (
            _text(death.get("reason")) or "unknown",
            None,
            count if isinstance(count, int) else None,
            _text(death.get("queue")) or None,
        )
    if REASON_HEADER in headers:
        return (
            _text(headers.get(REASON_HEADER)) or "unknown",
            _text(headers.get(DETAIL_HEADER)),
            None,
            _text(headers.get(SOURCE_HEADER)) or None,
        )
    return "unknown", None, None, None


def describe(
    queue: str, headers: Mapping[str, Any] | None, amqp_message_id: str | None, body: bytes
) -> DeadLetter:
    """What a dead letter is, where it came from and why: pure and total (it never raises)."""
    headers = headers or {}
    fields = _envelope_fields(body)
    reason, detail, death_count, origin = _why(headers)
    delivery_count = headers.get("x-delivery-count")
    message_id = (
        _field(fields, "message_id") or amqp_message_id or f"sha256:{hashlib.sha256(body).hexdigest()[:32]}"
    )
    return DeadLetter(
        queue=queue,
        message_id=message_id,
        amqp_message_id=amqp_message_id,
        kind=_field(fields, "kind"),
        run_id=_field(fields, "run_id"),
        stage=_field(fields, "stage"),
        reason=reason,
        detail=detail,
        death_count=death_count,
        origin=origin,
        delivery_count=delivery_count if isinstance(delivery_count, int) else 0,
        tenant=_field(fields, "tenant") or (DEFAULT_TENANT if fields else None),
    )


async def redacted(details: list[Detail], settings: Settings) -> list[Detail]:
    """``details`` with the sensitive values they carry marked (``orchestrator/redaction.py``), by the
    schemas of the plan each message names: what ``show`` prints. A container's messages are shown
    unpacked (a JSON list), each marked; its headers and refusal detail are marked too. A message whose
    plan is gone is shown as it is."""
    client = redis_client(settings)
    store = RedisStore(client, settings.key_prefix)
    key = data_key(settings)
    try:
        shown = []
        for detail in details:
            parts = _parts(detail, settings.max_message_bytes)
            secrets: list[Any] = []
            for fields in parts:
                secrets += await _secrets_of(store, fields)
            if not secrets:
                shown.append(detail)
                continue
            redactor = Redactor.of(secrets, key)
            body = [redactor.scrub(dict(f)) for f in parts]
            text = json.dumps(body if batch.is_container(detail.headers) else body[0], ensure_ascii=False)
            letter = dataclasses.replace(detail.letter, detail=redactor.scrub(detail.letter.detail))
            shown.append(
                dataclasses.replace(
                    detail, letter=letter, headers=redactor.scrub(detail.headers), body=text.encode()
                )
            )
        return shown
    finally:
        await client.aclose()


def _parts(detail: Detail, max_bytes: int) -> list[Mapping[str, Any]]:
    """The envelopes' fields a letter holds: a container's, each; else its own."""
    if not batch.is_container(detail.headers):
        return [_envelope_fields(detail.body)]
    try:
        return [_envelope_fields(raw) for raw in batch.unpack(detail.body, detail.headers, max_bytes)]
    except SagaError:  # a malformed container: shown as it came, as it holds no readable envelope
        return [{}]


async def _secrets_of(store: RedisStore, fields: Mapping[str, Any]) -> list[Any]:
    body = fields.get("body")
    digest = fields.get("digest") or (body.get("digest") if isinstance(body, Mapping) else None)
    if not isinstance(digest, str) or not digest:
        return []
    try:
        return letter_secrets(fields, await store.plan(digest))
    except PlanNotFound:
        return []


def replay_reissue(settings: Settings, message_id: str | None) -> Reissue | None:
    """How this process issues the letters of a replay again: with its signing key, as of now. Only a
    letter an operator names (``message_id``); None for a replay of every letter, which sends each as it
    was: where a letter came from is an unsigned header, so anyone who can publish to the broker could
    park a captured old message there."""
    if message_id is None:
        return None
    return Reissue(signer_for(settings), int(time.time() * 1000), settings.max_message_bytes)


def replay_target(letter: DeadLetter) -> str:
    """The queue a dead letter goes back to; raises :class:`NotReplayable` when nothing says which."""
    if letter.origin is None:
        if letter.queue.endswith(REJECTED_SUFFIX):
            why = (
                f"its {SOURCE_HEADER} header is missing or empty, so nothing records the queue it was "
                "refused on; publish it yourself if you know where it belongs"
            )
        else:
            why = "it has no x-death header naming the queue it was dead-lettered from"
        raise NotReplayable(letter.message_id, letter.queue, why)
    if is_dead_letter_queue(letter.origin):
        raise NotReplayable(
            letter.message_id, letter.queue, f"it came from {letter.origin}, itself a dead-letter queue"
        )
    return letter.origin


def replay_headers(headers: Mapping[str, Any] | None, queue: str) -> dict[str, Any]:
    kept = {k: v for k, v in (headers or {}).items() if k not in _DEATH_HEADERS}
    return {**kept, REPLAYED_FROM_HEADER: queue}


def jsonable(value: Any) -> Any:
    """A header value as JSON: AMQP tables hold timestamps, bytes and decimals too."""
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return "base64:" + base64.b64encode(value).decode()
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def body_document(body: bytes) -> dict[str, Any]:
    """The body for JSON output: the decoded JSON value, or base64 when it is not JSON."""
    try:
        return {"body_format": "json", "body": json.loads(body)}
    except (ValueError, UnicodeDecodeError):
        return {"body_format": "base64", "body": base64.b64encode(body).decode()}


def printable(text: str, *, keep_newlines: bool = True) -> str:
    """``text`` with every control or format character escaped, so that a hostile message on
    saga.rejected cannot drive the terminal that shows it."""
    keep = "\n\t" if keep_newlines else ""
    return "".join(c if c.isprintable() or c in keep else repr(c)[1:-1] for c in text)


def render_body(body: bytes) -> str:
    """Pretty JSON when the body is JSON, else the bytes with escapes, either way safe to print."""
    try:
        return printable(json.dumps(json.loads(body), indent=2, sort_keys=True, ensure_ascii=False))
    except (ValueError, UnicodeDecodeError):
        return f"({len(body)} bytes, not JSON; shown with escapes)\n" + printable(
            body.decode("utf-8", errors="backslashreplace")
        )


# ---- the broker part -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class QueueListing:
    queue: str
    exists: bool
    count: int  # ready messages when the read started
    letters: tuple[DeadLetter, ...]  # the first ``limit`` of them


@dataclass(frozen=True)
class Purged:
    queue: str
    exists: bool
    removed: int  # messages deleted


@dataclass(frozen=True)
class Replayed:
    letter: DeadLetter
    target: str | None
    error: str | None  # None: the copy is confirmed on target and the dead letter is gone
    # issued again (bus/reissue.py); False: sent as it was, as it does not verify with this process's key
    # ring or reports an attempt's liveness (a shard may refuse it again); None: not asked (--all)
    reissued: bool | None = None


_PROPERTIES = (
    "content_type",
    "content_encoding",
    "correlation_id",
    "type",
    "app_id",
    "timestamp",
    "reply_to",
)


def _properties(message: AbstractIncomingMessage) -> dict[str, Any]:
    found = {name: getattr(message, name, None) for name in ("message_id", *_PROPERTIES)}
    found["delivery_mode"] = int(message.delivery_mode) if message.delivery_mode else None
    found["expiration"] = message.expiration
    return {k: jsonable(v) for k, v in found.items() if v is not None}


def _letter(queue: str, message: AbstractIncomingMessage) -> DeadLetter:
    return describe(queue, message.headers, message.message_id, message.body)


@asynccontextmanager
async def _borrowed(connection: aio_pika.abc.AbstractConnection, queue: str) -> AsyncIterator[_Reading]:
    """A channel on ``queue``; closing it on the way out hands every message read and not acked back to
    the head of the queue, in order."""
    if not is_dead_letter_queue(queue):  # the callers check the namespace too; this is the last guard
        raise NotADeadLetterQueue(queue, Names())
    channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
    try:
        try:
            declared = await channel.declare_queue(queue, passive=True)
        except aiormq.exceptions.ChannelNotFoundEntity as exc:
            raise QueueNotFound(queue) from exc
        ready = declared.declaration_result.message_count or 0
        yield _Reading(queue, channel, declared, ready)
    finally:
        if not channel.is_closed:
            await channel.close()


@dataclass(frozen=True)
class _Reading:
    queue: str
    channel: AbstractChannel
    amqp_queue: AbstractQueue
    ready: int

    async def messages(self, limit: int | None = None) -> AsyncIterator[AbstractIncomingMessage]:
        """At most the messages that were ready when the read started (or ``limit``), oldest first."""
        for _ in range(self.ready if limit is None else min(limit, self.ready)):
            message = await self.amqp_queue.get(no_ack=False, fail=False, timeout=GET_TIMEOUT_S)
            if message is None:
                return
            yield message


async def list_queue(connection: aio_pika.abc.AbstractConnection, queue: str, limit: int) -> QueueListing:
    async with _borrowed(connection, queue) as reading:
        letters = [_letter(queue, m) async for m in reading.messages(limit)]
        return QueueListing(queue, True, reading.ready, tuple(letters))


async def list_queues(
    connection: aio_pika.abc.AbstractConnection, queues: Iterable[str], limit: int, *, missing_ok: bool
) -> list[QueueListing]:
    """Each queue's count and first ``limit`` messages; with ``missing_ok`` an absent queue is listed as
    such (a topology not applied yet) instead of raising :class:`QueueNotFound`."""
    found = []
    for queue in queues:
        try:
            found.append(await list_queue(connection, queue, limit))
        except QueueNotFound:
            if not missing_ok:
                raise
            found.append(QueueListing(queue, False, 0, ()))
    return found


async def show(
    connection: aio_pika.abc.AbstractConnection, queues: list[str], message_id: str, *, missing_ok: bool
) -> list[Detail]:
    """Every copy of ``message_id`` on ``queues``, with headers and body; raises :class:`MessageNotFound`."""
    found: list[Detail] = []
    for queue in queues:
        try:
            async with _borrowed(connection, queue) as reading:
                async for message in reading.messages():
                    letter = _letter(queue, message)
                    if letter.matches(message_id):
                        headers = jsonable(dict(message.headers or {}))
                        found.append(Detail(letter, _properties(message), headers, message.body))
        except QueueNotFound:
            if not missing_ok:
                raise
    if not found:
        raise MessageNotFound(message_id, queues)
    return found


def _replay_copy(
    message: AbstractIncomingMessage, letter: DeadLetter, reissue: Reissue | None
) -> tuple[aio_pika.Message, bool | None]:
    """The copy to publish, and whether it was issued again (None: not asked)."""
    # The body issued again (bus/reissue.py: a shard refuses what was issued too long ago) and the
    # envelope's id as message id, which a saga.rejected copy had lost. No expiration (it could expire
    # again on the way) and no user_id (the broker refuses one that is not the publishing user).
    headers = replay_headers(message.headers, letter.queue)
    body, again = message.body, None
    if reissue is not None:
        body, headers, again = reissued(body, headers, reissue)
    was_container = batch.is_container(message.headers)
    copy = aio_pika.Message(
        body,
        headers=headers,
        message_id=letter.message_id,
        content_type=message.content_type
        if batch.is_container(headers) == was_container
        else "application/json",  # a container of one went back as its one message
        content_encoding=message.content_encoding,
        correlation_id=message.correlation_id,
        type=message.type,
        app_id=message.app_id,
        timestamp=message.timestamp,
        reply_to=message.reply_to,
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
    )
    return copy, again


async def _replay_one(
    reading: _Reading, message: AbstractIncomingMessage, reissue: Reissue | None
) -> Replayed:
    letter = _letter(reading.queue, message)
    try:
        target = replay_target(letter)
    except NotReplayable as exc:
        return Replayed(letter, None, str(exc))
    copy, again = _replay_copy(message, letter, reissue)
    try:
        # The default exchange routes by queue name: the copy goes to exactly the queue it came from, and
        # mandatory turns a queue that no longer exists into an error rather than a silent drop.
        confirmation = await reading.channel.default_exchange.publish(
            copy,
            routing_key=target,
            mandatory=True,
            timeout=CONFIRM_TIMEOUT_S,
        )
    except (aiormq.exceptions.AMQPError, TimeoutError) as exc:
        return Replayed(letter, target, f"{target} did not take it ({type(exc).__name__}: {exc})")
    if not isinstance(confirmation, spec.Basic.Ack):
        return Replayed(letter, target, f"{target} did not confirm it ({confirmation!r})")
    await message.ack()  # only now: the copy on target is the broker's responsibility
    return Replayed(letter, target, None, again)


async def replay(
    connection: aio_pika.abc.AbstractConnection,
    queues: list[str],
    message_id: str | None,
    reissue: Reissue | None,
    *,
    missing_ok: bool,
) -> list[Replayed]:
    """Replay every copy of ``message_id`` (``None``: every message) found on ``queues``, each issued again
    by ``reissue``'s signer when given (a copy that does not verify goes back as it was).

    Raises :class:`MessageNotFound` when an id was given and is on none of them. A message that cannot be
    replayed is reported in its :class:`Replayed` and stays where it is."""
    done: list[Replayed] = []
    for queue in queues:
        try:
            async with _borrowed(connection, queue) as reading:
                async for message in reading.messages():
                    if message_id is None or _letter(queue, message).matches(message_id):
                        done.append(await _replay_one(reading, message, reissue))
        except QueueNotFound:
            if not missing_ok:
                raise
    if message_id is not None and not done:
        raise MessageNotFound(message_id, queues)
    return done


async def purge(
    connection: aio_pika.abc.AbstractConnection,
    queues: Iterable[str],
    *,
    missing_ok: bool,
    on_purged: Callable[[Purged], None] | None = None,
) -> list[Purged]:
    """Delete every ready message on each of ``queues`` (dead-letter queues only); with ``missing_ok`` an
    absent queue is reported as such instead of raising :class:`QueueNotFound`. ``on_purged`` hears of
    each queue as soon as it is purged, so what went is known even when a later queue fails."""
    done = []
    for queue in queues:
        try:
            async with _borrowed(connection, queue) as reading:
                result = await reading.amqp_queue.purge(timeout=CONFIRM_TIMEOUT_S)
                done.append(Purged(queue, True, result.message_count or 0))
        except QueueNotFound:
            if not missing_ok:
                raise
            done.append(Purged(queue, False, 0))
        if on_purged is not None:
            on_purged(done[-1])
    return done

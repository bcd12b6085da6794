"""Containers: several signed messages in one AMQP message (a worker's reports of one event-loop turn for
one shard; an orchestrator's tasks for one contract queue), so the broker confirms, stores and delivers
one message instead of many.

The body is the concatenation of frames, each a 4-byte big-endian length and that many bytes of payload;
every payload is exactly the bytes of one signed envelope as it would travel alone, with its own message
id, fence and signature. Two headers mark and guard it: ``x-saga-batch`` (how many frames) and
``x-saga-batch-crc32`` (a CRC-32 of the body). A message without ``x-saga-batch`` is one envelope: a
batch of one is sent as a plain message, byte for byte what it would be without batching.

:func:`unpack` refuses with :class:`EnvelopeRejected` (reason ``malformed-batch``, or ``oversized``) a
container that is not exactly its frames: a bad or missing header, a checksum that disagrees, a frame cut
short, a zero length, no frame at all, or another number of frames than the header says. The count and the
checksum together mean a container cut short, lengthened, or changed in any 4 consecutive bytes (any one
length field) is refused whole, never split differently in silence. Only the framing is checked here: each
payload is then decoded and verified on its own (``envelope.decode``).

Pure: no I/O.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from orchestrator.bus.envelope import EnvelopeRejected

BATCH_HEADER = "x-saga-batch"
CHECKSUM_HEADER = "x-saga-batch-crc32"
HEADERS = (BATCH_HEADER, CHECKSUM_HEADER)  # what makes a message a container, kept when one is parked
CONTENT_TYPE = "application/vnd.saga.batch"
FRAME_BYTES = 4  # each payload's length prefix
MAX_PAYLOAD_BYTES = 2**32 - 1  # what 4 bytes can say
REASON = "malformed-batch"
# Tasks for one contract queue an orchestrator packs into one container by default (``SAGA_PACK_TASKS``),
# and at most: a worker acks a container once each of its tasks has reported or been sent back alone.
DEFAULT_PACK_TASKS = 16
MAX_PACKED_TASKS = 100


@dataclass(frozen=True)
class Container:
    """What to publish for several payloads: body, headers and a message id of its own."""

    body: bytes
    headers: dict[str, int]
    message_id: str


def framed_bytes(payload_bytes: int) -> int:
    """What a payload of ``payload_bytes`` adds to a container's body."""
    return FRAME_BYTES + payload_bytes


def container_id(first_id: str, count: int) -> str:
    """The container's message id: its first payload's, and how many follow (logs and traces use message
    ids; the payloads keep their own)."""
    return f"batch-{first_id}+{count - 1}"


def pack(payloads: Sequence[bytes], first_id: str) -> Container:
    """The container of ``payloads`` (at least two: a single payload goes as a plain message)."""
    if len(payloads) < 2:
        raise ValueError(f"a container holds at least two payloads, not {len(payloads)}")
    for payload in payloads:
        if not 0 < len(payload) <= MAX_PAYLOAD_BYTES:
            raise ValueError(f"a payload of {len(payload)} bytes cannot be framed")
    body = b"".join(len(p).to_bytes(FRAME_BYTES, "big") + p for p in payloads)
    headers = {BATCH_HEADER: len(payloads), CHECKSUM_HEADER: zlib.crc32(body)}
    return Container(body, headers, container_id(first_id, len(payloads)))


def is_container(headers: Mapping[str, Any] | None) -> bool:
    """Whether a message with these AMQP headers is a container (else it is one envelope)."""
    return headers is not None and BATCH_HEADER in headers


def unpack(body: bytes, headers: Mapping[str, Any], max_bytes: int) -> list[bytes]:
    """The payloads of a container, in order; raises :class:`EnvelopeRejected` for a malformed one."""
    if len(body) > max_bytes:
        raise EnvelopeRejected(
            "oversized", f"a container of {len(body)} bytes, over the {max_bytes}-byte limit"
        )
    count = _header(headers, BATCH_HEADER)
    if count < 1:
        raise EnvelopeRejected(REASON, f"{BATCH_HEADER} is {count}: a container holds at least one message")
    checksum = zlib.crc32(body)
    if _header(headers, CHECKSUM_HEADER) != checksum:
        raise EnvelopeRejected(
            REASON, f"the body's CRC-32 is {checksum}, not {headers[CHECKSUM_HEADER]}: changed or cut short"
        )
    payloads = _frames(body)
    if len(payloads) != count:
        raise EnvelopeRejected(REASON, f"{len(payloads)} frame(s), but {BATCH_HEADER} says {count}")
    return payloads


def _header(headers: Mapping[str, Any], name: str) -> int:
    value = headers.get(name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise EnvelopeRejected(REASON, f"the {name} header is {value!r}, not a whole number")
    return value


def _frames(body: bytes) -> list[bytes]:
    payloads, at = [], 0
    while at < len(body):
        if len(body) - at < FRAME_BYTES:
            raise EnvelopeRejected(REASON, f"{len(body) - at} byte(s) at offset {at}: a length cut short")
        size = int.from_bytes(body[at : at + FRAME_BYTES], "big")
        if size == 0:
            raise EnvelopeRejected(REASON, f"a frame of length 0 at offset {at}")
        end = at + FRAME_BYTES + size
        if end > len(body):
            raise EnvelopeRejected(
                REASON, f"the frame at offset {at} says {size} bytes; {len(body) - at - FRAME_BYTES} remain"
            )
        payloads.append(body[at + FRAME_BYTES : end])
        at = end
    if not payloads:
        raise EnvelopeRejected(REASON, "an empty container: no frame")
    return payloads

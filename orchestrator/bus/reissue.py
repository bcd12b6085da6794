"""A dead letter replayed by an operator is issued again: re-signed, as issued now.

A shard refuses a message issued longer ago than its kind's window (``wire/freshness.py``), and a dead
letter is usually older than that by the time someone replays it. So the replaying process verifies each
envelope the letter holds with its own key ring and signs it again with its signing key and a fresh
``issued_at_ms``; the message id, and with it every deduplication, stays the same. The copy carries
``REISSUED_BY_HEADER`` (the key that signed it again) and ``FIRST_ISSUED_HEADER`` (when it was first
issued), so whoever reads it, or finds it dead-lettered again, knows it was replayed.

A letter holding anything that does not verify (a forgery, a malformed or truncated message: what
saga.rejected collects), or an acceptance or heartbeat, is not signed again: it goes back as it was, and
is refused as before; so is one whose kind a replaying key may not sign (a task, a finished event: for
workers and clients, not shards). It is signed again by an operator's, the server's or an unscoped key
(``keys.ring.REPLAYERS``), never by a client's or a worker's that the process may also hold. Only a
letter an operator names is issued again (``saga dead-letters replay ID``; ``--all`` sends each as it
was): the headers that say where a letter came from are not signed, so anyone who can publish to the
broker could park a captured old message there. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from orchestrator.bus import batch
from orchestrator.bus.envelope import EnvelopeRejected, Signer, decode, encode
from orchestrator.keys.ring import REPLAYERS, SHARD_INBOUND
from orchestrator.wire.freshness import LIVENESS_KINDS

REISSUED_BY_HEADER = "x-saga-reissued-by"
FIRST_ISSUED_HEADER = "x-saga-first-issued-at"


@dataclass(frozen=True)
class Reissue:
    """Who signs replayed letters again, and when it is."""

    signer: Signer
    now_ms: int
    max_bytes: int


def reissued(
    body: bytes, headers: Mapping[str, Any] | None, reissue: Reissue
) -> tuple[bytes, dict[str, Any], bool]:
    """``body`` and ``headers`` of a replayed letter, and whether it was issued again: every envelope in it
    signed again as issued now, acceptances and heartbeats left out; or both as they were when any does
    not verify, or when it holds nothing else."""
    kept = dict(headers or {})
    try:
        raws = batch.unpack(body, kept, reissue.max_bytes) if batch.is_container(kept) else [body]
        envelopes = [decode(raw, reissue.signer, reissue.max_bytes) for raw in raws]
    except EnvelopeRejected:
        return body, kept, False
    # old news of an attempt, left out (a worker batches them with its results): issued again, a heartbeat
    # could keep a dead attempt looking alive
    envelopes = [e for e in envelopes if e.kind not in LIVENESS_KINDS]
    if not envelopes or any(e.kind not in SHARD_INBOUND for e in envelopes):
        return body, kept, False
    # a letter replayed before says when it was first issued; else its envelopes do
    first = kept.get(FIRST_ISSUED_HEADER) or min(e.issued_at_ms for e in envelopes)
    signed = [
        reissue.signer.sign(e.model_copy(update={"issued_at_ms": reissue.now_ms}), REPLAYERS)
        for e in envelopes
    ]
    again = [encode(e) for e in signed]
    for name in batch.HEADERS:
        kept.pop(name, None)
    if len(again) == 1:
        body = again[0]
    else:
        container = batch.pack(again, envelopes[0].message_id)
        body = container.body
        kept.update(container.headers)
    return body, {**kept, REISSUED_BY_HEADER: signed[0].key_id, FIRST_ISSUED_HEADER: first}, True

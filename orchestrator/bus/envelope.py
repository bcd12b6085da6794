"""Message envelopes: one signed, self-describing shape for every message the system sends.

Each envelope carries the identity of DESIGN.md invariant 5 (run, shard, stage, attempt, fence, plan
digest, contract and result-schema version, deterministic message id, deadline, tenant, issued-at) and an
HMAC-SHA256 signature over its canonical JSON, with the id of the key that signed it so keys can rotate.

:func:`decode` is the only way in: it checks size before parsing, then shape, then signature, and raises
:class:`EnvelopeRejected` with a reason; a rejected message never reaches a run.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from orchestrator.errors import SagaError
from orchestrator.jsontext import canonical_bytes
from orchestrator.wire.kinds import Kind

# Identity fields travel as AMQP properties and routing keys (short strings of at most 255 bytes) and
# inside Redis keys and timer members, so their alphabet and length are bounded here, where every
# message comes in, rather than failing later in a client library or a key. A run id is chosen by the
# client: 1-128 letters, digits and ``._:-``.
RUN_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
MESSAGE_ID_PATTERN = r"^[\x21-\x7e]{1,200}$"  # printable ASCII, no spaces
SHARD_PATTERN = r"^([a-z][a-z0-9_-]{0,31}\.[0-9]{1,5})?$"  # <class>.<number>, or empty (a start)
MAX_COUNT = 2**31 - 1  # attempts and map items


class Envelope(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Kind
    message_id: str = Field(pattern=MESSAGE_ID_PATTERN)
    run_id: str = Field(pattern=RUN_ID_PATTERN)
    shard: str = Field("", pattern=SHARD_PATTERN)
    stage: str | None = Field(None, max_length=200)
    attempt: int | None = Field(None, ge=0, le=MAX_COUNT)
    fence: str | None = Field(None, max_length=64)
    item: int | None = Field(None, ge=0, le=MAX_COUNT)
    digest: str = Field("", max_length=128)
    contract: str | None = Field(None, max_length=200)  # name@version: the contract (and result schema)
    deadline_ms: int | None = Field(None, ge=0)
    tenant: str = Field("default", max_length=64)
    issued_at_ms: int = Field(0, ge=0)
    key_id: str = Field("", max_length=64)
    body: dict[str, Any] = Field(default_factory=dict)
    signature: str = Field("", max_length=128)


class EnvelopeRejected(SagaError):
    """Raised when a message is refused before any state write: oversized, undecodable or forged."""

    code = "message_rejected"

    def __init__(self, reason: str, detail: str) -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"message rejected ({reason}): {detail}")


def canonical(envelope: Envelope) -> bytes:
    return canonical_bytes(envelope.model_dump(mode="json", exclude={"signature"}))


@dataclass(frozen=True)
class Signer:
    """Signs with the first key and verifies with any: add a key first to rotate, drop the old one
    once no message signed with it can still be in flight."""

    keys: Mapping[str, bytes]
    active: str

    @classmethod
    def from_settings(cls, pairs: tuple[str, ...]) -> Signer:
        keys: dict[str, bytes] = {}
        for pair in pairs:
            key_id, sep, secret = pair.partition(":")
            if not sep or not key_id or not secret:
                raise SagaError(f"signing key {key_id or pair!r} is not 'id:secret'; set SAGA_SIGNING_KEYS")
            keys[key_id] = secret.encode()
        return cls(keys, pairs[0].partition(":")[0])

    def sign(self, envelope: Envelope) -> Envelope:
        unsigned = envelope.model_copy(update={"key_id": self.active, "signature": ""})
        return unsigned.model_copy(update={"signature": self.mac(self.active, canonical(unsigned))})

    def signed(self, envelope: Envelope, text: bytes) -> bool:
        """Whether ``text`` is what signed ``envelope``: its signature is the MAC of exactly these bytes."""
        if envelope.key_id not in self.keys:
            return False
        return hmac.compare_digest(self.mac(envelope.key_id, text), envelope.signature)

    def verify(self, envelope: Envelope) -> None:
        if envelope.key_id not in self.keys:
            raise EnvelopeRejected("unknown-key", f"key id {envelope.key_id!r} is not configured")
        if not self.signed(envelope, canonical(envelope)):
            raise EnvelopeRejected("bad-signature", f"message {envelope.message_id} has a bad signature")

    def mac(self, key_id: str, text: bytes) -> str:
        return hmac.new(self.keys[key_id], text, hashlib.sha256).hexdigest()


_DEFAULTS: dict[str, Any] = {
    name: field.get_default(call_default_factory=True)
    for name, field in Envelope.model_fields.items()
    if not field.is_required()
}


def signed_message(signer: Signer, **fields: Any) -> bytes:
    """The wire bytes of a signed envelope, built without a model: the hot path of every publish.

    The canonical form is the same one :func:`canonical` computes from a model (every field, defaults
    filled, sorted keys), so :func:`decode` verifies it like any other envelope."""
    data = {**_DEFAULTS, **fields, "key_id": signer.active}
    data.pop("signature", None)
    if isinstance(data.get("kind"), Kind):
        data["kind"] = data["kind"].value
    text = canonical_bytes(data)
    return _with_signature(text, signer.mac(signer.active, text))


def encode(envelope: Envelope) -> bytes:
    """A signed envelope is sent as its canonical text with the signature appended, the form
    :func:`signed_message` writes and :func:`decode` verifies without recomputing the canonical text."""
    if not envelope.signature:
        return envelope.model_dump_json().encode()
    return _with_signature(canonical(envelope), envelope.signature)


_SIGNATURE_FIELD = b',"signature":"'
_SIGNED_TAIL = len(_SIGNATURE_FIELD) + 64 + 2  # the field, a SHA-256 MAC in hex, '"}'


def _with_signature(text: bytes, mac: str) -> bytes:
    """The signed text (a JSON object) with its signature appended as the last field; see _signed_text."""
    return text[:-1] + _SIGNATURE_FIELD + mac.encode() + b'"}'


def _signed_text(raw: bytes) -> bytes | None:
    """The text a sender signed, when ``raw`` is that text with the signature appended as its last field
    (as every sender writes it); None otherwise. Verifying these bytes themselves spares rebuilding the
    canonical text from the parsed model, most of the cost of a decode; any other layout is verified the
    long way. Sound because the MAC covers exactly these bytes, which hold every field but the signature."""
    start = len(raw) - _SIGNED_TAIL
    if (
        start <= 0
        or not raw.endswith(b'"}')
        or raw[start : start + len(_SIGNATURE_FIELD)] != _SIGNATURE_FIELD
    ):
        return None
    return raw[:start] + b"}"


def decode(raw: bytes, signer: Signer, max_bytes: int) -> Envelope:
    if len(raw) > max_bytes:
        raise EnvelopeRejected("oversized", f"{len(raw)} bytes, over the {max_bytes}-byte limit")
    try:
        envelope = Envelope.model_validate_json(raw)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first["loc"]) or "message"
        raise EnvelopeRejected("malformed", f"{where}: {first['msg']}") from exc
    signed = _signed_text(raw)
    if signed is None or not signer.signed(envelope, signed):
        signer.verify(envelope)  # another layout, or not what was signed: the canonical check decides
    return envelope

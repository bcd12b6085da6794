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
import time
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from orchestrator.errors import SagaError
from orchestrator.jsontext import canonical_bytes
from orchestrator.keys.ring import NoSigningKey, Ring, RingKey, Scope, out_of_scope, unscoped_ring
from orchestrator.wire.bodies import DEFAULT_TENANT
from orchestrator.wire.kinds import Kind

# Identity fields travel as AMQP properties and routing keys (short strings of at most 255 bytes) and
# inside Redis keys and timer members, so their alphabet and length are bounded here, where every
# message comes in, rather than failing later in a client library or a key. A run id is chosen by the
# client: 1-128 letters, digits and ``._:-``.
RUN_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
MESSAGE_ID_PATTERN = r"^[\x21-\x7e]{1,200}$"  # printable ASCII, no spaces
SHARD_PATTERN = r"^([a-z][a-z0-9_-]{0,31}\.[0-9]{1,5})?$"  # <class>.<number>, or empty (a start)
MAX_COUNT = 2**31 - 1  # attempts and map items
TENANT_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$"  # never empty: it keys a tenant's counts


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
    tenant: str = Field(DEFAULT_TENANT, pattern=TENANT_PATTERN)
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


def wall_ms() -> int:
    return int(time.time() * 1000)


class Signer:
    """Signs and verifies with a key ring (``orchestrator.keys``). The ring can be replaced while the
    process runs (a reload), so it is read once per call: a message is signed and verified against one
    ring, never half of one and half of the next."""

    def __init__(self, ring: Ring, clock_ms: Callable[[], int] = wall_ms) -> None:
        self.ring = ring
        self.clock_ms = clock_ms  # read only to tell whether a retired key still verifies

    @classmethod
    def from_settings(cls, pairs: tuple[str, ...]) -> Signer:
        """Unscoped ``id:secret`` keys (``SAGA_SIGNING_KEYS``): the first signs, all verify."""
        keys: dict[str, bytes] = {}
        for pair in pairs:
            key_id, sep, secret = pair.partition(":")
            if not sep or not key_id or not secret:
                raise SagaError(f"signing key {key_id or pair!r} is not 'id:secret'; set SAGA_SIGNING_KEYS")
            keys[key_id] = secret.encode()
        return cls(unscoped_ring(keys))

    def key_for(
        self, kind: Kind | str, contract: str | None = None, scopes: frozenset[Scope] | None = None
    ) -> RingKey:
        """The key that signs a ``kind`` message about ``contract`` (of one of ``scopes``, if given);
        raises SagaError if this process holds none."""
        try:
            return self.ring.signing_key(kind, contract, scopes)
        except NoSigningKey as exc:
            raise SagaError(str(exc)) from None

    def bound_tenant(self) -> str | None:
        """The tenant this process acts for when its starts are signed by a client key (a client key
        belongs to one tenant); None where it may act for any (an operator's, the server's, an unscoped
        key)."""
        try:
            return self.ring.signing_key(Kind.START).tenant
        except NoSigningKey:
            return self.ring.client_tenant()  # a client key not active yet still binds it

    def sign(self, envelope: Envelope, scopes: frozenset[Scope] | None = None) -> Envelope:
        """``envelope`` signed by the key for its kind and contract (of one of ``scopes``, if given)."""
        key = self.key_for(envelope.kind, envelope.contract, scopes)
        update: dict[str, Any] = {"key_id": key.key_id, "signature": ""}
        if key.tenant is not None:
            update["tenant"] = key.tenant  # a client key's messages are its tenant's, whatever was asked
        unsigned = envelope.model_copy(update=update)
        return unsigned.model_copy(update={"signature": _mac(key, canonical(unsigned))})

    def signed(self, envelope: Envelope, text: bytes) -> bool:
        """Whether ``text`` is what signed ``envelope``: its signature is the MAC of exactly these bytes,
        under a key of this ring that still verifies, whose scope admits the message."""
        key = self.ring.verifying_key(envelope.key_id, self.clock_ms())
        if isinstance(key, tuple) or not hmac.compare_digest(_mac(key, text), envelope.signature):
            return False
        return out_of_scope(key, envelope.kind, envelope.contract, envelope.tenant) is None

    def verify(self, envelope: Envelope) -> None:
        key = self.ring.verifying_key(envelope.key_id, self.clock_ms())
        if isinstance(key, tuple):
            reason, why = key
            raise EnvelopeRejected(reason, f"message {envelope.message_id}: {why}")
        if not hmac.compare_digest(_mac(key, canonical(envelope)), envelope.signature):
            raise EnvelopeRejected("bad-signature", f"message {envelope.message_id} has a bad signature")
        scope = out_of_scope(key, envelope.kind, envelope.contract, envelope.tenant)
        if scope is not None:
            raise EnvelopeRejected("out-of-scope", f"message {envelope.message_id}: {scope}")

    def mac(self, key_id: str, text: bytes) -> str:
        """The MAC of ``text`` under key ``key_id`` of this ring (which this process holds)."""
        key = self.ring.get(key_id)
        if key is None or key.secret is None:
            raise SagaError(f"key id {key_id!r} is not in this process's key ring")
        return _mac(key, text)


def _mac(key: RingKey, text: bytes) -> str:
    assert key.secret is not None, "only keys this process holds sign or verify"
    return hmac.new(key.secret, text, hashlib.sha256).hexdigest()


_DEFAULTS: dict[str, Any] = {
    name: field.get_default(call_default_factory=True)
    for name, field in Envelope.model_fields.items()
    if not field.is_required()
}


def signed_message(signer: Signer, **fields: Any) -> bytes:
    """The wire bytes of a signed envelope, built without a model: the hot path of every publish.

    The canonical form is the same one :func:`canonical` computes from a model (every field, defaults
    filled, sorted keys), so :func:`decode` verifies it like any other envelope."""
    data = {**_DEFAULTS, **fields}
    data.pop("signature", None)
    if isinstance(data.get("kind"), Kind):
        data["kind"] = data["kind"].value
    key = signer.key_for(data["kind"], data.get("contract"))
    data["key_id"] = key.key_id
    if key.tenant is not None:
        data["tenant"] = key.tenant
    text = canonical_bytes(data)
    return _with_signature(text, _mac(key, text))


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

"""Signed envelopes: signing, verification, key rotation and the checks ``decode`` makes before anything
reaches a run (size before parsing, then shape, then signature)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from orchestrator.bus.envelope import Envelope, EnvelopeRejected, Signer, decode, encode, signed_message
from orchestrator.errors import SagaError
from orchestrator.wire.kinds import Kind

MAX = 64 * 1024
DIGEST = "sha256:" + "ab" * 32


def envelope(**overrides: Any) -> Envelope:
    fields: dict[str, Any] = {
        "kind": Kind.RESULT,
        "message_id": "result-0123",
        "run_id": "run-1",
        "shard": "fast.0",
        "stage": "render-thumbnail",
        "attempt": 1,
        "fence": "1.1",
        "item": None,
        "digest": DIGEST,
        "contract": "thumbnail.render@3",
        "tenant": "default",
        "issued_at_ms": 1_700_000_000_000,
        "body": {"ok": True, "result": {"thumbnailUri": "thumbs/m-1.png"}},
    }
    fields.update(overrides)
    return Envelope(**fields)


@pytest.fixture
def signer() -> Signer:
    return Signer.from_settings(("k1:first-secret",))


def rejection(call: Any) -> EnvelopeRejected:
    with pytest.raises(EnvelopeRejected) as caught:
        call()
    return caught.value


# ---- sign and verify ----------------------------------------------------------------------------------


def test_sign_then_verify_round_trips(signer: Signer) -> None:
    signed = signer.sign(envelope())

    assert signed.key_id == "k1"
    assert len(signed.signature) == 64 and int(signed.signature, 16) >= 0  # hex HMAC-SHA256
    signer.verify(signed)
    decoded = decode(encode(signed), signer, MAX)
    assert decoded == signed
    assert decoded.body == {"ok": True, "result": {"thumbnailUri": "thumbs/m-1.png"}}


def test_signing_is_deterministic_and_ignores_a_previous_signature(signer: Signer) -> None:
    once = signer.sign(envelope())
    twice = signer.sign(once)
    assert once.signature == twice.signature
    assert signer.sign(envelope(signature="junk", key_id="other")) == once


@pytest.mark.parametrize(
    "change",
    [
        {"body": {"ok": False, "error": "boom"}},
        {"body": {"ok": True, "result": {"thumbnailUri": "thumbs/evil.png"}}},
        {"fence": "1.2"},
        {"run_id": "run-2"},
        {"digest": "sha256:" + "cd" * 32},
        {"stage": "publish"},
        {"attempt": 2},
        {"item": 3},
        {"message_id": "result-9999"},
        {"shard": "fast.1"},
        {"kind": Kind.RELEASE},
        {"tenant": "other"},
        {"contract": "thumbnail.render@4"},
        {"issued_at_ms": 1},
        {"deadline_ms": 5},
    ],
    ids=lambda change: next(iter(change)),
)
def test_tampering_with_any_field_fails_verification(signer: Signer, change: dict[str, Any]) -> None:
    signed = signer.sign(envelope())
    tampered = signed.model_copy(update=change)

    problem = rejection(lambda: signer.verify(tampered))
    assert problem.reason == "bad-signature"
    # and the same through the wire format
    assert rejection(lambda: decode(encode(tampered), signer, MAX)).reason == "bad-signature"


def test_tampering_with_the_raw_bytes_fails_verification(signer: Signer) -> None:
    raw = encode(signer.sign(envelope()))
    forged = raw.replace(b'"fence":"1.1"', b'"fence":"1.7"')
    assert forged != raw

    assert rejection(lambda: decode(forged, signer, MAX)).reason == "bad-signature"


def test_a_changed_signature_fails_verification(signer: Signer) -> None:
    signed = signer.sign(envelope())
    flipped = ("0" if signed.signature[0] != "0" else "1") + signed.signature[1:]

    assert rejection(lambda: signer.verify(signed.model_copy(update={"signature": flipped}))).reason == (
        "bad-signature"
    )
    assert rejection(lambda: signer.verify(signed.model_copy(update={"signature": ""}))).reason == (
        "bad-signature"
    )


def test_a_signature_by_another_secret_under_the_same_key_id_fails(signer: Signer) -> None:
    impostor = Signer.from_settings(("k1:guessed-secret",))
    assert rejection(lambda: signer.verify(impostor.sign(envelope()))).reason == "bad-signature"


def test_unknown_key_id_is_rejected_as_unknown_key(signer: Signer) -> None:
    other = Signer.from_settings(("k2:second-secret",))
    signed = other.sign(envelope())

    problem = rejection(lambda: signer.verify(signed))
    assert problem.reason == "unknown-key"
    assert "k2" in problem.detail
    assert rejection(lambda: decode(encode(signed), signer, MAX)).reason == "unknown-key"
    # an unsigned message names no key at all
    assert rejection(lambda: decode(encode(envelope()), signer, MAX)).reason == "unknown-key"


def test_relabelling_the_key_id_does_not_help(signer: Signer) -> None:
    both = Signer.from_settings(("k1:first-secret", "k2:second-secret"))
    signed = both.sign(envelope())
    relabelled = signed.model_copy(update={"key_id": "k2"})
    assert rejection(lambda: both.verify(relabelled)).reason == "bad-signature"


# ---- rotation -------------------------------------------------------------------------------------------


def test_rotation_verifies_old_messages_and_signs_with_the_new_key() -> None:
    old = Signer.from_settings(("old:s3cret-1",))
    rotated = Signer.from_settings(("new:s3cret-2", "old:s3cret-1"))

    in_flight = old.sign(envelope())
    rotated.verify(in_flight)  # a message signed before the rotation is still accepted

    fresh = rotated.sign(envelope())
    assert rotated.key_for(Kind.RESULT).key_id == "new"
    assert fresh.key_id == "new"
    rotated.verify(fresh)
    assert fresh.signature != in_flight.signature
    # a process that has not rotated yet does not know the new key
    assert rejection(lambda: old.verify(fresh)).reason == "unknown-key"
    # once the old key is dropped, messages it signed are refused
    retired = Signer.from_settings(("new:s3cret-2",))
    assert rejection(lambda: retired.verify(in_flight)).reason == "unknown-key"
    retired.verify(fresh)


# ---- decode -----------------------------------------------------------------------------------------------


def test_decode_rejects_oversized_bytes_before_parsing_them(signer: Signer) -> None:
    garbage = b"\xff\x00 this is not even JSON " * 10  # unparseable: a parse would say 'malformed'
    assert rejection(lambda: decode(garbage[:100], signer, 100)).reason == "malformed"

    problem = rejection(lambda: decode(garbage[:101], signer, 100))
    assert problem.reason == "oversized"
    assert "101" in problem.detail and "100" in problem.detail


def test_decode_accepts_a_message_of_exactly_the_limit(signer: Signer) -> None:
    raw = encode(signer.sign(envelope()))
    assert decode(raw, signer, len(raw)).message_id == "result-0123"
    assert rejection(lambda: decode(raw, signer, len(raw) - 1)).reason == "oversized"


@pytest.mark.parametrize(
    "raw",
    [b"", b"{not json", b"[1, 2, 3]", b'"a string"', b"null", b'{"kind": "result"'],
    ids=["empty", "broken", "array", "string", "null", "truncated"],
)
def test_decode_rejects_malformed_json(signer: Signer, raw: bytes) -> None:
    assert rejection(lambda: decode(raw, signer, MAX)).reason == "malformed"


def signed_dict(signer: Signer) -> dict[str, Any]:
    return json.loads(encode(signer.sign(envelope())))


def test_decode_rejects_unknown_fields(signer: Signer) -> None:
    data = signed_dict(signer)
    data["sneaky"] = "extra"

    problem = rejection(lambda: decode(json.dumps(data).encode(), signer, MAX))
    assert problem.reason == "malformed"
    assert "sneaky" in problem.detail


@pytest.mark.parametrize(
    ("field", "value", "where"),
    [
        ("kind", "launch-missiles", "kind"),
        ("message_id", "", "message_id"),
        ("attempt", "first", "attempt"),
        ("body", [1, 2], "body"),
        ("run_id", None, "run_id"),
    ],
)
def test_decode_rejects_wrong_shapes_naming_the_field(
    signer: Signer, field: str, value: Any, where: str
) -> None:
    data = signed_dict(signer)
    data[field] = value

    problem = rejection(lambda: decode(json.dumps(data).encode(), signer, MAX))
    assert problem.reason == "malformed"
    assert problem.detail.startswith(where)


def test_decode_rejects_missing_required_fields(signer: Signer) -> None:
    data = signed_dict(signer)
    del data["run_id"]
    problem = rejection(lambda: decode(json.dumps(data).encode(), signer, MAX))
    assert problem.reason == "malformed"
    assert "run_id" in problem.detail


def test_envelopes_are_immutable() -> None:
    env = envelope()
    with pytest.raises(ValidationError, match="frozen"):
        env.fence = "9.9"  # type: ignore[misc]


# ---- settings ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pairs", [("nocolon",), ("k1:",), (":secret",), ("k1:ok", "broken")])
def test_signer_from_settings_rejects_pairs_without_id_and_secret(pairs: tuple[str, ...]) -> None:
    with pytest.raises(SagaError) as caught:
        Signer.from_settings(pairs)
    assert "id:secret" in str(caught.value)


def test_signer_from_settings_keeps_every_key_and_signs_with_the_first() -> None:
    signer = Signer.from_settings(("a:one", "b:two:with:colons"))
    assert signer.key_for(Kind.START).key_id == "a"
    assert {k.key_id: k.secret for k in signer.ring.held()} == {"a": b"one", "b": b"two:with:colons"}


def test_the_fast_signed_form_verifies_like_a_model_signed_one() -> None:
    signer = Signer.from_settings(("new:s3cret", "old:older"))
    raw = signed_message(
        signer,
        kind="result",
        message_id="m-1",
        run_id="r-1",
        shard="fast.0",
        stage="publish",
        attempt=1,
        fence="1.1",
        digest="sha256:x",
        contract="catalogue.publish@2",
        issued_at_ms=5,
        body={"ok": True, "result": {"ünïcode": [1, 2.5, None, True]}},
    )
    envelope = decode(raw, signer, 1_000_000)
    assert envelope.key_id == "new" and envelope.body["result"]["ünïcode"] == [1, 2.5, None, True]
    assert signer.sign(envelope.model_copy(update={"signature": ""})).signature == envelope.signature
    tampered = raw.replace(b'"fence":"1.1"', b'"fence":"1.2"')
    with pytest.raises(EnvelopeRejected) as info:
        decode(tampered, signer, 1_000_000)
    assert info.value.reason == "bad-signature"


# ---- verified over the bytes that were signed -----------------------------------------------------------


def test_encode_writes_the_bytes_signed_message_writes(signer: Signer) -> None:
    signed = signer.sign(envelope())
    fields = envelope().model_dump(exclude={"key_id", "signature"})
    assert encode(signed) == signed_message(signer, **fields)


def test_a_changed_field_is_refused_though_the_signature_tail_is_intact(signer: Signer) -> None:
    raw = encode(signer.sign(envelope()))
    tampered = raw.replace(b'"run-1"', b'"run-2"')
    assert tampered != raw and tampered.endswith(raw[-70:])
    assert rejection(lambda: decode(tampered, signer, MAX)).reason == "bad-signature"


def test_other_layouts_are_verified_over_the_canonical_text(signer: Signer) -> None:
    signed = signer.sign(envelope())
    pretty = json.dumps(
        json.loads(signed.model_dump_json()), indent=2
    ).encode()  # another layout, same fields
    assert decode(pretty, signer, MAX) == signed


# ---- one canonical encoder, whatever the values ------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [1e-05, 1e16, 2**70, "é\u2028", -0.0, [0.1, {"b": 1, "a": 2}]],
    ids=["small-float", "large-float", "int-beyond-64-bits", "non-ascii", "negative-zero", "nested"],
)
def test_signing_from_a_model_and_from_fields_agree_on_values_the_encoders_write_differently(
    signer: Signer, value: Any
) -> None:
    # one value per case: 1e-05 is "1e-05" to the standard library and "0.00001" to orjson, and 2**70
    # (beyond orjson) would send a whole message with it to the standard library
    body = {"ok": True, "result": {"value": value}}
    fields = envelope(body=body).model_dump(exclude={"key_id", "signature"})
    raw = signed_message(signer, **fields)
    assert encode(signer.sign(envelope(body=body))) == raw
    assert decode(raw, signer, MAX).body["result"] == {"value": value}
    assert decode(raw, signer, MAX) == signer.sign(envelope(body=body))


def test_a_message_an_earlier_release_signed_over_the_standard_librarys_text_still_verifies(
    signer: Signer,
) -> None:
    data = envelope(body={"ok": True, "result": {"p": 1e-05}}).model_dump(mode="json", exclude={"signature"})
    data["key_id"] = signer.key_for(Kind.RESULT).key_id
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    assert b"1e-05" in text  # what orjson would have written differently
    raw = text[:-1] + b',"signature":"' + signer.mac(data["key_id"], text).encode() + b'"}'
    assert decode(raw, signer, MAX).body["result"] == {"p": 1e-05}

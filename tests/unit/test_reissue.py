"""A replayed dead letter is issued again (orchestrator/bus/reissue.py): each envelope it holds verified,
then signed again as issued now with the same id; anything that does not verify goes back as it was."""

from __future__ import annotations

import zlib

from orchestrator.bus import batch
from orchestrator.bus.envelope import Signer, decode, signed_message
from orchestrator.bus.reissue import FIRST_ISSUED_HEADER, REISSUED_BY_HEADER, Reissue, reissued
from tests.unit import test_shard_containers as shard_containers

OLD_KEY = Signer.from_settings(("old:old-secret",))
OPERATOR = Signer.from_settings(("ops:ops-secret", "old:old-secret"))  # signs with ops, verifies both
FORGER = Signer.from_settings(("old:not-the-secret",))
FIRST, NOW = 1_700_000_000_000, 1_800_000_000_000
REISSUE = Reissue(OPERATOR, NOW, 1_048_576)


def heartbeat() -> bytes:
    return signed_message(
        OLD_KEY,
        kind="heartbeat",
        message_id="hb-1",
        run_id="run-1",
        shard="fast.0",
        stage="render",
        attempt=1,
        fence="1.1",
        issued_at_ms=FIRST,
    )


def result(n: int, signer: Signer = OLD_KEY, issued_at_ms: int = FIRST) -> bytes:
    return shard_containers.result(n, signer, issued_at_ms)


def test_a_letter_is_signed_again_as_issued_now_with_its_id_and_first_time_kept() -> None:
    body, headers, again = reissued(result(1), {"x-saga-replayed-from": "saga.rejected"}, REISSUE)
    assert again
    envelope = decode(body, OPERATOR, 1_048_576)
    original = decode(result(1), OLD_KEY, 1_048_576)
    assert (envelope.message_id, envelope.issued_at_ms, envelope.key_id) == ("result-1", NOW, "ops")
    assert envelope.body == original.body and envelope.fence == original.fence
    assert headers == {
        "x-saga-replayed-from": "saga.rejected",
        REISSUED_BY_HEADER: "ops",
        FIRST_ISSUED_HEADER: FIRST,
    }


def test_a_letter_replayed_twice_keeps_when_it_was_first_issued() -> None:
    once, headers, _ = reissued(result(1), {}, REISSUE)
    _, again, _ = reissued(once, headers, Reissue(OPERATOR, NOW + 1, 1_048_576))
    assert again[FIRST_ISSUED_HEADER] == FIRST


def test_a_forgery_is_never_signed_again() -> None:
    forged = result(1, FORGER)
    assert reissued(forged, {"a": 1}, REISSUE) == (forged, {"a": 1}, False)
    truncated = result(1)[:-20]
    assert reissued(truncated, None, REISSUE) == (truncated, {}, False)


def test_an_acceptance_or_heartbeat_is_never_issued_again() -> None:
    beat = heartbeat()
    assert reissued(beat, {}, REISSUE) == (beat, {}, False)


def test_a_heartbeat_batched_with_a_result_is_left_out_and_the_result_issued_again() -> None:
    beat = heartbeat()
    container = batch.pack([result(1), beat], "result-1")
    body, headers, again = reissued(container.body, container.headers, REISSUE)
    assert again and not batch.is_container(headers)
    assert decode(body, OPERATOR, 1_048_576).message_id == "result-1"


def test_a_container_is_issued_again_whole_or_not_at_all() -> None:
    container = batch.pack([result(1), result(2)], "result-1")
    body, headers, _ = reissued(container.body, container.headers, REISSUE)
    payloads = batch.unpack(body, headers, 1_048_576)
    assert [decode(p, OPERATOR, 1_048_576).issued_at_ms for p in payloads] == [NOW, NOW]
    assert headers[FIRST_ISSUED_HEADER] == FIRST
    mixed = batch.pack([result(1), result(2, FORGER)], "result-1")
    assert reissued(mixed.body, mixed.headers, REISSUE) == (mixed.body, mixed.headers, False)


def test_a_container_of_one_goes_back_as_its_one_message() -> None:
    payload = result(1)
    headers = {batch.BATCH_HEADER: 1, batch.CHECKSUM_HEADER: 0}
    body = len(payload).to_bytes(batch.FRAME_BYTES, "big") + payload
    headers[batch.CHECKSUM_HEADER] = zlib.crc32(body)
    again, kept, _ = reissued(body, headers, REISSUE)
    assert not batch.is_container(kept)
    assert decode(again, OPERATOR, 1_048_576).issued_at_ms == NOW

"""Containers (orchestrator/bus/batch.py): what is packed unpacks to the same payloads in order, and a
container cut short, lengthened or changed is refused with a reason, never split differently in silence."""

from __future__ import annotations

import zlib
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from orchestrator.bus import batch
from orchestrator.bus.envelope import EnvelopeRejected

BIG = 1 << 30
payload = st.binary(min_size=1, max_size=300)
payloads = st.lists(payload, min_size=2, max_size=12)


def refused(body: bytes, headers: dict[str, Any], max_bytes: int = BIG) -> EnvelopeRejected:
    with pytest.raises(EnvelopeRejected) as caught:
        batch.unpack(body, headers, max_bytes)
    return caught.value


@given(payloads)
def test_what_is_packed_unpacks_to_the_same_payloads_in_order(items: list[bytes]) -> None:
    container = batch.pack(items, "result-1")
    assert batch.unpack(container.body, container.headers, BIG) == items
    assert container.headers[batch.BATCH_HEADER] == len(items)
    assert len(container.body) == sum(batch.framed_bytes(len(p)) for p in items)
    assert batch.is_container(container.headers)


@given(payloads, st.data())
def test_every_truncation_is_refused(items: list[bytes], data: st.DataObject) -> None:
    container = batch.pack(items, "result-1")
    cut = data.draw(st.integers(0, len(container.body) - 1), label="cut at")
    assert refused(container.body[:cut], container.headers).reason == batch.REASON


@given(payloads, st.binary(min_size=1, max_size=40))
def test_anything_appended_is_refused(items: list[bytes], tail: bytes) -> None:
    container = batch.pack(items, "result-1")
    assert refused(container.body + tail, container.headers).reason == batch.REASON


@given(payloads, st.data())
def test_any_change_of_up_to_four_consecutive_bytes_is_refused(
    items: list[bytes], data: st.DataObject
) -> None:
    # a length field is four bytes: whichever is changed, and however, the body no longer matches
    container = batch.pack(items, "result-1")
    body = container.body
    at = data.draw(st.integers(0, len(body) - 1), label="at")
    width = data.draw(st.integers(1, min(4, len(body) - at)), label="width")
    new = data.draw(st.binary(min_size=width, max_size=width).filter(lambda b: b != body[at : at + width]))
    corrupt = body[:at] + new + body[at + width :]
    assert refused(corrupt, container.headers).reason == batch.REASON


@given(st.binary(max_size=200), st.integers(-3, 20))
def test_any_body_that_is_accepted_is_exactly_its_frames(body: bytes, count: int) -> None:
    # whatever a publisher sends (with a checksum that matches), nothing is lost or invented: the payloads
    # accepted pack back to the very body
    headers = {batch.BATCH_HEADER: count, batch.CHECKSUM_HEADER: zlib.crc32(body)}
    try:
        found = batch.unpack(body, headers, BIG)
    except EnvelopeRejected as exc:
        assert exc.reason == batch.REASON
        return
    assert len(found) == count >= 1
    assert b"".join(len(p).to_bytes(4, "big") + p for p in found) == body


def _checked(body: bytes, count: int) -> dict[str, Any]:
    return {batch.BATCH_HEADER: count, batch.CHECKSUM_HEADER: zlib.crc32(body)}


@pytest.mark.parametrize(
    ("body", "count", "says"),
    [
        (b"", 1, "no frame"),
        (b"\x00\x00", 1, "a length cut short"),
        (b"\x00\x00\x00\x00", 1, "length 0"),
        (b"\x00\x00\x00\x05abc", 1, "says 5 bytes; 3 remain"),
        (b"\x00\x00\x00\x01a\x00\x00\x00\x01b", 3, "2 frame(s), but x-saga-batch says 3"),
        (b"\x00\x00\x00\x01a", 0, "at least one message"),
        (b"\x00\x00\x00\x01a", -1, "at least one message"),
    ],
    ids=[
        "empty",
        "short-length",
        "zero-length",
        "short-frame",
        "count-mismatch",
        "count-0",
        "count-negative",
    ],
)
def test_a_malformed_container_is_refused_with_a_clear_reason(body: bytes, count: int, says: str) -> None:
    rejected = refused(body, _checked(body, count))
    assert rejected.reason == "malformed-batch"
    assert says in rejected.detail


@pytest.mark.parametrize(
    "headers",
    [
        {batch.BATCH_HEADER: 1},
        {batch.BATCH_HEADER: "1", batch.CHECKSUM_HEADER: zlib.crc32(b"\x00\x00\x00\x01a")},
        {batch.BATCH_HEADER: True, batch.CHECKSUM_HEADER: zlib.crc32(b"\x00\x00\x00\x01a")},
        {batch.BATCH_HEADER: 1, batch.CHECKSUM_HEADER: "x"},
        {batch.BATCH_HEADER: 1, batch.CHECKSUM_HEADER: 0},
    ],
    ids=["no-checksum", "count-text", "count-bool", "checksum-text", "checksum-wrong"],
)
def test_headers_that_do_not_describe_the_body_are_refused(headers: dict[str, Any]) -> None:
    assert refused(b"\x00\x00\x00\x01a", headers).reason == "malformed-batch"


def test_a_container_over_the_message_limit_is_refused_as_oversized() -> None:
    container = batch.pack([b"a" * 100, b"b" * 100], "result-1")
    rejected = refused(container.body, container.headers, max_bytes=len(container.body) - 1)
    assert rejected.reason == "oversized"
    assert batch.unpack(container.body, container.headers, len(container.body)) == [b"a" * 100, b"b" * 100]


def test_a_container_has_an_id_of_its_own_derived_from_its_first_message() -> None:
    container = batch.pack([b"{}", b"[]", b"{}"], "result-abc")
    assert container.message_id == "batch-result-abc+2"
    assert container.message_id != batch.pack([b"{}", b"[]"], "result-abc").message_id


@pytest.mark.parametrize("items", [[], [b"one"], [b"a", b""]], ids=["none", "one", "an-empty-payload"])
def test_pack_refuses_what_is_not_a_container(items: list[bytes]) -> None:
    with pytest.raises(ValueError, match=r"at least two|cannot be framed"):
        batch.pack(items, "result-1")


def test_a_message_without_the_header_is_not_a_container() -> None:
    assert not batch.is_container(None)
    assert not batch.is_container({})
    assert not batch.is_container({"x-delivery-count": 2})

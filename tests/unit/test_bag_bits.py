"""Reading a bag's bitmap: the set bits of its bytes, numbered as Redis numbers them (bit 0 is the most
significant bit of the first byte, so SETBIT key 0 1 makes the first byte 128)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from orchestrator.store.redis_store import set_bits


def redis_bitmap(indices: set[int]) -> list[int]:
    """The bytes SETBIT would leave for ``indices``, as BITFIELD GET u8 reads them."""
    octets = [0] * ((max(indices) // 8 + 1) if indices else 0)
    for i in indices:
        octets[i // 8] |= 0x80 >> (i % 8)
    return octets


def test_bit_zero_is_the_high_bit_of_the_first_byte() -> None:
    assert set_bits([128]) == {"0"}
    assert set_bits([0, 64]) == {"9"}


@given(st.sets(st.integers(min_value=0, max_value=20_000), max_size=300))
def test_the_set_bits_are_exactly_the_items_set(indices: set[int]) -> None:
    assert set_bits(redis_bitmap(indices)) == {str(i) for i in indices}

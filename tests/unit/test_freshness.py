"""Freshness windows (orchestrator/wire/freshness.py): a message a shard takes is refused when it is older
than its kind's window or issued beyond the clock skew in the future; a window that outlives the records
that deduplicate its kind is refused at settings load."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from orchestrator.settings import Settings
from orchestrator.wire.freshness import FUTURE, LIVENESS_KINDS, RECORDED_KINDS, STALE, Freshness
from orchestrator.wire.kinds import Kind

WINDOWS = Freshness(message_window_ms=60_000, liveness_window_ms=5_000, clock_skew_ms=1_000)
NOW = 1_800_000_000_000


@given(st.sampled_from(sorted(RECORDED_KINDS | LIVENESS_KINDS)), st.integers(-(10**9), 10**9))
def test_a_message_is_taken_exactly_while_inside_its_window_and_the_skew(kind: Kind, age_ms: int) -> None:
    window = WINDOWS.window_ms(kind)
    assert window is not None
    refusal = WINDOWS.refusal(kind, "m-1", NOW - age_ms, NOW)
    if -age_ms > WINDOWS.clock_skew_ms:
        assert refusal is not None and refusal[0] == FUTURE
    elif age_ms > window:
        assert refusal is not None and refusal[0] == STALE
    else:
        assert refusal is None


def test_the_refusal_names_the_message_its_age_and_what_to_do() -> None:
    stale = WINDOWS.refusal(Kind.RESULT, "result-abc", NOW - 61_000, NOW)
    assert stale is not None
    assert "result-abc" in stale[1] and "61000 ms ago" in stale[1] and "dead-letters replay" in stale[1]
    future = WINDOWS.refusal(Kind.START, "start-abc", NOW + 5_000, NOW)
    assert future is not None and "start-abc" in future[1] and "SAGA_CLOCK_SKEW_MS" in future[1]


def test_recorded_kinds_get_the_message_window_and_liveness_kinds_theirs() -> None:
    assert WINDOWS.window_ms(Kind.START) == 60_000
    assert WINDOWS.window_ms(Kind.HEARTBEAT) == 5_000
    assert WINDOWS.window_ms(Kind.TASK) is None  # not a shard's kind: a worker's task has its own deadline


@given(st.integers(1_000, 10**10), st.integers(0, 10**8), st.integers(1_000, 10**10))
def test_a_window_that_outlives_the_runs_records_is_refused(window: int, skew: int, retention: int) -> None:
    problem = Freshness(window, 5_000, skew).check_against(retention)
    assert (problem is None) == (window + skew < retention)


def test_settings_refuse_a_window_past_the_retention_with_what_to_change() -> None:
    secret = "a-secret-that-must-not-be-printed"
    with pytest.raises(ValidationError) as refused:
        Settings(retention_ms=3_600_000, message_window_ms=3_600_000, signing_keys=(f"k:{secret}",))
    assert secret not in str(refused.value) and "clock_skew_ms" in str(refused.value)
    # unset, the window is the smaller of a day and half the retention: a short retention still starts
    assert Settings(retention_ms=3_600_000).freshness().message_window_ms == 1_800_000
    assert Settings().freshness().message_window_ms == 86_400_000
    # and a retention too short for the skew is refused even with the window unset
    with pytest.raises(ValidationError, match="keep runs for longer"):
        Settings(retention_ms=50_000)


def test_settings_name_what_to_change() -> None:
    with pytest.raises(
        ValidationError, match=r"SAGA_MESSAGE_WINDOW_MS.* must be shorter than SAGA_RETENTION_MS"
    ):
        Settings(retention_ms=3_600_000, message_window_ms=3_600_000)
    assert (
        Settings(retention_ms=3_600_000, message_window_ms=600_000).freshness().message_window_ms == 600_000
    )

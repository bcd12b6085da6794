"""``sizes.too_big`` refuses a body holding NaN or an infinity anywhere, exactly where the standard
library's strict encoder would, and lets every other JSON value through (nulls of its own included)."""

from __future__ import annotations

import json
import math
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from orchestrator.wire import sizes

LIMITS = sizes.Limits()

scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=20,
)


def strictly_json(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except ValueError:
        return False
    return True


@given(st.dictionaries(st.text(max_size=5), values, max_size=5))
def test_refused_as_not_json_exactly_where_the_strict_encoder_refuses(body: dict[str, Any]) -> None:
    why = sizes.too_big(body, LIMITS)
    assert (why is not None and "not valid JSON" in why) == (not strictly_json(body)), (body, why)


def test_a_non_finite_number_deep_in_a_body_is_refused_nulls_are_not() -> None:
    assert sizes.too_big({"heartbeat_ms": None, "input": {"a": [1, None, {"b": 2.5}]}}, LIMITS) is None
    for bad in (math.nan, math.inf, -math.inf):
        why = sizes.too_big({"heartbeat_ms": None, "input": {"a": [1, {"b": bad}]}}, LIMITS)
        assert why is not None and "Out of range float values are not JSON compliant" in why, why


def test_a_non_finite_number_beside_a_value_orjson_refuses_is_refused_too() -> None:
    # orjson refuses an integer beyond 64 bits, so the standard library writes this body (NaN as NaN)
    why = sizes.too_big({"big": 2**70, "score": math.nan}, LIMITS)
    assert why is not None and "not valid JSON" in why, why

"""The fast check says "fits" only where jsonschema, the reference, finds nothing wrong."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest
from hypothesis import given
from hypothesis import strategies as st

from orchestrator.dsl.fastcheck import certainly_fits

SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {"uri": {"type": "string"}, "n": {"type": "integer"}},
        "required": ["uri"],
    },
    {"type": "array", "items": {"type": "number", "minimum": 0}, "maxItems": 3},
    {"type": "object", "additionalProperties": False, "properties": {"ok": {"type": "boolean"}}},
    {"$defs": {"id": {"type": "string", "minLength": 2}}, "type": "array", "items": {"$ref": "#/$defs/id"}},
    {"anyOf": [{"type": "null"}, {"type": "string", "enum": ["a", "b"]}]},
]

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=4),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(["uri", "n", "ok", "x"]), inner)
    ),
    max_leaves=8,
)


@pytest.mark.parametrize("schema", SCHEMAS)
@given(value=json_values)
def test_a_fast_yes_is_one_jsonschema_agrees_with(schema: dict[str, Any], value: Any) -> None:
    reference_errors = list(jsonschema.Draft202012Validator(schema).iter_errors(value))
    if certainly_fits(schema, value):
        assert not reference_errors


@pytest.mark.parametrize("schema", SCHEMAS)
def test_the_fast_path_answers_for_plain_schemas(schema: dict[str, Any]) -> None:
    fitting = {
        0: {"uri": "s3://x", "n": 2},
        1: [0, 1.5],
        2: {"ok": True},
        3: ["ab", "cd"],
        4: None,
    }[SCHEMAS.index(schema)]
    assert certainly_fits(schema, fitting)


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "string", "pattern": "^[a-z]+$"},
        {"type": "string", "format": "email"},
        {"type": "object", "patternProperties": {"^x": {"type": "string"}}},
        {"$ref": "https://example.com/schema.json"},
    ],
)
def test_schemas_the_two_could_read_differently_get_no_fast_path(schema: dict[str, Any]) -> None:
    assert not certainly_fits(schema, "abc")
    assert not certainly_fits(schema, {"x": "y"})

"""A fast "it fits" for values checked against a JSON Schema on the hot path. Pure.

Every task input, run context and stage result is checked against its contract's schema. jsonschema is
the reference (its messages are what users read when a value does not fit) but takes 10-30 us for a small
object; jsonschema-rs says whether a value fits in well under a microsecond. Only its "yes" is taken:
a "no" goes to jsonschema for the verdict and the message, so a value is refused only when jsonschema
refuses it. Schemas whose meaning the two could read differently get no fast path at all: regular
expressions (Rust's dialect is not Python's), formats (jsonschema ignores them by default), and
references outside the schema itself (jsonschema-rs could try to fetch them).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jsonschema_rs

__all__ = ["certainly_fits"]

UNSURE_KEYWORDS = frozenset({"pattern", "patternProperties", "format", "$dynamicRef", "$recursiveRef"})
MAX_CACHED = 4096

Check = Callable[[Any], bool]
_BY_IDENTITY: dict[int, tuple[Mapping[str, Any], Check | None]] = {}


def certainly_fits(schema: Mapping[str, Any], value: Any) -> bool:
    """True when ``value`` fits ``schema`` for certain; False: ask jsonschema (it may fit all the same)."""
    cached = _BY_IDENTITY.get(id(schema))
    if cached is None or cached[0] is not schema:
        if len(_BY_IDENTITY) >= MAX_CACHED:
            _BY_IDENTITY.clear()
        # the schema stays referenced by its entry, so its id is never reused for another object
        cached = _BY_IDENTITY[id(schema)] = (schema, _compile(schema))
    check = cached[1]
    if check is None:
        return False
    try:
        return check(value)
    except Exception:  # a value jsonschema-rs cannot take (a Python type JSON has not): ask jsonschema
        return False


def _compile(schema: Mapping[str, Any]) -> Check | None:
    if not isinstance(schema, Mapping) or _unsure(schema):
        return None
    try:
        return jsonschema_rs.Draft202012Validator(dict(schema), offline=True).is_valid
    except Exception:  # a schema it cannot compile: jsonschema decides alone, as before
        return None


def _unsure(node: Any) -> bool:
    if isinstance(node, Mapping):
        for key, value in node.items():
            if key in UNSURE_KEYWORDS:
                return True
            if key == "$ref" and not (isinstance(value, str) and value.startswith("#")):
                return True
            if _unsure(value):
                return True
        return False
    if isinstance(node, list):
        return any(_unsure(item) for item in node)
    return False

"""Just enough JSON Schema navigation to type-check references statically.

Contracts' schemas come from pydantic (local ``$ref`` into ``$defs``, ``anyOf`` with ``null`` for optional
fields). Navigation answers three things: does a field exist, what types may a value have, and what do the
items of an array look like. An unknown or open schema answers "anything" (``{}``) rather than guessing.
"""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]
ANY: Schema = {}
_MAX_REF_HOPS = 32


def resolve(root: Schema, node: Schema) -> Schema:
    """Follow local ``$ref``s (``#/$defs/Name``); anything else is treated as open."""
    for _ in range(_MAX_REF_HOPS):
        if not isinstance(node, dict):  # a boolean schema: true accepts anything (false: see field)
            return ANY
        ref = node.get("$ref")
        if not isinstance(ref, str):
            return node
        target: Any = root
        for part in ref.removeprefix("#/").split("/") if ref.startswith("#/") else ():
            target = target.get(part) if isinstance(target, dict) else None
        if not isinstance(target, dict) or not ref.startswith("#/"):
            return ANY
        node = target
    return ANY


def _alternatives(root: Schema, node: Schema) -> list[Schema]:
    """The non-null alternatives of ``anyOf`` / ``oneOf``; the node itself when it has none."""
    node = resolve(root, node)
    for key in ("anyOf", "oneOf"):
        options = node.get(key)
        if isinstance(options, list):
            return [resolve(root, o) for o in options if isinstance(o, dict) and o.get("type") != "null"]
    return [node]


def field(root: Schema, node: Schema, key: str | int) -> Schema | None:
    """The schema of ``node[key]``; ``None`` when the schema rules the field out."""
    options = _alternatives(root, node)
    if len(options) != 1:
        return ANY
    node = options[0]
    if isinstance(key, int):
        return item(root, node)
    properties = node.get("properties")
    if isinstance(properties, dict):
        if key in properties:
            return None if properties[key] is False else resolve(root, properties[key])
        extra = node.get("additionalProperties", False)
        return resolve(root, extra) if isinstance(extra, dict) else ANY if extra is True else None
    extra = node.get("additionalProperties")
    if isinstance(extra, dict):
        return resolve(root, extra)
    if node.get("type") not in (None, "object"):
        return None  # a scalar or array has no named fields
    return ANY


def item(root: Schema, node: Schema) -> Schema | None:
    """The schema of an array's items; ``None`` when the value is known not to be an array."""
    options = _alternatives(root, node)
    if len(options) != 1:
        return ANY
    node = options[0]
    kind = node.get("type")
    if kind == "array":
        items = node.get("items")
        return resolve(root, items) if isinstance(items, dict) else ANY
    return ANY if kind is None else None


def types(root: Schema, node: Schema) -> set[str] | None:
    """The JSON types a value may have (``None``: any). ``null`` is left out: nullability is a runtime
    binding error of its own (missing, null and wrong type are distinct)."""
    found: set[str] = set()
    for option in _alternatives(root, node):
        kind = option.get("type")
        if kind is None:
            return None
        found.update([kind] if isinstance(kind, str) else kind)
    found.discard("null")
    return found or None


def fits(source: set[str] | None, target: set[str] | None) -> bool:
    """Whether every type a source may have is accepted by the target (an integer is a number)."""
    if source is None or target is None:
        return True
    accepted = target | ({"integer"} if "number" in target else set())
    return source <= accepted


def describe(kinds: set[str] | None) -> str:
    return "any" if kinds is None else " or ".join(sorted(kinds))

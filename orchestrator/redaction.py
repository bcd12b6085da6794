"""Sensitive values: marked in schemas, never shown. Pure.

A contract field is sensitive when its model says so (``workers.sdk.Sensitive``, which puts
``"sensitive": true`` in the field's JSON Schema), and a context property when the definition's context
schema does (``sensitive: true``). The run keeps such values where it needs them (its context, the results
later stages read); what people and tools see of a run (``saga status``, history, the API and console,
dead letters) shows each as a marker with a short keyed hash, ``[sensitive:1f0c9a2e]``, so equal values
can still be told equal: the hash is an HMAC under the key ring's ``data`` key (without one, the marker
carries no hash: a bare hash of a short secret could be guessed).

:func:`sensitive_values` finds the values a schema marks in a document; :class:`Redactor` replaces them
wherever they appear in what is shown, inside longer texts too (an error that quotes one).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

SENSITIVE = "sensitive"  # the JSON Schema keyword that marks a value sensitive
SEALED = "$saga-sealed:"  # how a value sealed at rest begins (orchestrator/sealing.py)
WITHHELD = "(a sensitive value, withheld)"
MIN_SCRUBBED_CHARS = 4  # shorter values are replaced where they are a whole value, not inside texts
#: Fields a document shows that are never a value a run was given or made (ids, times, states, names):
#: left as they are, so that a sensitive value that happens to equal one ("failed", "2024") neither
#: garbles them nor, by the marker standing where it stands, tells what the value is.
STRUCTURAL = frozenset(
    {
        "run_id", "message_id", "request", "id", "seq", "at", "created_at", "finished_at", "updated_at",
        "created", "updated", "finished", "state", "status", "intent", "kind", "stage", "attempt", "item",
        "fence", "digest", "shard", "definition", "version", "tenant", "queue", "origin", "type", "order",
        "branch", "next", "contract", "reason_code", "amqp_message_id", "death_count", "delivery_count",
        "key_id", "issued_at_ms", "deadline_ms", "signature", "versions", "engine", "plan", "items",
    }
)  # fmt: skip
#: Fields that hold what a run was given or made (a context, an input, a result, a message's body): every
#: field below one is scrubbed, whatever its name.
VALUES = frozenset({"context", "input", "result", "output", "body", "error", "detail", "headers"})
_MAX_DEPTH = 64


def is_sensitive(schema: Any) -> bool:
    return isinstance(schema, Mapping) and schema.get(SENSITIVE) is True


def marks_any(schema: Any, root: Any = None, depth: int = 0) -> bool:
    """Whether ``schema`` marks anything sensitive."""
    root = schema if root is None else root
    if depth > _MAX_DEPTH or not isinstance(schema, Mapping):
        return False
    if is_sensitive(schema):
        return True
    return any(marks_any(sub, root, depth + 1) for sub in _subschemas(schema, root))


def _subschemas(schema: Mapping[str, Any], root: Any) -> list[Any]:
    found: list[Any] = []
    for key in ("properties", "patternProperties", "$defs", "definitions"):
        if isinstance(schema.get(key), Mapping):
            found += list(schema[key].values())
    for key in ("items", "additionalProperties", "not"):
        if isinstance(schema.get(key), Mapping):
            found.append(schema[key])
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        if isinstance(schema.get(key), list):
            found += schema[key]
    return found


def _resolved(schema: Any, root: Any) -> Any:
    """``schema`` with a local ``$ref`` (``#/$defs/Name``, as pydantic writes nested models) followed."""
    for _ in range(_MAX_DEPTH):
        if not isinstance(schema, Mapping) or not isinstance(schema.get("$ref"), str):
            return schema
        ref = schema["$ref"]
        if not ref.startswith("#/"):
            return schema
        target: Any = root
        for part in ref[2:].split("/"):
            target = target.get(part) if isinstance(target, Mapping) else None
        if target is None:
            return schema
        merged = {k: v for k, v in schema.items() if k != "$ref"}
        schema = {**target, **merged}
    return schema


def sensitive_values(value: Any, schema: Any, root: Any = None, depth: int = 0) -> list[Any]:
    """The values (every scalar) in ``value`` at the places ``schema`` marks sensitive."""
    root = schema if root is None else root
    schema = _resolved(schema, root)
    if depth > _MAX_DEPTH or not isinstance(schema, Mapping):
        return []
    if is_sensitive(schema):
        return _scalars(value)
    found: list[Any] = []
    for key in ("anyOf", "oneOf", "allOf"):
        for sub in schema.get(key) or []:
            found += sensitive_values(value, sub, root, depth + 1)
    if isinstance(value, Mapping):
        properties = schema.get("properties") if isinstance(schema.get("properties"), Mapping) else {}
        extra = schema.get("additionalProperties")
        for name, item in value.items():
            sub = (properties or {}).get(name, extra if isinstance(extra, Mapping) else None)
            found += sensitive_values(item, sub, root, depth + 1)
    elif isinstance(value, list):
        items, prefix = schema.get("items"), schema.get("prefixItems")
        for index, item in enumerate(value):
            sub = prefix[index] if isinstance(prefix, list) and index < len(prefix) else items
            found += sensitive_values(item, sub, root, depth + 1)
    return found


def path_is_sensitive(schema: Any, path: Iterable[Any]) -> bool:
    """Whether the value at ``path`` (keys and indices, as a validation error's ``absolute_path``) of a
    document ``schema`` describes is sensitive, is inside one that is, or holds one (an error about an
    object or a list quotes all of it)."""
    root, node = schema, _resolved(schema, schema)
    for part in path:
        if not isinstance(node, Mapping):
            return False
        if is_sensitive(node) or any(is_sensitive(_resolved(s, root)) for s in _alternatives(node)):
            return True
        if isinstance(part, int):
            prefix = node.get("prefixItems")
            node = prefix[part] if isinstance(prefix, list) and part < len(prefix) else node.get("items")
        else:
            properties = node.get("properties")
            extra = node.get("additionalProperties")
            found = properties.get(part) if isinstance(properties, Mapping) else None
            node = found if found is not None else extra
        node = _resolved(node, root)
    return _marks_resolved(node, root)


def _marks_resolved(schema: Any, root: Any, depth: int = 0) -> bool:
    """Whether ``schema`` or any schema inside it (``$ref``s followed) marks a value sensitive."""
    schema = _resolved(schema, root)
    if depth > _MAX_DEPTH or not isinstance(schema, Mapping):
        return False
    if is_sensitive(schema):
        return True
    return any(
        _marks_resolved(sub, root, depth + 1) for sub in _subschemas(schema, root) if sub is not schema
    )


def _alternatives(schema: Mapping[str, Any]) -> list[Any]:
    return [s for key in ("anyOf", "oneOf", "allOf") for s in schema.get(key) or []]


def _scalars(value: Any) -> list[Any]:
    if isinstance(value, Mapping):
        return [s for item in value.values() for s in _scalars(item)]
    if isinstance(value, list):
        return [s for item in value for s in _scalars(item)]
    if value is None or isinstance(value, bool):
        return []  # too common to tell anything, and never worth hiding on their own
    return [value]


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


@dataclass(frozen=True)
class Redactor:
    """Replaces ``secrets`` (scalars) wherever they appear in a document: a whole value, or (at least
    ``MIN_SCRUBBED_CHARS`` long) inside a text. ``key``: the marker's HMAC key (None: a marker without a
    hash)."""

    secrets: frozenset[str]
    key: bytes | None = None

    @classmethod
    def of(cls, values: Iterable[Any], key: bytes | None = None) -> Redactor:
        return cls(frozenset(_text(v) for v in values if _text(v)), key)

    def __bool__(self) -> bool:
        return bool(self.secrets)

    def marker(self, value: Any) -> str:
        if self.key is None:
            return "[sensitive]"
        digest = hmac.new(self.key, _text(value).encode(), hashlib.sha256).hexdigest()[:8]
        return f"[sensitive:{digest}]"

    def scrub(self, document: Any) -> Any:
        """``document`` with every secret replaced by its marker (and every value sealed at rest that
        could not be opened, by a bare one)."""
        if not self.secrets and SEALED not in json.dumps(document, default=str):
            return document
        inside = sorted((s for s in self.secrets if len(s) >= MIN_SCRUBBED_CHARS), key=len, reverse=True)
        return self._scrub(document, inside, structural=True)

    def _scrub(self, node: Any, inside: list[str], *, structural: bool) -> Any:
        """``structural``: ``node`` is a document's own fields (above any value a run was given or made),
        whose ``STRUCTURAL`` ones are left as they are; below a ``VALUES`` field, nothing is."""
        if isinstance(node, Mapping):
            return {
                key: value
                if structural and key in STRUCTURAL
                else self._scrub(value, inside, structural=structural and key not in VALUES)
                for key, value in node.items()
            }
        if isinstance(node, (list, tuple)):
            return [self._scrub(value, inside, structural=structural) for value in node]
        if node is None or isinstance(node, bool) or (structural and not isinstance(node, str)):
            return node  # a document's own numbers (counts, delays, attempts) are never a value it was given
        text = _text(node)
        if text in self.secrets:
            return self.marker(node)
        if isinstance(node, str) and node.startswith(SEALED):
            return "[sensitive]"  # sealed, and not opened here (no data key): it still says what it is
        if isinstance(node, str):
            for secret in inside:
                if secret in node:
                    node = node.replace(secret, self.marker(secret))
        return node


def run_secrets(context: Any, results: Mapping[str, Any], plan: Mapping[str, Any]) -> list[Any]:
    """A run's sensitive values: in its context (the plan's context schema) and in each stage's result
    (its contract's output schema; a map's, each item's)."""
    found = sensitive_values(context, plan.get("context"))
    contracts = plan.get("contracts") or {}
    stages = plan.get("stages") or {}
    for name, result in results.items():
        spec = stages.get(name) or {}
        ref = spec.get("action") or spec.get("worker")
        schema = (contracts.get(ref) or {}).get("output_schema") if ref else None
        if schema is None or not marks_any(schema):
            continue
        if spec.get("type") == "map" and isinstance(result, list):
            found += [v for item in result for v in sensitive_values(item, schema)]
        else:
            found += sensitive_values(result, schema)
    return found


def letter_secrets(fields: Mapping[str, Any], plan: Mapping[str, Any]) -> list[Any]:
    """The sensitive values a message (an envelope's fields) carries, by the schema ``plan`` (its run's)
    gives its body: a start's context, a task's input, a result's result."""
    body = fields.get("body")
    if not isinstance(body, Mapping):
        return []
    contract = (plan.get("contracts") or {}).get(fields.get("contract") or "") or {}
    kind = fields.get("kind")
    if kind == "start":
        return sensitive_values(body.get("context"), plan.get("context"))
    if kind == "task":
        return sensitive_values(body.get("input"), contract.get("input_schema"))
    if kind == "result":
        return sensitive_values(body.get("result"), contract.get("output_schema"))
    return []

"""Results checked at the door: a worker's successful result must fit the output schema of the contract
version the run's plan pins, before it becomes state. Pure.

The worker SDK checks its own handlers' output, but a signature says only who sent a report, not that the
sender ran the SDK: a worker in another language, an old release, or a bug in a runtime could report any
value, and a result that became state is read by every later binding, decision and the run's output. A
result that does not fit is what the SDK reports when its own check fails: a permanent failure of the
attempt (no retry mends a handler that breaks its contract), here with the paths and messages of the
schema errors, bounded in length.

Compiled validators are cached: this is on the path of every result. Plans are cached by digest for a
process's life, so the same schema object comes back for every result of a contract version and is found
by identity; a plan loaded again finds its schema's validator by the schema's canonical text.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import jsonschema
from jsonschema.exceptions import UnknownType
from referencing.exceptions import Unresolvable

from orchestrator.dsl.fastcheck import certainly_fits
from orchestrator.engine.plan import Plan
from orchestrator.redaction import WITHHELD, path_is_sensitive
from orchestrator.wire import sizes

__all__ = ["output_problem", "output_validator"]

MAX_SHOWN_ERRORS = 3  # the first few, in path order: enough to mend the handler, bounded for history
MAX_MESSAGE_CHARS = 240  # a schema error's message quotes the offending value, which may be huge
MAX_CACHED = 4096  # distinct schemas per process; far more than any registry of contract versions

Validator = jsonschema.Draft202012Validator

_BY_IDENTITY: dict[int, tuple[Mapping[str, Any], Validator | str]] = {}
_BY_TEXT: dict[str, Validator | str] = {}


def output_validator(schema: Mapping[str, Any]) -> Validator | str:
    """The compiled validator of ``schema`` (a str: why the schema cannot check anything)."""
    cached = _BY_IDENTITY.get(id(schema))
    if cached is not None and cached[0] is schema:
        return cached[1]
    text = json.dumps(schema, sort_keys=True, separators=(",", ":"))
    validator = _BY_TEXT.get(text)
    if validator is None:
        validator = _compile(schema)
        if len(_BY_TEXT) >= MAX_CACHED:
            _BY_TEXT.clear()
        _BY_TEXT[text] = validator
    if len(_BY_IDENTITY) >= MAX_CACHED:
        _BY_IDENTITY.clear()
    # the schema stays referenced by its entry, so its id is never reused for another object
    _BY_IDENTITY[id(schema)] = (schema, validator)
    return validator


def _compile(schema: Mapping[str, Any]) -> Validator | str:
    try:
        Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        return f"it is not a valid JSON Schema ({_short(exc.message)})"
    return Validator(schema)


def output_problem(plan: Plan, ref: str, result: Any) -> str | None:
    """Why ``result`` does not fit the output schema of contract ``ref`` in ``plan`` (None: it fits, or
    the plan pins no output schema for ``ref``)."""
    contract = plan.contracts.get(ref)
    schema = contract.output_schema if contract is not None else None
    if not isinstance(schema, Mapping):
        return None
    validator = output_validator(schema)
    if isinstance(validator, str):
        return f"the output schema of {ref} cannot check results: {validator}"
    if certainly_fits(schema, result):
        return None
    try:
        errors = sorted(validator.iter_errors(result), key=_path_order)
    except (UnknownType, Unresolvable) as exc:  # a schema that passed the meta-schema, but cannot run
        return f"the output schema of {ref} cannot check results: {_short(str(exc))}"
    if not errors:
        return None
    shown = "; ".join(f"{_where(e)}: {_message(schema, e)}" for e in errors[:MAX_SHOWN_ERRORS])
    more = len(errors) - MAX_SHOWN_ERRORS
    tail = f" (and {more} more)" if more > 0 else ""
    return sizes.bounded(f"the result does not fit the output schema of {ref}: {shown}{tail}")


def _message(schema: Mapping[str, Any], error: jsonschema.ValidationError) -> str:
    """The error's message; for a sensitive place, one that does not quote the value (it would go to the
    run's history)."""
    if path_is_sensitive(schema, error.absolute_path):
        return f"{WITHHELD} fails '{error.validator}'"
    return _short(error.message)


def _where(error: jsonschema.ValidationError) -> str:
    """``result.tags[2]``: where in the result the error is (as binding errors name their targets)."""
    return "result" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)


def _path_order(error: jsonschema.ValidationError) -> list[tuple[int, int, str]]:
    """A total order on error paths: indices numerically, names alphabetically (never int vs str)."""
    return [(0, p, "") if isinstance(p, int) else (1, 0, str(p)) for p in error.absolute_path]


def _short(text: str) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= MAX_MESSAGE_CHARS else flat[: MAX_MESSAGE_CHARS - 1] + "…"

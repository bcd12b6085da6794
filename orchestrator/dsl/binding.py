"""Layer 4, runtime binding: turn a stage's ``input`` template into a value, with distinct errors.

A missing value, a null and a wrong type are three different failures (:class:`BindingMissing`,
:class:`BindingNull`, :class:`BindingWrongType`), because they have different causes and fixes: a
missing context field is the caller's omission, a null is a value somebody wrote, a wrong type is a
contract mismatch. Plain paths (``context.a.b``) are walked here so the three cases are told apart
exactly; any other expression is evaluated by CEL and its errors are mapped the same way.
Pure: the variables are passed in.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import cel
import jsonschema

from orchestrator.dsl.expressions import (
    Binding,
    Expr,
    ExpressionSyntaxError,
    compile_cel,
    parse_template,
    plain_path,
    references,
    tokenize,
)
from orchestrator.dsl.fastcheck import certainly_fits
from orchestrator.errors import (
    BindingEvaluationError,
    BindingMissing,
    BindingNull,
    BindingWrongType,
)

Schema = dict[str, Any]


def bind(template: Any, variables: dict[str, Any], schema: Schema | None, target: str) -> Any:
    """Resolve every ``${...}`` in ``template`` and check the result against ``schema`` (if given)."""
    value = _resolve(template, variables, target)
    if schema is not None:
        _check(value, schema, target, template)
    return value


def _resolve(template: Any, variables: dict[str, Any], target: str) -> Any:
    if isinstance(template, dict):
        return {k: _resolve(v, variables, f"{target}.{k}") for k, v in template.items()}
    if isinstance(template, list):
        return [_resolve(v, variables, f"{target}[{i}]") for i, v in enumerate(template)]
    if not isinstance(template, str):
        return template
    parsed = parse_template(template)
    if not isinstance(parsed, Binding):
        return parsed
    if parsed.whole:
        return evaluate(parsed.whole.source, variables, target)
    return "".join(_render(p, variables, target) for p in parsed.parts)


def _render(part: str | Expr, variables: dict[str, Any], target: str) -> str:
    if isinstance(part, str):
        return part
    value = evaluate(part.source, variables, target)
    if value is None:
        raise BindingNull(target, part.source, "is null and cannot be written into text")
    if isinstance(value, dict | list):
        raise BindingWrongType(target, part.source, f"is a {type(value).__name__}; text takes a scalar")
    return str(value).lower() if isinstance(value, bool) else str(value)


_CONTEXT: list[tuple[dict[str, Any], frozenset[str], cel.Context]] = []


@lru_cache(maxsize=4096)
def _reads(src: str) -> frozenset[str]:
    """The variables an expression reads (macro-bound names included; they are simply not found)."""
    return frozenset(compile_cel(src).variables())


def _context(variables: dict[str, Any], names: frozenset[str]) -> cel.Context:
    """Converting variables to CEL values costs more than most evaluations, so only the variables the
    expression reads are converted (a map item's input converts the item, not the whole context), and
    expressions of one binding or decision reading the same ones share the converted context. The
    engine builds a fresh variables dict per use and never mutates it; holding it here keeps its id
    from being reused."""
    if _CONTEXT and _CONTEXT[0][0] is variables and _CONTEXT[0][1] == names:
        return _CONTEXT[0][2]
    context = cel.Context(variables={k: v for k, v in variables.items() if k in names})
    _CONTEXT[:] = [(variables, names, context)]
    return context


def evaluate(src: str, variables: dict[str, Any], target: str) -> Any:
    """Evaluate one expression against ``variables``, mapping failures to the binding errors."""
    ref = plain_path(src)
    if ref is not None:
        return _walk(src, ref.root, ref.path, variables, target)
    try:
        return compile_cel(src).execute(_context(variables, _reads(src)))
    except Exception as exc:  # CEL raises ValueError, ZeroDivisionError, ...; all are this expression's fault
        _diagnose(src, variables, target, exc)
        if isinstance(exc, KeyError | IndexError):
            raise BindingMissing(target, src, f"a referenced value does not exist ({exc})") from exc
        if isinstance(exc, TypeError):
            raise BindingWrongType(target, src, f"{str(exc).splitlines()[0][:160]}") from exc
        if isinstance(exc, RuntimeError) and str(exc).startswith("Undefined variable"):
            raise BindingMissing(target, src, str(exc).split(".")[0]) from exc
        raise BindingEvaluationError(target, src, f"{type(exc).__name__}: {exc}") from exc


def _diagnose(src: str, variables: dict[str, Any], target: str, exc: Exception) -> None:
    """CEL's errors do not say which operand was missing or null: walk the expression's plain
    references and raise BindingMissing / BindingNull / BindingWrongType for the first that is."""
    try:
        refs = references(tokenize(src), frozenset(variables))
    except ExpressionSyntaxError:
        return
    for ref in refs:
        if ref.guarded:
            continue
        if _walk(src, ref.root, ref.path, variables, target) is None:
            raise BindingNull(target, src, f"{ref.render()} is null") from exc


def _walk(src: str, root: str, path: tuple[str | int, ...], variables: dict[str, Any], target: str) -> Any:
    if root not in variables:
        raise BindingMissing(target, src, f"{root!r} is not defined here")
    value = variables[root]
    where = root
    for key in path:
        if value is None:
            raise BindingNull(target, src, f"{where} is null, so it has no {key!r}")
        if isinstance(value, dict) and isinstance(key, str):
            if key not in value:
                raise BindingMissing(target, src, f"{where} has no field {key!r}")
            value = value[key]
        elif isinstance(value, list) and isinstance(key, int):
            if key >= len(value):
                raise BindingMissing(
                    target, src, f"{where} has {len(value)} items; index {key} does not exist"
                )
            value = value[key]
        else:
            raise BindingWrongType(target, src, f"{where} is a {_json_type(value)}; cannot select {key!r}")
        where = f"{where}[{key}]" if isinstance(key, int) else f"{where}.{key}"
    return value


def _check(value: Any, schema: Schema, target: str, template: Any) -> None:
    if certainly_fits(schema, value):
        return
    validator = validator_for(schema)
    for error in sorted(validator.iter_errors(value), key=lambda e: list(e.absolute_path)):
        where = target + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)
        src = _source_at(template, list(error.absolute_path))
        if error.instance is None:
            raise BindingNull(where, src, "is null, but the contract requires a value")
        if error.validator == "required":
            raise BindingMissing(where, src, error.message)
        raise BindingWrongType(where, src, error.message)


def _source_at(template: Any, path: list[Any]) -> str:
    """The expression that produced the value at ``path`` (a whole ``${...}``), or "" for a literal."""
    node = template
    for key in path:
        if isinstance(node, str):
            break
        if isinstance(node, dict | list) and (key in node if isinstance(node, dict) else key < len(node)):
            node = node[key]
        else:
            return ""
    parsed = parse_template(node) if isinstance(node, str) else None
    whole = parsed.whole if isinstance(parsed, Binding) else None
    return whole.source if whole else ""


_VALIDATORS: dict[int, tuple[Schema, jsonschema.Draft202012Validator]] = {}


def validator_for(schema: Schema) -> jsonschema.Draft202012Validator:
    """Validators are costly to build; plans (and so their schemas) live for the process: cache by
    identity, keeping the schema referenced so its id is never reused for another object."""
    cached = _VALIDATORS.get(id(schema))
    if cached is not None and cached[0] is schema:
        return cached[1]
    if len(_VALIDATORS) > 4096:
        _VALIDATORS.clear()
    validator = jsonschema.Draft202012Validator(schema)
    _VALIDATORS[id(schema)] = (schema, validator)
    return validator


def _json_type(value: Any) -> str:
    return {
        dict: "object",
        list: "array",
        str: "string",
        bool: "boolean",
        int: "integer",
        float: "number",
    }.get(type(value), type(value).__name__)

"""CEL expressions and ``${...}`` bindings: parsing, static bounds, and the references they make.

Expressions are CEL, compiled by ``common-expression-language`` (a sandbox: no Python is reachable unless a
function is registered, and we register none). On top of parsing we bound every expression statically:
source length, nesting depth, number of comprehension macros, the functions it may call and the variables
it may read. A short tokenizer finds the references an expression makes (``context.a.b``,
``stages["x"].result.y``) so the compiler can check them against schemas; CEL's own library exposes no
syntax tree.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache

import cel

from orchestrator.dsl.paths import Path

# Operator overloads CEL reports under internal names, plus the named functions an author may call.
# Everything is pure and bounded; no function reaches outside the expression's inputs.
ALLOWED_FUNCTIONS = frozenset(
    {
        "_==_", "_!=_", "_<_", "_<=_", "_>_", "_>=_", "_&&_", "_||_", "_+_", "_-_", "_*_", "_/_", "_%_",
        "!_", "-_", "_[_]", "_?_:_", "@in", "@not_strictly_false",
        "size", "int", "uint", "double", "string", "bytes", "bool", "type", "dyn",
        "timestamp", "duration", "contains", "startsWith", "endsWith", "matches",
    }
)  # fmt: skip
MACROS = frozenset({"has", "all", "exists", "exists_one", "map", "filter"})
_LITERALS = frozenset({"true", "false", "null"})
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class ExpressionLimits:
    max_chars: int = 1_000
    max_depth: int = 16
    max_macros: int = 4


@dataclass(frozen=True)
class Token:
    kind: str  # "ident" | "str" | "num" | "op"
    text: str


@dataclass(frozen=True)
class Reference:
    """A path an expression reads, e.g. ``stages["render"].result.uri`` -> root ``stages``, path
    ``("render", "result", "uri")``. ``guarded`` is true when the expression also uses ``has(...)``."""

    root: str
    path: tuple[str | int, ...]
    guarded: bool

    def render(self) -> str:
        out = self.root
        for part in self.path:
            out += f"[{part}]" if isinstance(part, int) else f'["{part}"]' if "-" in part else f".{part}"
        return out


class ExpressionSyntaxError(ValueError):
    """Raised by :func:`tokenize` for an unterminated string literal."""


def tokenize(src: str) -> list[Token]:
    """Split CEL source into identifiers, string and number literals and single-char operators."""
    tokens: list[Token] = []
    i, n = 0, len(src)
    while i < n:
        c = src[i]
        if c.isspace():
            i += 1
        elif c in "\"'" or (c in "rRbB" and i + 1 < n and src[i + 1] in "\"'"):
            i, text = _string_literal(src, i)
            tokens.append(Token("str", text))
        elif c.isalpha() or c == "_":
            m = _IDENT.match(src, i)
            assert m is not None  # c starts an identifier
            tokens.append(Token("ident", m.group()))
            i = m.end()
        elif c.isdigit():
            j = i
            while j < n and (src[j].isalnum() or src[j] == "."):
                j += 1
            tokens.append(Token("num", src[i:j]))
            i = j
        else:
            tokens.append(Token("op", c))
            i += 1
    return tokens


def _string_literal(src: str, start: int) -> tuple[int, str]:
    i = start
    raw = False
    while src[i] in "rRbB":
        raw = raw or src[i] in "rR"
        i += 1
    quote = src[i : i + 3] if src[i : i + 3] in ('"""', "'''") else src[i]
    i += len(quote)
    out: list[str] = []
    while i < len(src):
        if src.startswith(quote, i):
            return i + len(quote), "".join(out)
        if src[i] == "\\" and not raw and i + 1 < len(src):
            out.append(src[i + 1])
            i += 2
            continue
        out.append(src[i])
        i += 1
    raise ExpressionSyntaxError(f"unterminated string literal starting at column {start + 1}")


def nesting_depth(tokens: list[Token]) -> int:
    depth = deepest = 0
    for tok in tokens:
        if tok.kind == "op" and tok.text in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif tok.kind == "op" and tok.text in ")]}":
            depth -= 1
    return deepest


def macro_count(tokens: list[Token]) -> int:
    return sum(
        1
        for i, tok in enumerate(tokens[:-1])
        if tok.kind == "ident" and tok.text in MACROS and tokens[i + 1].text == "("
    )


def macro_variables(tokens: list[Token]) -> set[str]:
    """Names bound by comprehension macros, e.g. ``x`` in ``list.all(x, x > 0)``."""
    bound = set()
    for i in range(len(tokens) - 3):
        if (
            tokens[i].kind == "ident"
            and tokens[i].text in MACROS - {"has"}
            and tokens[i + 1].text == "("
            and tokens[i + 2].kind == "ident"
            and tokens[i + 3].text == ","
        ):
            bound.add(tokens[i + 2].text)
    return bound


def references(tokens: list[Token], roots: frozenset[str]) -> list[Reference]:
    """Every selection chain that starts at one of ``roots`` (not itself a field or a call)."""
    # A read is guarded only by a has(...) on the same root and the same first two selectors
    # (for stages: the same stage's result), not by a has(...) anywhere in the expression.
    guards = {
        (tokens[i + 2].text, _selectors(tokens, i + 3)[:2])
        for i in range(len(tokens) - 2)
        if tokens[i].kind == "ident"
        and tokens[i].text == "has"
        and tokens[i + 1].text == "("
        and tokens[i + 2].kind == "ident"
    }
    refs = []
    for i, tok in enumerate(tokens):
        if tok.kind != "ident" or tok.text not in roots:
            continue
        if i > 0 and tokens[i - 1].text == ".":
            continue  # a field named like a root: a.context
        if i + 1 < len(tokens) and tokens[i + 1].text == "(":
            continue  # a call, not a variable
        path = _selectors(tokens, i + 1)
        refs.append(Reference(tok.text, path, (tok.text, path[:2]) in guards))
    return refs


def _selectors(tokens: list[Token], i: int) -> tuple[str | int, ...]:
    path: list[str | int] = []
    while i < len(tokens):
        if tokens[i].text == "." and i + 1 < len(tokens) and tokens[i + 1].kind == "ident":
            if i + 2 < len(tokens) and tokens[i + 2].text == "(":
                break  # a method call such as .size()
            path.append(tokens[i + 1].text)
            i += 2
        elif (
            tokens[i].text == "["
            and i + 2 < len(tokens)
            and tokens[i + 1].kind in ("str", "num")
            and tokens[i + 2].text == "]"
        ):
            lit = tokens[i + 1]
            path.append(lit.text if lit.kind == "str" else int(lit.text) if lit.text.isdigit() else lit.text)
            i += 3
        else:
            break
    return tuple(path)


@dataclass(frozen=True)
class CheckedExpression:
    source: str
    references: tuple[Reference, ...]
    is_plain_path: bool  # the whole expression is one reference (its type can be inferred statically)


def check_expression(
    src: str, variables: frozenset[str], limits: ExpressionLimits
) -> tuple[CheckedExpression | None, list[str]]:
    """Compile and bound one expression. Returns it with its references, or the problems found."""
    if len(src) > limits.max_chars:
        return None, [f"expression is {len(src)} characters, over the {limits.max_chars} limit"]
    if not src.strip():
        return None, ["expression is empty"]
    try:
        tokens = tokenize(src)
        program = compile_cel(src)
    except (ValueError, ExpressionSyntaxError) as exc:
        return None, [f"invalid CEL expression {src!r}: {_first_line(str(exc))}"]
    problems = []
    depth = nesting_depth(tokens)
    if depth > limits.max_depth:
        problems.append(f"expression nests {depth} levels deep, over the {limits.max_depth} limit")
    macros = macro_count(tokens)
    if macros > limits.max_macros:
        problems.append(f"expression uses {macros} comprehension macros, over the {limits.max_macros} limit")
    for fn in program.functions():
        if fn not in ALLOWED_FUNCTIONS:
            problems.append(f"function {fn!r} is not available in expressions")
    unknown = set(program.variables()) - variables - macro_variables(tokens)
    for name in sorted(unknown):
        problems.append(f"unknown variable {name!r} (available: {', '.join(sorted(variables))})")
    if problems:
        return None, problems
    refs = tuple(references(tokens, variables))
    plain = len(refs) == 1 and _is_single_chain(tokens, refs[0])
    return CheckedExpression(src, refs, plain), []


def _is_single_chain(tokens: list[Token], ref: Reference) -> bool:
    return bool(tokens) and tokens[0].text == ref.root and len(tokens) == 1 + _chain_length(tokens, 1)


def _chain_length(tokens: list[Token], i: int) -> int:
    start = i
    while i < len(tokens):
        if tokens[i].text == "." and i + 1 < len(tokens) and tokens[i + 1].kind == "ident":
            i += 2
        elif tokens[i].text == "[" and i + 2 < len(tokens) and tokens[i + 2].text == "]":
            i += 3
        else:
            break
    return i - start


@lru_cache(maxsize=4096)
def compile_cel(src: str) -> cel.Program:
    """Compile once per distinct source; programs are immutable and reusable."""
    return cel.compile(src)


def _first_line(text: str) -> str:
    """CEL's parse errors read "Failed to parse expression '…': ERROR: <input>:1:4: Syntax error: …"."""
    first = text.strip().splitlines()[0] if text.strip() else "syntax error"
    _, marker, detail = first.partition("ERROR: <input>:")
    return f"at {detail.strip()}" if marker else first


# ---- ${...} bindings ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Binding:
    """A string value that contains ``${...}``. ``whole`` means the string is exactly one binding and
    yields the expression's typed value; otherwise each part is rendered into a string."""

    parts: tuple[str | Expr, ...]

    @property
    def whole(self) -> Expr | None:
        """The expression when the string is exactly one ``${...}``, else ``None``."""
        only = self.parts[0] if len(self.parts) == 1 else None
        return only if isinstance(only, Expr) else None

    def expressions(self) -> list[Expr]:
        return [p for p in self.parts if isinstance(p, Expr)]


@dataclass(frozen=True)
class Expr:
    source: str


class BindingSyntaxError(ValueError):
    """Raised for a ``${`` without its closing ``}``."""


@lru_cache(maxsize=4096)
def parse_template(text: str) -> Binding | str:
    """Split a string into literal text and ``${expr}`` parts; ``$${`` writes a literal ``${``.

    Cached: the engine binds a plan's same few templates on every transition, and the parts are
    immutable."""
    if "${" not in text:
        return text
    parts: list[str | Expr] = []
    buf: list[str] = []
    i = 0
    while i < len(text):
        if text.startswith("$${", i):
            buf.append("${")
            i += 3
        elif text.startswith("${", i):
            end = _closing_brace(text, i + 2)
            if buf:
                parts.append("".join(buf))
                buf = []
            parts.append(Expr(text[i + 2 : end].strip()))
            i = end + 1
        else:
            buf.append(text[i])
            i += 1
    if buf:
        parts.append("".join(buf))
    if not any(isinstance(p, Expr) for p in parts):
        return "".join(p for p in parts if isinstance(p, str))
    return Binding(tuple(parts))


def _closing_brace(text: str, i: int) -> int:
    depth = 0
    quote: str | None = None
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = None
        elif c in "\"'":
            quote = c
        elif c == "{":
            depth += 1
        elif c == "}":
            if depth == 0:
                return i
            depth -= 1
        i += 1
    raise BindingSyntaxError("'${' has no closing '}'")


def walk_strings(value: object, path: Path) -> Iterator[tuple[Path, str]]:
    """Every string inside a JSON value, with its path (for finding bindings in stage inputs)."""
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from walk_strings(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from walk_strings(item, (*path, index))


@lru_cache(maxsize=4096)
def plain_path(src: str) -> Reference | None:
    """The reference when the whole expression is a single selection chain (``context.a["b"][0]``)."""
    try:
        tokens = tokenize(src)
    except ExpressionSyntaxError:
        return None
    if not tokens or tokens[0].kind != "ident" or tokens[0].text in _LITERALS:
        return None
    refs = references(tokens, frozenset({tokens[0].text}))
    return refs[0] if len(refs) == 1 and _is_single_chain(tokens, refs[0]) else None

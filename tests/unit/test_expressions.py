"""CEL expressions and ``${...}`` templates: the tokenizer, the references an expression makes, plain
paths, template parsing, and the static bounds ``check_expression`` applies."""

from __future__ import annotations

import pytest

from orchestrator.dsl.expressions import (
    Binding,
    BindingSyntaxError,
    Expr,
    ExpressionLimits,
    ExpressionSyntaxError,
    Reference,
    Token,
    check_expression,
    macro_count,
    macro_variables,
    nesting_depth,
    parse_template,
    plain_path,
    references,
    tokenize,
    walk_strings,
)

ROOTS = frozenset({"context", "stages"})
LIMITS = ExpressionLimits()


def _texts(src: str) -> list[str]:
    return [t.text for t in tokenize(src)]


def _refs(src: str, roots: frozenset[str] = ROOTS) -> list[Reference]:
    return references(tokenize(src), roots)


# ---- tokenizer ------------------------------------------------------------------------------------


def test_tokenize_splits_identifiers_literals_and_operators() -> None:
    assert tokenize('stages["a-b"].result[0] >= 1.5') == [
        Token("ident", "stages"),
        Token("op", "["),
        Token("str", "a-b"),
        Token("op", "]"),
        Token("op", "."),
        Token("ident", "result"),
        Token("op", "["),
        Token("num", "0"),
        Token("op", "]"),
        Token("op", ">"),
        Token("op", "="),
        Token("num", "1.5"),
    ]


@pytest.mark.parametrize(
    ("src", "text"),
    [
        ('"double"', "double"),
        ("'single'", "single"),
        ('"with \\" escape"', 'with " escape'),
        ("'it\\'s'", "it's"),
        ('"""tri "quoted" ple"""', 'tri "quoted" ple'),
        ("'''tri'ple'''", "tri'ple"),
        (r'r"raw \d"', r"raw \d"),
        ("b'bytes'", "bytes"),
        ('"has ] and ) and } inside"', "has ] and ) and } inside"),
        ('"context.a"', "context.a"),
    ],
)
def test_string_literals_are_one_token(src: str, text: str) -> None:
    assert tokenize(src) == [Token("str", text)]


def test_whitespace_is_skipped_and_numbers_keep_suffixes() -> None:
    assert _texts("  a\t+\n 3u * 0x1F ") == ["a", "+", "3u", "*", "0x1F"]
    assert [t.kind for t in tokenize("_x1 42")] == ["ident", "num"]


@pytest.mark.parametrize("src", ["'open", '"open', '"""open"', "r'open", 'context.a == "x'])
def test_unterminated_string_is_a_syntax_error(src: str) -> None:
    with pytest.raises(ExpressionSyntaxError, match="unterminated string literal"):
        tokenize(src)


def test_depth_and_macros_are_counted_from_tokens() -> None:
    assert nesting_depth(tokenize("((a[0]))")) == 3
    assert nesting_depth(tokenize("{'a': [1]}")) == 2
    assert nesting_depth(tokenize("'((('")) == 0  # brackets inside strings do not count
    assert macro_count(tokenize("l.all(x, x > 0) && has(a.b) && l.map(y, y)")) == 3
    assert macro_count(tokenize("all + map")) == 0  # names without a call are not macros
    assert macro_variables(tokenize("l.all(x, x > 0) && m.exists_one(y, y) && has(z.q)")) == {"x", "y"}


# ---- references -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("src", "root", "path"),
    [
        ("context", "context", ()),
        ("context.a.b", "context", ("a", "b")),
        ('context["a"]["b-c"]', "context", ("a", "b-c")),
        ("context['a'].b", "context", ("a", "b")),
        ("context.items[2].id", "context", ("items", 2, "id")),
        ('stages["render"].result.uri', "stages", ("render", "result", "uri")),
        ("stages.render.state", "stages", ("render", "state")),
        ("context.a.size()", "context", ("a",)),  # a method call ends the chain
        ("context.a[context.i]", "context", ("a",)),  # a computed index ends the chain
    ],
)
def test_a_reference_follows_dot_and_bracket_selectors(src: str, root: str, path: tuple[object, ...]) -> None:
    assert _refs(src)[0] == Reference(root, path, guarded=False)


def test_every_root_occurrence_is_a_reference_but_fields_calls_and_strings_are_not() -> None:
    src = 'context.a + stages["s"].result.n + x.context + context(1) + "context.b" + item.y'
    assert _refs(src) == [
        Reference("context", ("a",), False),
        Reference("stages", ("s", "result", "n"), False),
    ]
    assert [r.root for r in _refs(src, ROOTS | {"item"})] == ["context", "stages", "item"]


def test_references_are_guarded_when_the_expression_uses_has() -> None:
    refs = _refs('has(stages["a"].result) && stages["a"].result.hit')
    assert [r.path for r in refs] == [("a", "result"), ("a", "result", "hit")]
    assert all(r.guarded for r in refs)
    assert not any(r.guarded for r in _refs("context.has_x && context.y"))


def test_reference_render_uses_brackets_only_where_needed() -> None:
    assert Reference("stages", ("a-b", "result", 0, "x"), False).render() == 'stages["a-b"].result[0].x'
    assert Reference("context", (), False).render() == "context"


# ---- plain_path ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("src", "expected"),
    [
        ("context.a.b", Reference("context", ("a", "b"), False)),
        ('stages["x"].result.y', Reference("stages", ("x", "result", "y"), False)),
        ("context.l[0]", Reference("context", ("l", 0), False)),
        ("item", Reference("item", (), False)),
        ("  context . a  ", Reference("context", ("a",), False)),
    ],
)
def test_plain_path_recognises_a_single_selection_chain(src: str, expected: Reference) -> None:
    assert plain_path(src) == expected


@pytest.mark.parametrize(
    "src",
    [
        "context.a + 1",
        "context.a.size()",
        "size(context)",
        "!context.a",
        "context.a[context.b]",
        "context.a == context.b",
        "'s'",
        "1",
        "",
        "context.",
        "context['a'",
        "'open",
        "true",
        "false",
        "null",
        "{'a': 1}.a",
    ],
)
def test_plain_path_is_none_for_anything_else(src: str) -> None:
    assert plain_path(src) is None


# ---- ${...} templates -----------------------------------------------------------------------------


def test_text_without_a_binding_is_returned_as_is() -> None:
    assert parse_template("plain text") == "plain text"
    assert parse_template("costs $5 {not a binding}") == "costs $5 {not a binding}"


def test_a_whole_binding_and_text_around_bindings() -> None:
    whole = parse_template("${ context.a }")
    assert isinstance(whole, Binding) and whole.whole == Expr("context.a")
    mixed = parse_template("id-${context.a}-${index}!")
    assert isinstance(mixed, Binding) and mixed.whole is None
    assert mixed.parts == ("id-", Expr("context.a"), "-", Expr("index"), "!")
    assert mixed.expressions() == [Expr("context.a"), Expr("index")]


def test_dollar_dollar_writes_a_literal_binding() -> None:
    assert parse_template("$${context.a}") == "${context.a}"
    assert parse_template("a$${b}c") == "a${b}c"
    escaped = parse_template("$${x} then ${context.a}")
    assert isinstance(escaped, Binding) and escaped.parts == ("${x} then ", Expr("context.a"))


@pytest.mark.parametrize(
    ("text", "source"),
    [
        ("${ {'a': {'b': 1}} }", "{'a': {'b': 1}}"),
        ("${{'k': [1, {'n': 2}]}['k']}", "{'k': [1, {'n': 2}]}['k']"),
        ("${'}'}", "'}'"),
        ('${"a}b" + context.x}', '"a}b" + context.x'),
        ("${'{'}", "'{'"),
        ("${'it\\'s }'}", "'it\\'s }'"),
        ('${"}" + \'{\' + "}"}', '"}" + \'{\' + "}"'),
    ],
)
def test_closing_brace_skips_nested_braces_and_quoted_braces(text: str, source: str) -> None:
    parsed = parse_template(text)
    assert isinstance(parsed, Binding) and parsed.whole == Expr(source)


@pytest.mark.parametrize("text", ["${context.a", "x ${ {'a': 1} ", "${'}", '${"}"', "ok ${a} then ${b"])
def test_unterminated_binding_is_a_syntax_error(text: str) -> None:
    with pytest.raises(BindingSyntaxError, match="no closing"):
        parse_template(text)


def test_walk_strings_yields_every_string_with_its_path() -> None:
    value = {"a": "x", "b": [1, "y", {"c": "z"}], "d": None}
    assert list(walk_strings(value, ("input",))) == [
        (("input", "a"), "x"),
        (("input", "b", 1), "y"),
        (("input", "b", 2, "c"), "z"),
    ]


# ---- check_expression: compile and bound --------------------------------------------------------


def _problems(src: str, variables: frozenset[str] = ROOTS, limits: ExpressionLimits = LIMITS) -> list[str]:
    checked, problems = check_expression(src, variables, limits)
    assert (checked is None) == bool(problems)
    return problems


def test_a_valid_expression_is_returned_with_its_references() -> None:
    checked, problems = check_expression('stages["a"].result.n > context.min', ROOTS, LIMITS)
    assert problems == [] and checked is not None
    assert [r.root for r in checked.references] == ["stages", "context"]
    assert not checked.is_plain_path
    plain, _ = check_expression("context.a.b", ROOTS, LIMITS)
    assert plain is not None and plain.is_plain_path


def test_length_limit_is_inclusive() -> None:
    limits = ExpressionLimits(max_chars=20)
    assert _problems("1 +" + " " * 15 + " 1", limits=limits) == []  # exactly 20 characters
    assert _problems("1 +" + " " * 16 + " 1", limits=limits) == [
        "expression is 21 characters, over the 20 limit"
    ]
    assert "over the 1000 limit" in _problems("context.a + " + "1 + " * 300 + "1")[0]


@pytest.mark.parametrize("src", ["", "   ", "\n\t"])
def test_empty_expression_is_refused(src: str) -> None:
    assert _problems(src) == ["expression is empty"]


@pytest.mark.parametrize("src", ["1 +", "context.a ==", "(context.a", "context..a", "'open"])
def test_syntax_errors_are_reported_with_the_source(src: str) -> None:
    [problem] = _problems(src)
    assert problem.startswith(f"invalid CEL expression {src!r}")


def test_depth_limit_is_inclusive() -> None:
    at_limit = "(" * 16 + "true" + ")" * 16
    assert _problems(at_limit) == []
    assert _problems("(" + at_limit + ")") == ["expression nests 17 levels deep, over the 16 limit"]
    assert _problems("[[[1]]]", limits=ExpressionLimits(max_depth=2)) == [
        "expression nests 3 levels deep, over the 2 limit"
    ]


def test_macro_limit_is_inclusive() -> None:
    four = " && ".join(["context.l.all(x, x > 0)"] * 4)
    assert _problems(four) == []
    assert _problems(four + " && context.l.exists(y, y == 1)") == [
        "expression uses 5 comprehension macros, over the 4 limit"
    ]


@pytest.mark.parametrize(
    ("src", "function"),
    [
        ("now()", "now"),
        ("context.name.lowerAscii()", "lowerAscii"),
        ("context.l.sort()", "sort"),
        ("getField(context, 'a')", "getField"),
        ("context.a.exec('rm')", "exec"),
    ],
)
def test_functions_outside_the_allow_list_are_refused(src: str, function: str) -> None:
    assert f"function {function!r} is not available in expressions" in _problems(src)


@pytest.mark.parametrize(
    "src",
    [
        "size(context.l) > 0 && int('1') == 1 && double(1) > 0.5",
        "context.s.startsWith('a') || context.s.endsWith('b') || context.s.contains('c')",
        "context.s.matches('^[a-z]+$') && string(1) == '1' && bool(true)",
        "timestamp('2020-01-01T00:00:00Z') < timestamp('2021-01-01T00:00:00Z')",
        "duration('1s') > duration('0s') && uint(1) == 1u && type(1) == type(2) && dyn(1) == 1",
        "context.a in [1, 2] ? -context.b % 3 : context.c / 2",
    ],
)
def test_allowed_functions_and_operators_pass(src: str) -> None:
    assert _problems(src) == []


def test_unknown_variables_are_refused_and_the_available_ones_listed() -> None:
    assert _problems("contxt.a == 1") == ["unknown variable 'contxt' (available: context, stages)"]
    assert _problems("item + index", variables=ROOTS | {"item", "index"}) == []
    assert len(_problems("a + b")) == 2


def test_macro_bound_variables_are_allowed() -> None:
    assert _problems("context.l.all(x, x > 0)") == []
    assert _problems("context.l.map(v, v * 2).filter(w, w > 1).size() > 0") == []
    assert _problems("context.l.exists(x, x == y)") == ["unknown variable 'y' (available: context, stages)"]


def test_has_does_not_bind_a_variable() -> None:
    assert _problems("has(x.y)") == ["unknown variable 'x' (available: context, stages)"]


def test_several_problems_are_reported_together() -> None:
    src = "now() == nope"
    assert sorted(_problems(src)) == [
        "function 'now' is not available in expressions",
        "unknown variable 'nope' (available: context, stages)",
    ]

"""Runtime binding (layer 4): a missing value, a null and a wrong type are three different errors, for
plain paths and for CEL expressions alike; anything else an expression does wrong is an evaluation error.
Every error names the target being bound and the expression that failed."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from orchestrator.dsl.binding import bind, evaluate
from orchestrator.errors import (
    BindingError,
    BindingEvaluationError,
    BindingMissing,
    BindingNull,
    BindingWrongType,
    SagaError,
)
from tests.conftest import DEMO_REGISTRY

MODEL_REF = DEMO_REGISTRY.require("thumbnail.render@3").input_schema
VARIABLES: dict[str, Any] = {
    "context": {
        "modelId": "m-1",
        "count": 3,
        "zero": 0,
        "ready": True,
        "nothing": None,
        "owner": {"name": "ada", "team": None, "tags": ["a", "b"]},
        "items": [{"id": "i-0"}, {"id": None}, 7],
        "sizes": {"small-box": 1},
    },
    "stages": {"render": {"result": {"thumbnailUri": "thumbs/m-1.png"}, "state": "completed", "attempt": 1}},
    "item": "m-7",
    "index": 2,
}


def _bind(template: Any, schema: dict[str, Any] | None = None, target: str = "stages[0].input") -> Any:
    return bind(template, copy.deepcopy(VARIABLES), schema, target)


def test_the_three_failures_are_distinct_classes() -> None:
    kinds = [BindingMissing, BindingNull, BindingWrongType, BindingEvaluationError]
    for kind in kinds:
        assert issubclass(kind, BindingError) and issubclass(kind, SagaError)
        assert not any(issubclass(kind, other) for other in kinds if other is not kind)


# ---- values -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("context.modelId", "m-1"),
        ("context.owner.name", "ada"),
        ("context.owner.tags[1]", "b"),
        ('context["owner"]["tags"][0]', "a"),
        ('context.sizes["small-box"]', 1),
        ("context.items[0].id", "i-0"),
        ('stages["render"].result.thumbnailUri', "thumbs/m-1.png"),
        ('stages["render"].attempt', 1),
        ("item", "m-7"),
        ("index", 2),
        ("context.owner", {"name": "ada", "team": None, "tags": ["a", "b"]}),
        ("context.count + 1", 4),
        ("size(context.owner.tags)", 2),
        ("context.ready && context.count > 2", True),
        ('context.owner.tags.map(t, t + "!")', ["a!", "b!"]),
        ('has(context.missing) ? context.missing : "fallback"', "fallback"),
        ("context.nothing == null", True),
    ],
)
def test_a_whole_binding_yields_the_typed_value(expression: str, expected: Any) -> None:
    assert _bind("${" + expression + "}") == expected


@pytest.mark.parametrize(("expression", "expected"), [("true", True), ("false", False), ("null", None)])
def test_literal_keywords_are_values_not_variables(expression: str, expected: Any) -> None:
    """``${true}`` is CEL's literal, not a variable named ``true`` (which would be BindingMissing)."""
    assert _bind("${" + expression + "}") is expected


def test_a_whole_binding_of_null_is_the_null_value_when_nothing_requires_more() -> None:
    assert _bind("${context.nothing}") is None
    assert _bind("${context.owner.team}") is None


def test_templates_render_text_around_bindings() -> None:
    assert _bind("id-${context.modelId}-v${context.count}") == "id-m-1-v3"
    assert _bind("ready=${context.ready}") == "ready=true"
    assert _bind("${context.modelId}${context.count}") == "m-13"
    assert _bind("${item} at ${index}") == "m-7 at 2"


def test_dollar_dollar_escapes_a_literal_binding() -> None:
    assert _bind("$${context.modelId}") == "${context.modelId}"
    assert _bind("cost: $${x} for ${context.modelId}") == "cost: ${x} for m-1"


def test_structures_and_non_strings_are_bound_recursively_and_left_intact() -> None:
    template = {"a": ["${context.count}", 5, None, {"b": "x-${item}"}], "c": True}
    before = copy.deepcopy(template)
    assert _bind(template) == {"a": [3, 5, None, {"b": "x-m-7"}], "c": True}
    assert template == before


# ---- missing / null / wrong type / evaluation error -----------------------------------------------

CASES = [
    # plain paths, walked exactly
    ("${nowhere}", BindingMissing, "nowhere"),
    ("${context.absent}", BindingMissing, "context.absent"),
    ("${context.owner.absent}", BindingMissing, "context.owner.absent"),
    ("${context.owner.tags[5]}", BindingMissing, "context.owner.tags[5]"),
    ('${stages["publish"].result}', BindingMissing, 'stages["publish"].result'),
    ("${context.nothing.field}", BindingNull, "context.nothing.field"),
    ("${context.owner.team.lead}", BindingNull, "context.owner.team.lead"),
    ("${context.items[1].id.x}", BindingNull, "context.items[1].id.x"),
    ("${context.modelId.length}", BindingWrongType, "context.modelId.length"),
    ("${context.count.value}", BindingWrongType, "context.count.value"),
    ('${context.owner.tags["first"]}', BindingWrongType, 'context.owner.tags["first"]'),
    ("${context.owner[0]}", BindingWrongType, "context.owner[0]"),
    ("${context.items[2].id}", BindingWrongType, "context.items[2].id"),
    # CEL expressions: the same three cases
    ("${context.absent + 1}", BindingMissing, "context.absent + 1"),
    ("${context.owner.tags[9] + 'x'}", BindingMissing, "context.owner.tags[9] + 'x'"),
    ("${{'a': 1}['b']}", BindingMissing, "{'a': 1}['b']"),
    ("${nowhere + 1}", BindingMissing, "nowhere + 1"),
    ("${context.nothing + 1}", BindingNull, "context.nothing + 1"),
    ("${context.nothing.field == 1}", BindingNull, "context.nothing.field == 1"),
    ("${size(context.nothing)}", BindingNull, "size(context.nothing)"),
    ("${context.owner.team > 2}", BindingNull, "context.owner.team > 2"),
    ("${context.modelId + 1}", BindingWrongType, "context.modelId + 1"),
    ("${context.count + 'x'}", BindingWrongType, "context.count + 'x'"),
    ("${context.count.value == 1}", BindingWrongType, "context.count.value == 1"),
    # evaluation errors: none of the three
    ("${1 / 0}", BindingEvaluationError, "1 / 0"),
    ("${context.count / context.zero}", BindingEvaluationError, "context.count / context.zero"),
    ("${context.count % context.zero}", BindingEvaluationError, "context.count % context.zero"),
    ("${9223372036854775807 + context.count}", BindingEvaluationError, "9223372036854775807 + context.count"),
    ("${int('not a number')}", BindingEvaluationError, "int('not a number')"),
    ("${context.modelId.matches('[')}", BindingEvaluationError, "context.modelId.matches('[')"),
]


@pytest.mark.parametrize(("template", "error", "expression"), CASES, ids=[c[0] for c in CASES])
def test_each_failure_raises_its_own_error_naming_target_and_expression(
    template: str, error: type[BindingError], expression: str
) -> None:
    with pytest.raises(BindingError) as info:
        _bind({"modelId": template}, target="stages[2].input")
    assert type(info.value) is error, f"{type(info.value).__name__}: {info.value}"
    assert info.value.target == "stages[2].input.modelId"
    assert info.value.expression == expression
    message = str(info.value)
    assert "stages[2].input.modelId" in message
    assert "${" + expression + "}" in message


@pytest.mark.parametrize(
    ("template", "error", "expression"),
    [
        ("id-${context.absent}", BindingMissing, "context.absent"),
        ("id-${context.nothing}", BindingNull, "context.nothing"),
        ("id-${context.owner.team}!", BindingNull, "context.owner.team"),
        ("tags: ${context.owner.tags}", BindingWrongType, "context.owner.tags"),
        ("owner: ${context.owner}", BindingWrongType, "context.owner"),
        ("n=${1 / context.zero}", BindingEvaluationError, "1 / context.zero"),
        ("${context.modelId}-${context.nothing}", BindingNull, "context.nothing"),
    ],
)
def test_failures_inside_a_template_name_the_failing_part(
    template: str, error: type[BindingError], expression: str
) -> None:
    with pytest.raises(error) as info:
        _bind(template, target="output.label")
    assert info.value.target == "output.label"
    assert info.value.expression == expression
    assert str(info.value).startswith("output.label: ${" + expression + "}")


def test_targets_follow_the_template_structure() -> None:
    with pytest.raises(BindingMissing) as info:
        _bind({"a": [1, {"b": "${context.absent}"}]}, target="stages[1].input")
    assert info.value.target == "stages[1].input.a[1].b"


def test_a_failing_expression_is_reported_whatever_else_is_bound() -> None:
    with pytest.raises(BindingNull):
        _bind({"ok": "${context.modelId}", "bad": "${context.nothing.x}"})


def test_evaluate_is_the_single_expression_entry_point() -> None:
    assert evaluate("context.count * 2", VARIABLES, "t") == 6
    with pytest.raises(BindingMissing, match=r"^t: \$\{context\.absent\}: "):
        evaluate("context.absent", VARIABLES, "t")


# ---- checking the bound value against a contract input schema -------------------------------------


def test_a_value_that_fits_the_contract_is_returned() -> None:
    assert _bind({"modelId": "${context.modelId}"}, MODEL_REF) == {"modelId": "m-1"}
    assert _bind({"modelId": "thumb-${item}"}, MODEL_REF) == {"modelId": "thumb-m-7"}


@pytest.mark.parametrize(
    ("template", "error", "where"),
    [
        ({"modelId": "${context.nothing}"}, BindingNull, "stages[0].input.modelId"),
        ({"modelId": "${context.owner.team}"}, BindingNull, "stages[0].input.modelId"),
        ({"modelId": None}, BindingNull, "stages[0].input.modelId"),
        ({"modelId": "${context.count}"}, BindingWrongType, "stages[0].input.modelId"),
        ({"modelId": "${context.owner.tags}"}, BindingWrongType, "stages[0].input.modelId"),
        ({"modelId": ""}, BindingWrongType, "stages[0].input.modelId"),  # minLength: 1
        ({}, BindingMissing, "stages[0].input"),
        ("${context.owner.tags}", BindingWrongType, "stages[0].input"),
        ("${context.nothing}", BindingNull, "stages[0].input"),
    ],
)
def test_the_schema_check_tells_the_three_cases_apart(
    template: Any, error: type[BindingError], where: str
) -> None:
    with pytest.raises(BindingError) as info:
        _bind(template, MODEL_REF)
    assert type(info.value) is error, f"{type(info.value).__name__}: {info.value}"
    assert info.value.target == where
    assert str(info.value).startswith(where)


def test_a_missing_required_field_is_named() -> None:
    with pytest.raises(BindingMissing, match="modelId"):
        _bind({}, MODEL_REF)


@pytest.mark.parametrize(
    ("template", "error", "expression"),
    [
        ({"modelId": "${context.nothing}"}, BindingNull, "context.nothing"),
        ({"modelId": "${context.count}"}, BindingWrongType, "context.count"),
    ],
)
def test_a_schema_failure_names_the_expression_that_produced_the_value(
    template: Any, error: type[BindingError], expression: str
) -> None:
    """The reader must be able to tell which binding wrote the bad value, not only where it landed."""
    with pytest.raises(error) as info:
        _bind(template, MODEL_REF)
    assert info.value.expression == expression
    assert "${" + expression + "}" in str(info.value)


def test_the_schema_check_accepts_nullable_fields() -> None:
    schema = {"type": "object", "properties": {"team": {"type": ["string", "null"]}}, "required": ["team"]}
    assert _bind({"team": "${context.owner.team}"}, schema) == {"team": None}

"""Sensitive values (orchestrator/redaction.py): found by the schemas that mark them, nested models and
lists included; replaced wherever they are shown, inside texts too, by one keyed marker per value; and
withheld from the messages the engine writes to history when a result or a context breaks its schema."""

from __future__ import annotations

import json
from typing import Annotated, Any

from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel

from orchestrator.engine.builder import context_problems
from orchestrator.engine.outputs import output_problem
from orchestrator.engine.plan import ContractPlan, Plan
from orchestrator.redaction import (
    MIN_SCRUBBED_CHARS,
    Redactor,
    letter_secrets,
    marks_any,
    path_is_sensitive,
    sensitive_values,
)
from workers.sdk import Sensitive


class Card(BaseModel):
    number: Annotated[str, Sensitive]
    holder: str


class Payment(BaseModel):
    cards: list[Card]
    pin: Annotated[int, Sensitive]
    note: str | None = None


SCHEMA = Payment.model_json_schema()


def test_values_are_found_where_the_schema_marks_them_through_nested_models_and_lists() -> None:
    payment = {
        "cards": [{"number": "4111", "holder": "Ann"}, {"number": "5500", "holder": "Bo"}],
        "pin": 1234,
    }
    assert sorted(map(str, sensitive_values(payment, SCHEMA))) == ["1234", "4111", "5500"]
    assert marks_any(SCHEMA) and not marks_any(Card.model_json_schema()["properties"]["holder"])
    assert path_is_sensitive(SCHEMA, ["cards", 1, "number"]) and path_is_sensitive(SCHEMA, ["pin"])
    assert not path_is_sensitive(SCHEMA, ["cards", 0, "holder"]) and not path_is_sensitive(SCHEMA, ["note"])
    whole = {"type": "object", "properties": {"secret": {"type": "object", "sensitive": True}}}
    found = sensitive_values({"secret": {"a": "xyzw", "b": [7, None, True]}}, whole)
    assert sorted(map(str, found)) == ["7", "xyzw"]


def test_a_marker_stands_for_one_value_the_same_wherever_it_is_and_hides_it_in_texts() -> None:
    redactor = Redactor.of(["4111222233334444", 1234], key=b"k" * 32)
    shown = redactor.scrub(
        {
            "result": {
                "card": "4111222233334444",
                "pin": 1234,
                "list": ["4111222233334444", 12345],
            },
            "error": "card 4111222233334444 declined (pin 1234)",
            "delay_ms": 1234,  # a document's own number: never a value it was given
        }
    )
    assert shown["delay_ms"] == 1234
    shown = {**shown["result"], "error": shown["error"]}
    marker = shown["card"]
    assert marker.startswith("[sensitive:") and shown["list"][0] == marker and shown["list"][1] == 12345
    assert shown["error"] == f"card {marker} declined (pin {shown['pin']})"
    assert Redactor.of(["4111222233334444"], key=b"other-key" * 4).scrub("4111222233334444") != marker
    assert Redactor.of(["4111222233334444"]).scrub("4111222233334444") == "[sensitive]"  # no key, no hash


# secrets of letters no marker holds ("[sensitive:" and hex), so a marker can never look like one
SECRET_LETTERS = "ghjklmopqruwxyz"


@given(
    st.lists(st.text(SECRET_LETTERS, min_size=MIN_SCRUBBED_CHARS, max_size=12), min_size=1, max_size=4),
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=20),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
        max_leaves=12,
    ),
)
def test_no_secret_survives_scrubbing_wherever_it_is_put(secrets: list[str], noise: Any) -> None:
    document = {"noise": noise, "secrets": secrets, "text": " / ".join(f"x{s}y" for s in secrets)}
    shown = json.dumps(Redactor.of(secrets, key=b"k" * 32).scrub(document), ensure_ascii=False)
    assert not [secret for secret in secrets if secret in shown], shown


def _plan(output_schema: dict[str, Any], context: dict[str, Any] | None = None) -> Plan:
    return Plan(
        name="p",
        version="1",
        entry="a",
        stages={},
        contracts={"pay@1": ContractPlan(queue="q", output_schema=output_schema)},
        context=context,
    )


def test_a_sensitive_value_that_breaks_its_schema_is_not_quoted_in_the_error_history_keeps() -> None:
    plan = _plan(SCHEMA)
    problem = output_problem(
        plan, "pay@1", {"cards": [{"number": 4111999988887777, "holder": "Ann"}], "pin": 1}
    )
    assert problem is not None and "4111999988887777" not in problem
    assert "result.cards[0].number: (a sensitive value, withheld) fails 'type'" in problem
    plain = output_problem(plan, "pay@1", {"cards": [{"number": "x", "holder": 99}], "pin": 1})
    assert plain is not None and "99 is not of type 'string'" in plain  # others are quoted as before
    context = {"type": "object", "properties": {"card": {"type": "string", "sensitive": True}}}
    [why] = context_problems(_plan({}, context), {"card": 4111999988887777})
    assert "4111999988887777" not in why and why == "card: (a sensitive value, withheld) fails 'type'"


def test_a_message_carries_the_sensitive_values_its_body_holds_by_its_kind() -> None:
    plan = {
        "context": {"type": "object", "properties": {"card": {"type": "string", "sensitive": True}}},
        "contracts": {"pay@1": {"input_schema": SCHEMA, "output_schema": SCHEMA}},
    }
    payment = {"cards": [], "pin": 9876}
    assert letter_secrets({"kind": "start", "body": {"context": {"card": "4111"}}}, plan) == ["4111"]
    assert letter_secrets({"kind": "task", "contract": "pay@1", "body": {"input": payment}}, plan) == [9876]
    assert letter_secrets({"kind": "result", "contract": "pay@1", "body": {"result": payment}}, plan) == [
        9876
    ]
    assert letter_secrets({"kind": "heartbeat", "body": {}}, plan) == []


def test_ids_times_and_states_are_never_rewritten_but_values_below_them_always_are() -> None:
    redactor = Redactor.of(["failed", "2026", "acme-secret"], key=b"k" * 32)
    document = {
        "run_id": "run-2026-x",
        "state": "failed",
        "created_at": "2026-12-05T06:00:00Z",
        "stages": {"charge": {"state": "failed", "result": {"state": "failed", "id": "acme-secret"}}},
        "reason": "charge: acme-secret was refused",
    }
    shown = redactor.scrub(document)
    assert shown["run_id"] == "run-2026-x" and shown["state"] == "failed"
    assert shown["created_at"] == "2026-12-05T06:00:00Z" and shown["stages"]["charge"]["state"] == "failed"
    result = shown["stages"]["charge"]["result"]
    assert result["state"].startswith("[sensitive:") and result["id"].startswith("[sensitive:")
    assert "acme-secret" not in shown["reason"]


def test_an_error_about_a_whole_object_holding_a_sensitive_value_is_not_quoted() -> None:
    schema = {
        "type": "object",
        "properties": {
            "payment": {
                "oneOf": [
                    {
                        "type": "object",
                        "properties": {"card": {"type": "string", "sensitive": True}},
                        "required": ["card"],
                        "additionalProperties": False,
                    }
                ]
            }
        },
    }
    assert path_is_sensitive(schema, ["payment"])  # it holds one: its errors quote all of it
    assert not path_is_sensitive({"type": "object", "properties": {"n": {"type": "integer"}}}, ["n"])
    [why] = context_problems(_plan({}, schema), {"payment": {"card": "4111999988887777", "extra": 1}})
    assert "4111999988887777" not in why

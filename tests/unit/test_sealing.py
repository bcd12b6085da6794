"""Sensitive values sealed at rest (orchestrator/sealing.py): what a transition writes of a run's
sensitive values is sealed under the ring's data key, equal values copied elsewhere too, and reads back
exactly as it was; a key the process lacks, or another key, cannot open it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from orchestrator.compiler import compile_text
from orchestrator.contracts import Registry
from orchestrator.engine import advance
from orchestrator.engine.model import StartRun
from orchestrator.engine.plan import typed_plan
from orchestrator.keys.ring import KeyState, Ring, RingKey, Scope
from orchestrator.sealing import PREFIX, Sealer, SealError, decision_secrets, plan_marks

PAYMENT = Path(__file__).parents[1] / "integration" / "probe_apps" / "probe-payment.yaml"
CARD = "4111222233334444"


def ring(*keys: tuple[str, KeyState]) -> Ring:
    return Ring(tuple(RingKey(k, Scope.DATA, state, f"secret-of-{k}".encode()) for k, state in keys), 0)


SEALER = Sealer(lambda: ring(("d2", KeyState.ACTIVE), ("d1", KeyState.VERIFY)))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=10,
)


@given(json_values)
def test_a_sealed_value_opens_to_exactly_what_was_sealed(value: Any) -> None:
    sealed = SEALER.seal(value, "run-1")
    assert sealed.startswith(f"{PREFIX}d2:")
    assert SEALER.open(sealed, "run-1") == value
    with pytest.raises(SealError, match="sealed for another run"):
        SEALER.open(sealed, "run-2")  # copied into another run's fields, it does not open


def test_a_value_opens_with_the_key_it_was_sealed_with_only() -> None:
    old = Sealer(lambda: ring(("d1", KeyState.ACTIVE))).seal(CARD, "r")
    assert SEALER.open(old, "r") == CARD  # d1 only verifies now: it still opens what it sealed
    with pytest.raises(SealError, match="data key 'd1' is not in this process's key ring"):
        Sealer(lambda: ring(("d2", KeyState.ACTIVE))).open(old, "r")
    forged = old.replace(f"{PREFIX}d1:", f"{PREFIX}d2:")
    with pytest.raises(SealError, match="does not open"):
        SEALER.open(forged, "r")
    with pytest.raises(SealError, match="does not open"):
        SEALER.open(f"{PREFIX}d2:not base64!", "r")
    with pytest.raises(SealError, match="an active data key"):
        Sealer(lambda: ring(("d1", KeyState.VERIFY))).seal(CARD, "r")


def test_equal_values_are_sealed_wherever_they_are_and_texts_read_back_the_same() -> None:
    document = {"context": {"card": CARD, "amount": 42}, "input": [CARD, "4444"], "note": "card"}
    text = json.dumps(document)
    sealed = SEALER.seal_text(text, frozenset({CARD}), "r")
    assert CARD not in sealed and "4444" in sealed and sealed.count(PREFIX) == 2  # only the equal ones
    assert json.loads(SEALER.unseal_text(sealed, "r")) == document
    name = 'Jösé "the card" 4111'
    escaped = json.dumps({"name": name})  # as json.dumps writes it: escaped
    assert "Jösé" not in SEALER.seal_text(
        escaped, frozenset({name}), "r"
    ) and "\\u00f6" not in SEALER.seal_text(escaped, frozenset({name}), "r")
    record = {"context": sealed, "status": "running", "reason": f"{PREFIX}garbage"}
    opened = SEALER.unseal_record(record, "r")
    assert json.loads(opened["context"]) == document and opened["reason"] == record["reason"]  # free text


def test_a_start_of_a_plan_that_marks_values_is_written_sealed() -> None:
    from tests.integration.probe_apps import payments

    registry = Registry.from_modules([payments.__name__])
    compiled = compile_text(PAYMENT.read_bytes(), str(PAYMENT), registry)
    plan = typed_plan(compiled.plan)
    assert plan_marks(plan)
    decision = advance(
        plan, compiled.digest, None, StartRun("start-r", "r", "fast.0", {"card": CARD, "amount": 7}), 0
    )
    assert decision_secrets(plan, None, decision) == frozenset({CARD})
    stored = SEALER.sealed(plan, None, decision, "r")
    written = json.dumps([dict(w.fields) for w in stored.writes]) + json.dumps(
        [m.body for m in stored.outgoing]
    )
    assert CARD not in written and PREFIX in written
    task = next(m for m in decision.outgoing if m.body.get("contract") == "probe.charge@1")
    assert task.body["input"]["card"] == CARD  # what is published from the decision is as the engine made it

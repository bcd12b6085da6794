"""From a verified envelope to an engine event: typed bodies and strict labels refuse what does not fit,
with the reason, and never raise (shard/events.py)."""

from __future__ import annotations

from typing import Any

import pytest

from orchestrator.bus.envelope import Envelope
from orchestrator.engine.model import CompensationResult, FinaliserResult, Redrive, StageResult
from orchestrator.shard.events import to_event
from orchestrator.wire.kinds import Kind


def envelope(kind: Kind = Kind.RESULT, **fields: Any) -> Envelope:
    base: dict[str, Any] = {
        "message_id": "result-1",
        "run_id": "run-1",
        "shard": "fast.0",
        "stage": "render",
        "attempt": 1,
        "fence": "1.1",
        "digest": "sha256:" + "0" * 64,
        "body": {"ok": True, "result": {}},
    }
    return Envelope(kind=kind, **(base | fields))


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"stage": "finaliser:²"}, "a finaliser's stage label is 'finaliser:<index>'"),
        ({"stage": "finaliser:01"}, "a finaliser's stage label is 'finaliser:<index>'"),
        ({"stage": "compensate:render", "fence": "1.c²"}, "a compensation's fence is '<epoch>.c<index>'"),
        ({"stage": "compensate:render", "fence": "\u0663.c0"}, "a compensation's fence"),
        ({"body": {"ok": "false"}}, "result body: ok"),
        ({"body": {"ok": False, "error": {"code": 1}}}, "result body: error"),
        ({"body": {"ok": False, "retryable": "no"}}, "result body: retryable"),
        ({"body": {}}, "result body: ok"),
        ({"digest": ""}, "must name the plan digest"),
        ({"fence": None}, "must name its stage and fence"),
    ],
)
def test_a_report_that_does_not_fit_is_refused_with_the_reason(fields: dict[str, Any], why: str) -> None:
    refused = to_event(envelope(**fields))
    assert isinstance(refused, str) and why in refused


def test_well_formed_reports_become_their_events() -> None:
    assert isinstance(to_event(envelope()), StageResult)
    finaliser = to_event(envelope(stage="finaliser:12", fence="3.f12"))
    assert isinstance(finaliser, FinaliserResult) and finaliser.index == 12
    undo = to_event(envelope(stage="compensate:render", fence="2.c3", body={"ok": True}))
    assert isinstance(undo, CompensationResult) and (undo.stage, undo.index) == ("render", 3)


def test_an_operator_request_must_carry_an_id_no_report_can_have() -> None:
    """A refused request is remembered under its id, so it must never be a report's: a redrive naming the
    id of a result still to come would make that result a duplicate."""
    forged = to_event(envelope(Kind.REDRIVE, message_id="result-229f678322dd67a90c9c3830c27a8a3a", body={}))
    assert isinstance(forged, str) and "request's id is 'redrive-<unique>'" in forged
    assert isinstance(to_event(envelope(Kind.REDRIVE, message_id="redrive-", body={})), str)
    request = to_event(envelope(Kind.REDRIVE, message_id="redrive-abc", body={"reason": "fixed"}))
    assert isinstance(request, Redrive) and request.reason == "fixed"
    assert isinstance(to_event(envelope(Kind.CANCEL_RUN, message_id="cancel.run-x", body={"reason": 5})), str)

"""From a verified envelope to the engine's event, or the reason it is refused.

A signature says who sent a message, not that its fields make sense: a worker key can sign anything. So
each kind's body has a typed shape (strict booleans: ``"false"`` is not false), labels and fences are
parsed by ``ids``'s strict parsers, and anything that does not fit is refused here, before any state is
read or written, with the reason (the service parks it on ``saga.rejected``). Nothing in this module may
raise for a message's content.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, StrictBool, StrictStr, ValidationError

from orchestrator.bus.envelope import Envelope, Kind
from orchestrator.engine import ids
from orchestrator.engine.model import (
    BarrierReleased,
    CancelRun,
    CompensationResult,
    Event,
    FinaliserResult,
    Redrive,
    StageAccepted,
    StageHeartbeat,
    StageResult,
)

# Unknown body fields are ignored, not refused: a newer worker may send more than this release reads.
_BODY = ConfigDict(extra="ignore", frozen=True)


class ResultBody(BaseModel):
    """What a worker reports about a task."""

    model_config = _BODY

    ok: StrictBool
    result: Any = None
    error: StrictStr | None = None
    retryable: StrictBool = True
    cancelled: StrictBool = False


class RequestBody(BaseModel):
    """An operator's or service's request about a whole run (cancel, re-drive)."""

    model_config = _BODY

    reason: StrictStr = ""
    requested_by: StrictStr = ""
    undo_lost: StrictBool = False  # a re-drive: the undo a poison message left in flight is lost


class StartBody(BaseModel):
    """A service's request to start a run: the definition, the plan it resolved (empty: the active one)
    and the context."""

    model_config = _BODY

    definition: StrictStr
    digest: StrictStr = ""
    context: dict[str, Any] = {}


def start_body(envelope: Envelope) -> StartBody | str:
    """A start's body, or why it is refused."""
    try:
        return StartBody.model_validate(envelope.body)
    except ValidationError as exc:
        return f"start body: {_first_problem(exc)}"


def to_event(envelope: Envelope) -> Event | str:
    """The event ``envelope`` carries for its run, or why it is refused."""
    if envelope.kind in (Kind.CANCEL_RUN, Kind.REDRIVE):
        return _request(envelope)
    if envelope.stage is None or envelope.fence is None:
        return f"a {envelope.kind.value} must name its stage and fence"
    if envelope.kind in (Kind.ACCEPTED, Kind.HEARTBEAT):
        kind = StageAccepted if envelope.kind is Kind.ACCEPTED else StageHeartbeat
        attempt = envelope.attempt or 0
        return kind(envelope.message_id, envelope.stage, attempt, envelope.fence, envelope.digest)
    if envelope.kind is Kind.RELEASE:
        return BarrierReleased(envelope.message_id, envelope.stage, envelope.fence)
    if envelope.kind is not Kind.RESULT:
        return f"{envelope.kind.value} messages are not for shard queues"
    if not envelope.digest:
        return "a result must name the plan digest its task was dispatched under"
    try:
        body = ResultBody.model_validate(envelope.body)
    except ValidationError as exc:
        return f"result body: {_first_problem(exc)}"
    return _result(envelope, body)


def _request(envelope: Envelope) -> Event | str:
    # A refused request is remembered under its id (it must not act if delivered again after the run
    # changed), so its id must never be one a report could carry: it starts with the request's kind.
    prefix = f"{envelope.kind.value}-"
    if not envelope.message_id.startswith(prefix) or envelope.message_id == prefix:
        return f"a {envelope.kind.value} request's id is '{prefix}<unique>', not {envelope.message_id!r}"
    try:
        body = RequestBody.model_validate(envelope.body)
    except ValidationError as exc:
        return f"{envelope.kind.value} body: {_first_problem(exc)}"
    reason, by = body.reason[:500], body.requested_by[:200]
    if envelope.kind is Kind.CANCEL_RUN:
        return CancelRun(envelope.message_id, reason, by)
    return Redrive(envelope.message_id, reason, by, undo_lost=body.undo_lost)


def _result(envelope: Envelope, body: ResultBody) -> Event | str:
    stage, fence = envelope.stage or "", envelope.fence or ""
    if stage.startswith(ids.COMPENSATION_PREFIX):
        index = ids.parse_compensation_fence(fence)
        if index is None:
            return f"a compensation's fence is '<epoch>.c<index>', not {fence!r}"
        name = stage.removeprefix(ids.COMPENSATION_PREFIX)
        return CompensationResult(
            envelope.message_id, name, index, fence, body.ok, body.error, envelope.digest, body.result
        )
    if stage.startswith(ids.FINALISER_PREFIX):
        position = ids.parse_finaliser_label(stage)
        if position is None:
            return f"a finaliser's stage label is 'finaliser:<index>', not {stage!r}"
        return FinaliserResult(
            envelope.message_id, position, fence, body.ok, body.result, body.error, envelope.digest
        )
    return StageResult(
        envelope.message_id,
        stage,
        envelope.attempt or 0,
        fence,
        body.ok,
        body.result,
        body.error,
        envelope.item,
        envelope.digest,
        retryable=body.retryable,
        cancelled=body.cancelled,
    )


def _first_problem(exc: ValidationError) -> str:
    first = exc.errors(include_url=False)[0]
    where = ".".join(str(p) for p in first["loc"]) or "body"
    return f"{where}: {first['msg']}"

"""From a verified envelope to the engine's event, or the reason it is refused.

A signature says who sent a message, not that its fields make sense: a worker key can sign anything. So
each kind's body is decoded to its typed shape (``wire.bodies``), labels and fences are parsed by
``ids``'s strict parsers, and anything that does not fit is refused here, before any state is read or
written, with the reason (the service parks it on ``saga.rejected``). Nothing in this module may raise
for a message's content.
"""

from __future__ import annotations

from orchestrator.bus.envelope import Envelope
from orchestrator.engine.model import (
    BagRefill,
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
from orchestrator.wire import ids
from orchestrator.wire.bodies import RequestBody, ResultBody, StartBody, decoded
from orchestrator.wire.kinds import Kind


def start_body(envelope: Envelope) -> StartBody | str:
    """A start's body, or why it is refused."""
    return decoded(StartBody, envelope.body, "start")


def to_event(envelope: Envelope) -> Event | str:
    """The event ``envelope`` carries for its run, or why it is refused."""
    if envelope.kind in (Kind.CANCEL_RUN, Kind.REDRIVE):
        return _request(envelope)
    if envelope.stage is None or envelope.fence is None:
        return f"a {envelope.kind.value} must name its stage and fence"
    attempt = envelope.attempt or 0
    if envelope.kind is Kind.ACCEPTED:
        return StageAccepted(
            envelope.message_id, envelope.stage, attempt, envelope.fence, envelope.digest, _contract(envelope)
        )
    if envelope.kind is Kind.HEARTBEAT:
        return StageHeartbeat(
            envelope.message_id,
            envelope.stage,
            attempt,
            envelope.fence,
            envelope.digest,
            envelope.issued_at_ms,
            _contract(envelope),
        )
    if envelope.kind is Kind.RELEASE:
        return BarrierReleased(envelope.message_id, envelope.stage, envelope.fence)
    if envelope.kind is Kind.REFILL:
        sent = envelope.body.get("sent")
        if not isinstance(sent, int) or isinstance(sent, bool) or sent < 0:
            return f"a bag.refill must name the item it sends from ('sent'), not {sent!r}"
        return BagRefill(envelope.message_id, envelope.stage, envelope.fence, sent)
    if envelope.kind is not Kind.RESULT:
        return f"{envelope.kind.value} messages are not for shard queues"
    if not envelope.digest:
        return "a result must name the plan digest its task was dispatched under"
    body = decoded(ResultBody, envelope.body, "result")
    return body if isinstance(body, str) else _result(envelope, body)


def _request(envelope: Envelope) -> Event | str:
    # A refused request is remembered under its id (it must not act if delivered again after the run
    # changed), so its id must never be one a report could carry: it starts with the request's kind.
    prefix = f"{envelope.kind.value}-"
    if not envelope.message_id.startswith(prefix) or envelope.message_id == prefix:
        return f"a {envelope.kind.value} request's id is '{prefix}<unique>', not {envelope.message_id!r}"
    body = decoded(RequestBody, envelope.body, envelope.kind.value)
    if isinstance(body, str):
        return body
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
            envelope.message_id,
            name,
            index,
            fence,
            body.ok,
            body.error,
            envelope.digest,
            body.result,
            _contract(envelope),
        )
    if stage.startswith(ids.FINALISER_PREFIX):
        position = ids.parse_finaliser_label(stage)
        if position is None:
            return f"a finaliser's stage label is 'finaliser:<index>', not {stage!r}"
        return FinaliserResult(
            envelope.message_id,
            position,
            fence,
            body.ok,
            body.result,
            body.error,
            envelope.digest,
            _contract(envelope),
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
        contract=_contract(envelope),
    )


def _contract(envelope: Envelope) -> str:
    return envelope.contract or ""

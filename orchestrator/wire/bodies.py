"""The body of each kind of message: one encoder its senders call, and for what a receiver must not take
on trust, one typed decoder.

A signature says who sent a message, not that its fields make sense: a worker key can sign anything. So
the bodies a shard receives (starts, results, run requests) have typed shapes (strict booleans:
``"false"`` is not false) and a decoder that answers the body or why it is refused, never raising for a
message's content. Unknown body fields are ignored, not refused: a newer sender may send more than this
release reads. Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, StrictBool, StrictStr, ValidationError

from orchestrator.wire import sizes

_BODY = ConfigDict(extra="ignore", frozen=True)
M = TypeVar("M", bound=BaseModel)

DEFAULT_TENANT = "default"  # every run's, unless a client key (or a token) of another tenant started it


# ---- start: service -> shard ----------------------------------------------------------------------------


class StartBody(BaseModel):
    """A service's request to start a run: the definition, the plan it resolved (empty: the active one)
    and the context."""

    model_config = _BODY

    definition: StrictStr
    digest: StrictStr = ""
    context: dict[str, Any] = {}
    requested_by: StrictStr = ""  # who asked, where a server acts for its tokens: named in the history


def start(definition: str, digest: str, context: Mapping[str, Any], requested_by: str = "") -> dict[str, Any]:
    body = {"definition": definition, "digest": digest, "context": dict(context)}
    return {**body, "requested_by": requested_by[:200]} if requested_by else body


# ---- task: shard -> worker ------------------------------------------------------------------------------


@dataclass(frozen=True)
class TaskBody:
    """What a task asks of a worker beyond its envelope's identity: the input, the idempotency key, and
    what to report while it runs (``accept``: report the attempt's start, once its handler has run
    ``accept_after_ms``, none if it returns sooner; ``heartbeat_ms``: beat)."""

    input: Any
    idempotency_key: str
    accept: bool = False
    heartbeat_ms: int | None = None
    accept_after_ms: int = 0

    @classmethod
    def of(cls, body: Mapping[str, Any], message_id: str) -> TaskBody:
        """A task's body as the worker reads it (the orchestrator wrote it: a key it lacks takes its
        default, the task's id standing in for the idempotency key)."""
        report = body.get("report") or {}
        beat = _positive(report.get("heartbeat_ms"))
        after = _positive(report.get("accept_after_ms"))
        return cls(
            body.get("input"),
            str(body.get("idempotency_key", message_id)),
            report.get("accept") is True,
            beat,
            min(after, MAX_ACCEPT_AFTER_MS) if after is not None else 0,
        )


#: The longest wait for an acceptance a worker honours, whatever a task asks.
MAX_ACCEPT_AFTER_MS = 1_000


def _positive(value: Any) -> int | None:
    """``value`` if it is a positive integer (not a bool), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def task(
    *,
    run_id: str,
    shard: str,
    stage: str,
    attempt: int,
    fence: str,
    item: int | None,
    contract: str,
    digest: str,
    tenant: str,
    payload: Any,
    idempotency_key: str,
    report: Mapping[str, Any] | None = None,
    per_message: int = 1,
) -> dict[str, Any]:
    """A task's body; it repeats the identity the envelope carries, since the outbox keeps only the body
    (``bus.publisher`` builds the envelope from it). ``per_message``: how many of a bag's item tasks the
    publisher may pack into one message (the map's ``items_per_message``)."""
    body = {
        "run_id": run_id,
        "shard": shard,
        "stage": stage,
        "attempt": attempt,
        "fence": fence,
        "item": item,
        "contract": contract,
        "digest": digest,
        "tenant": tenant,
        "input": payload,
        "idempotency_key": idempotency_key,
    }
    if report is not None:
        body["report"] = dict(report)
    if per_message > 1:
        body[PER_MESSAGE] = per_message
    return body


#: The task body field saying how many item tasks may share a message (absent: one).
PER_MESSAGE = "items_per_message"


def per_message(body: Mapping[str, Any]) -> int:
    """How many tasks like this one the publisher may pack into one message (1: it travels alone)."""
    value = body.get(PER_MESSAGE)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 1 else 1


# ---- result: worker -> shard ----------------------------------------------------------------------------


class ResultBody(BaseModel):
    """What a worker reports about a task."""

    model_config = _BODY

    ok: StrictBool
    result: Any = None
    error: StrictStr | None = None
    retryable: StrictBool = True
    cancelled: StrictBool = False


def result(
    ok: bool, value: Any, limits: sizes.Limits, *, retryable: bool = True, cancelled: bool = False
) -> dict[str, Any]:
    """A report's body. A result too large for a message, or not valid JSON (NaN), is reported as a
    failure that says so (sent as it is, the shard would refuse it unread and the attempt would wait for
    its deadline, or for ever); an error text is cut to a bounded length."""
    if ok:
        body = {"ok": True, "result": value}
        problem = sizes.too_big(body, limits)
        if problem is None:
            return body
        return {"ok": False, "error": f"the result cannot be sent: {problem}", "retryable": False}
    failure: dict[str, Any] = {"ok": False, "error": sizes.bounded(str(value)), "retryable": retryable}
    if cancelled:
        failure["cancelled"] = True
    return failure


# ---- shard -> itself and -> saga.events -----------------------------------------------------------------


def attempt(run_id: str, stage: str, fence: str) -> dict[str, Any]:
    """The body of a message about one attempt of a stage: a barrier's release (to its own shard), a
    request that workers stop the attempt (to saga.events)."""
    return {"run_id": run_id, "stage": stage, "fence": fence}


def refill(run_id: str, stage: str, fence: str, sent: int) -> dict[str, Any]:
    """A bag's refill (to its own shard): the items from ``sent`` on are the next to send."""
    return {"run_id": run_id, "stage": stage, "fence": fence, "sent": sent}


def finished(run_id: str, definition: str, state: str, output: Any, reason: str | None) -> dict[str, Any]:
    """A run's end, as saga.events announces it."""
    return {"run_id": run_id, "definition": definition, "state": state, "output": output, "reason": reason}


# ---- run requests: service or operator -> shard ---------------------------------------------------------


class RequestBody(BaseModel):
    """An operator's or service's request about a whole run (cancel, re-drive)."""

    model_config = _BODY

    reason: StrictStr = ""
    requested_by: StrictStr = ""
    undo_lost: StrictBool = False  # a re-drive: the undo a poison message left in flight is lost


def request(reason: str, requested_by: str, *, undo_lost: bool | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"reason": reason, "requested_by": requested_by}
    if undo_lost is not None:
        body["undo_lost"] = undo_lost
    return body


# ---- decoding -------------------------------------------------------------------------------------------


def decoded(model: type[M], body: Mapping[str, Any], what: str) -> M | str:
    """``body`` as ``model``, or why it is refused (``what``: the body's name in the reason)."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        return f"{what} body: {where}: {first['msg']}"

"""Validly signed garbage: Hypothesis strategies for messages that carry a good signature and name a live
run, but are not a message that run can accept.

Every field is drawn from a mix of the plausible (the run's own stage names, fences and digest) and the
hostile (labels such as ``finaliser:²``, fences such as ``1.c²``, other digits, huge and negative
numbers, wrong types, unicode, over-long values). The bytes are signed as the publisher signs, without
building a model first, so fields the envelope check refuses reach it too.

A draw that happens to be a message the run must accept (a well-formed report of its current attempt,
under the id derived from that attempt's task) is not garbage; :func:`is_legitimate` tells, and the
tests skip it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st
from pydantic import ValidationError

from orchestrator.bus.envelope import Signer, signed_message
from orchestrator.engine.model import ACTIVE_STAGE_STATUSES, RunSnapshot
from orchestrator.wire import ids
from orchestrator.wire.bodies import ResultBody
from orchestrator.wire.kinds import Kind

HOSTILE_TEXT = [
    "",
    "²",
    "٣",
    "finaliser:²",
    "finaliser:-1",
    "finaliser:99",
    "finaliser:0",
    "compensate:",
    "compensate:nope",
    "compensate:render-thumbnail",
    "render-thumbnail#²",
    "render-thumbnail#1",
    "1.c²",
    "1.f²",
    "1.f0",
    "1.c0",
    "1.run",
    "\u0663.\u0661",  # Arabic-Indic digits: isdigit() says yes, the fence grammar no
    "\x00",
    "é" * 150,
    "x" * 300,
]
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def mostly(plausible: st.SearchStrategy[Any], hostile: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``plausible`` nineteen times in twenty: most draws must pass the envelope check and reach the
    engine, where the subtle refusals are; the rest test the envelope check itself."""
    # (a sampled index, not an integer range: Hypothesis favours an integer range's bounds)
    return st.sampled_from(range(20)).flatmap(lambda n: hostile if n == 19 else plausible)


NUMBERS = mostly(
    st.none() | st.integers(0, 4), st.integers(-3, -1) | st.integers(2**31 - 2, 2**64) | st.text(max_size=3)
)
# a report's body as a worker sends it (success or failure), whatever it says
REPORT_BODY = st.fixed_dictionaries({"ok": st.just(True), "result": JSON_VALUES}) | st.fixed_dictionaries(
    {"ok": st.just(False), "error": st.text(max_size=30)},
    optional={"retryable": st.booleans(), "cancelled": st.booleans()},
)
BODY_FIELDS = {
    "ok": st.booleans() | st.sampled_from(["false", "true", 0, 1, None]),
    "result": JSON_VALUES,
    "error": st.text(max_size=30) | JSON_VALUES,
    "retryable": st.booleans() | st.sampled_from(["no", 0, None]),
    "cancelled": st.booleans() | st.sampled_from(["yes", 1]),
    "reason": st.text(max_size=30) | JSON_VALUES,
    "requested_by": st.text(max_size=30) | st.integers(),
    "definition": st.sampled_from(["model-ingest", "", "nope"]) | JSON_VALUES,
    "context": st.just({"modelId": "m-x"}) | JSON_VALUES,
    "digest": st.text(max_size=10) | JSON_VALUES,
}


@dataclass(frozen=True)
class Target:
    """What the garbage aims at: a live run, on its shard, under its plan."""

    run_id: str
    shard: str
    digest: str
    stages: tuple[str, ...]
    other_shard: str


@st.composite
def garbage(draw: st.DrawFn, target: Target) -> dict[str, Any]:
    """The fields of one validly signed message about ``target``'s run (kind is never a cancellation:
    a signed cancel is a legitimate request, and cancels the run)."""
    kinds = [k.value for k in Kind if k is not Kind.CANCEL_RUN] + [Kind.RESULT.value] * 6
    plausible_stages = list(target.stages) * 3 + HOSTILE_TEXT
    fences = ["1.1", "1.2", "0.9", "2.1", "1.c0", "1.c²", "1.f0", "1.f²", "1.run", "\u0663.1", ""]
    fields: dict[str, Any] = {
        "kind": draw(mostly(st.sampled_from(kinds), st.sampled_from(["resultt", "", "RESULT"]))),
        "run_id": draw(mostly(st.just(target.run_id), st.sampled_from(["r" * 129, "é" * 150, "run x", ""]))),
        "shard": draw(
            mostly(
                st.sampled_from([target.shard] * 6 + ["", target.other_shard, "fast.99"]),
                st.sampled_from(["no-dot", "Fast.0", "fast.0 "]) | st.text(max_size=8),
            )
        ),
        "stage": draw(mostly(st.sampled_from(plausible_stages), st.none() | st.text(max_size=12))),
        "fence": draw(mostly(st.sampled_from(fences), st.none() | st.text(max_size=8) | st.just("x" * 70))),
        "attempt": draw(mostly(st.integers(0, 3), NUMBERS)),
        "item": draw(mostly(st.none(), NUMBERS)),
        "digest": draw(
            mostly(st.sampled_from([target.digest] * 4 + ["", "sha256:" + "0" * 64]), st.just("x" * 200))
        ),
        "contract": draw(st.none() | st.text(max_size=10)),
        "tenant": draw(mostly(st.sampled_from(["default", "other"]), st.just("t" * 80))),
        "body": draw(mostly(REPORT_BODY, st.fixed_dictionaries({}, optional=BODY_FIELDS))),
    }
    derived = report_id(fields)
    made_up = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=60)
    fields["message_id"] = draw(
        mostly(
            st.sampled_from(range(4)).flatmap(
                lambda n: made_up if n == 3 or not derived else st.just(derived)
            ),
            st.sampled_from(["", "with space", "é" * 10, "m" * 201]),
        )
    )
    return fields


def report_id(fields: Mapping[str, Any]) -> str | None:
    """The id a worker would give a report with these fields (None if they cannot name a task)."""
    stage, fence = fields.get("stage"), fields.get("fence")
    if not isinstance(stage, str) or not isinstance(fence, str) or not isinstance(fields.get("run_id"), str):
        return None
    item, attempt = fields.get("item"), fields.get("attempt")
    kind = fields.get("kind")
    if kind == Kind.ACCEPTED.value:
        return ids.acceptance_id(fields["run_id"], stage, fence)
    if kind == Kind.RELEASE.value:
        return ids.release_id(fields["run_id"], stage, fence)
    if stage.startswith((ids.FINALISER_PREFIX, ids.COMPENSATION_PREFIX)):
        return ids.result_id(ids.task_id(fields["run_id"], stage, fence))
    if (item is None or isinstance(item, int)) and isinstance(attempt, int):
        return ids.result_id(ids.stage_task_id(fields["run_id"], stage, fence, item, attempt))
    return None


def sign(signer: Signer, fields: Mapping[str, Any]) -> bytes:
    """The wire bytes, signed as the publisher signs (no model: invalid fields reach the envelope check),
    issued now: a stale message would be refused for its age before any check this garbage is for."""
    return signed_message(signer, **{"issued_at_ms": int(time.time() * 1000), **fields})


def is_legitimate(fields: Mapping[str, Any], run: RunSnapshot, target: Target) -> bool:
    """Whether the draw is a message the live run must accept: a well-formed report or acceptance (or
    heartbeat) of an attempt that is open now, under the id of that attempt's task."""
    kind, stage, fence = fields.get("kind"), fields.get("stage"), fields.get("fence")
    if fields.get("run_id") != target.run_id or fields.get("shard") not in ("", target.shard):
        return False
    if kind not in (Kind.RESULT.value, Kind.ACCEPTED.value):
        return False  # heartbeats are drawn under ids no beat has: never the attempt's own
    rec = run.stages.get(stage) if isinstance(stage, str) else None
    if rec is None or rec.fence != fence or rec.status not in ACTIVE_STAGE_STATUSES:
        return False
    if fields.get("message_id") != report_id(fields) or fields.get("digest") not in ("", target.digest):
        return False
    if kind == Kind.ACCEPTED.value:
        return True
    try:
        ResultBody.model_validate(fields.get("body"))
    except ValidationError:
        return False
    return fields.get("attempt") == rec.attempt and fields.get("digest") == target.digest


def describe(fields: Mapping[str, Any]) -> str:
    return json.dumps(fields, ensure_ascii=True, default=str)[:400]

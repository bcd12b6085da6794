"""How big the messages a transition causes may be, measured before they are committed. Pure.

Every process refuses a message over ``max_message_bytes`` before reading it (the envelope check), so a
transition must never commit a message that its reader will refuse: the run would wait for an answer
that cannot come. The engine measures each body it builds; the envelope around a body (identity fields
again, key id, signature) is bounded, and :data:`ENVELOPE_MARGIN_BYTES` covers it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from orchestrator.jsontext import canonical_bytes

DEFAULT_MAX_MESSAGE_BYTES = 1_048_576
# What an envelope adds to its body: field names, the identity fields repeated outside the body (run id
# up to 128 bytes, message id up to 200, stage label, fence, digest, contract, tenant and key id up to
# 64 each), issued-at and the 64-character signature. About 1,050 bytes for the largest legal identity
# (tests/unit/test_engine_sizes.py measures it); the rest is headroom.
ENVELOPE_MARGIN_BYTES = 2048
# Error texts and reasons are kept (history, the run's reason, finaliser inputs) and travel again, so
# one worker's 10 MB traceback must not become every later message's problem.
MAX_ERROR_CHARS = 2000


DEFAULT_MAX_TRANSITION_BYTES = 64 * 1_048_576
# A bag sends at most this many item tasks at once, and the next chunk as half of them have arrived:
# entering a bag of 10,000 items costs a transition of 1,000 tasks, not one of 10,000, and its outbox
# and queue hold at most 1.5 windows of tasks at a time.
DEFAULT_BAG_WINDOW = 1_000


@dataclass(frozen=True)
class Limits:
    """The runtime limits a transition must respect (from ``Settings``, passed in: the engine reads no
    configuration). ``max_transition_bytes`` bounds what one transition sends or writes in all (a bag's
    item tasks, a bag's results), which travels to Redis as one call."""

    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    max_transition_bytes: int = DEFAULT_MAX_TRANSITION_BYTES
    bag_window: int = DEFAULT_BAG_WINDOW  # item tasks of one bag in one transition (at least 2)

    def __post_init__(self) -> None:
        if self.bag_window < 2:
            raise ValueError(
                f"a bag window of {self.bag_window} sends nothing to refill from: give 2 or more"
            )

    @property
    def max_body_bytes(self) -> int:
        """The largest message body that still fits once enveloped."""
        return self.max_message_bytes - ENVELOPE_MARGIN_BYTES


DEFAULT_LIMITS = Limits()


def body_bytes(body: Mapping[str, Any]) -> int:
    """The UTF-8 size of ``body`` as the publisher serialises it (``jsontext.canonical_bytes``)."""
    return len(canonical_bytes(body))


def too_big(body: Mapping[str, Any], limits: Limits) -> str | None:
    """Why ``body`` cannot be sent (None: it can): it is not JSON, or too large once serialised as the
    publisher does it. NaN and infinities are not JSON (the publisher's encoder would write them as null,
    a value the sender never meant), so they are refused here."""
    try:
        text = canonical_bytes(body)  # a lone surrogate has no UTF-8 form: a ValueError here
        # orjson writes NaN and infinities as null; the standard library, which encodes what orjson
        # refuses, writes them as NaN and Infinity: only where one of those shows can there be one
        if b"null" in text or b"NaN" in text or b"Infinity" in text:
            _refuse_non_finite(body)
    except (TypeError, ValueError) as exc:
        return f"it is not valid JSON ({exc})"
    size = len(text)
    if size <= limits.max_body_bytes:
        return None
    return (
        f"its message would be {size:,} bytes, over the {limits.max_body_bytes:,}-byte limit for a "
        f"message body (SAGA_MAX_MESSAGE_BYTES {limits.max_message_bytes:,} less "
        f"{ENVELOPE_MARGIN_BYTES} for the envelope)"
    )


def _refuse_non_finite(value: Any) -> None:
    """Raise ValueError, as the standard library's strict encoder does, for a NaN or an infinity anywhere
    in ``value``. A walk of the values: a task body holds nulls of its own (a stage without a heartbeat),
    and encoding it again with the standard library only to look for them cost more than the walk."""
    pending = [value]
    while pending:
        item = pending.pop()
        kind = type(item)
        if kind in _LEAVES:  # most values: one look at the exact type, no subclass checks
            continue
        if kind is dict:
            pending.extend(item.values())
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise ValueError(f"Out of range float values are not JSON compliant: {item!r}")
        elif isinstance(item, Mapping):
            pending.extend(item.values())
        elif isinstance(item, list | tuple):
            pending.extend(item)


_LEAVES = frozenset({str, int, bool, type(None)})


def bounded(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """``text`` cut to ``limit`` characters, saying how much was cut."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... [{len(text) - limit:,} more characters cut]"

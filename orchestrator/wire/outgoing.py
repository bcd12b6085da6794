"""A message a transition causes, as the engine decides it and the shard's outbox keeps it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Outgoing:
    """A message the transition causes, appended to the shard outbox in the same atomic call.

    ``route`` is logical: ``("task", queue)``, ``("shard", shard)``, ``("events", routing_key)``.
    """

    message_id: str
    kind: str
    route: tuple[str, str]
    body: Mapping[str, Any]
    # a task with a queue deadline: when (epoch ms) a worker must have started it, else it does not start
    # it (it reports the attempt expired); its envelope's deadline_ms
    deadline_ms: int | None = None

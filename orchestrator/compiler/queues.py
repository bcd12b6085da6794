"""The task-queue rule: a definition's tasks go only to task queues.

A task queue is a ``tasks.*`` name (the built-in ``tasks.actions``, ``tasks.parallel`` and ``tasks.serial``,
or one of a pool's own, served with ``saga worker --queue``) or a queue a registered contract declares
(``Contract.queue``). Never the orchestrator's own queues: its shard queues (``saga.shard.fast.0``, and
``orch.fast.0`` before namespaces), the rejected queue, a dead-letter queue (``.dlq``), or any other name
under a reserved prefix. The broker refuses to declare those as task queues (``bus/topology.py``), so a
task sent there would never reach a worker; the compiler refuses them first.

The names are spelt here as in ``orchestrator/bus/names.py`` and ``bus/topology.py``, which a pure
module may not import; ``tests/unit/test_queue_rules.py`` checks that the two agree.
"""

from __future__ import annotations

from collections.abc import Iterable

from orchestrator.compiler.report import Reporter
from orchestrator.compiler.usage import QueueUse, Role
from orchestrator.contracts import ACTIONS_QUEUE, PARALLEL_QUEUE, SERIAL_QUEUE, Registry

TASK_QUEUE_PREFIX = "tasks."
BUILTIN_TASK_QUEUES = (ACTIONS_QUEUE, PARALLEL_QUEUE, SERIAL_QUEUE)
#: Prefixes of the orchestrator's own queues and exchanges, and RabbitMQ's (as ``bus/topology.py``).
RESERVED_PREFIXES = ("orch.", "saga.", "amq.")
#: Dead-letter queues (``<queue>.dlq``) and rejected queues (``<ns>.rejected``), in any namespace.
DEAD_LETTER_SUFFIXES = (".dlq", ".rejected")


def declared_queues(registry: Registry) -> list[str]:
    """The task queues registered contracts declare, beyond the built-in ones."""
    queues = {c.queue for c in registry.contracts()} - set(BUILTIN_TASK_QUEUES)
    return sorted(q for q in queues if _reserved(q) is None)


def refusal(queue: str, declared: Iterable[str]) -> str | None:
    """Why ``queue`` is not a task queue, or None if it is one."""
    reserved = _reserved(queue)
    if reserved is not None:
        return reserved
    if (queue.startswith(TASK_QUEUE_PREFIX) and len(queue) > len(TASK_QUEUE_PREFIX)) or queue in declared:
        return None
    return "is not a task queue: it is neither a tasks.* name nor a queue a registered contract declares"


def allowed_queues(declared: Iterable[str]) -> str:
    """The queues a stage may name, as a message lists them."""
    own = ", ".join(declared) or "none"
    return (
        f"{', '.join(BUILTIN_TASK_QUEUES)}, any other tasks.* name (served with saga worker --queue), "
        f"or a queue a registered contract declares ({own})"
    )


def check_task_queues(queues: Iterable[QueueUse], registry: Registry, report: Reporter) -> None:
    """Report every queue in ``queues`` that is not a task queue."""
    declared = declared_queues(registry)
    for use in queues:
        why = refusal(use.queue, declared)
        if why is None:
            continue
        if use.written:
            todo = f"name a task queue instead: {allowed_queues(declared)}"
        else:
            todo = f"declare a new version of {use.contract} with a task queue"
            if use.role is Role.STAGE:
                todo += ", or name one with queue:"
        report.add(use.path, f"queue {use.describe()} {why}; {todo}")


def _reserved(queue: str) -> str | None:
    suffix = next((s for s in DEAD_LETTER_SUFFIXES if queue.endswith(s)), None)
    if suffix is not None:
        return (
            f"is a dead-letter queue (names ending {suffix} hold dead or refused messages, "
            "which are never delivered to workers)"
        )
    prefix = next((p for p in RESERVED_PREFIXES if queue.startswith(p)), None)
    if prefix is not None:
        return (
            f"is reserved: names under {prefix} belong to the orchestrator's own queues "
            "(shard, rejected and dead-letter queues) or the broker's, not to task queues"
        )
    return None

"""Every RabbitMQ name, in one place. Pure; unit-tested.

Every name starts with the namespace (``SAGA_NAMESPACE``, ``saga`` unless set), so two environments on one
broker and one vhost never consume each other's messages:

* starts:   exchange ``<ns>.start.<class>`` (x-consistent-hash, routing key = run id) -> shard queues
* runs:     exchange ``<ns>.runs`` (direct, routing key = shard id) -> the shard queue that owns the run
* shards:   queue ``<ns>.shard.<class>.<n>`` (single active consumer)
* tasks:    exchange ``<ns>.tasks`` (direct, routing key = the queue's own name) -> one queue per task queue
            *and* contract version, ``<ns>.task.<queue>:<contract>@<version>``: a worker consumes only the
            queues of the contracts it has handlers for, so a task never reaches a worker that cannot run it
* events:   exchange ``<ns>.events`` (topic) -> whoever subscribes (run completions, cancellations)
* refused:  queue ``<ns>.rejected`` for messages refused before any write
* dead letters: exchange ``<ns>.dlx`` (direct); ``<shard queue>.dlq`` per shard queue and one
            ``<ns>.task.<queue>.dlq`` per task queue, shared by the contract queues under it

The ``:`` cannot occur in a task queue's or a contract's name, so the contract queues of two task queues
never collide, and ``.task.`` / ``.shard.`` keep task queues apart from the orchestrator's own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SERIAL_TASKS = "tasks.serial"
PARALLEL_TASKS = "tasks.parallel"
ACTION_TASKS = "tasks.actions"
BUILTIN_TASK_QUEUES = (SERIAL_TASKS, PARALLEL_TASKS, ACTION_TASKS)
DEFAULT_NAMESPACE = "saga"
NAMESPACE_PATTERN = r"^[a-z][a-z0-9_-]{0,31}$"
DLQ_SUFFIX = ".dlq"
#: RabbitMQ refuses longer queue names.
MAX_NAME_BYTES = 255


def shard_id(shard_class: str, number: int) -> str:
    return f"{shard_class}.{number}"


def dead_letter_queue(queue: str) -> str:
    return f"{queue}{DLQ_SUFFIX}"


@dataclass(frozen=True)
class Names:
    """The names of one namespace's exchanges and queues."""

    namespace: str = DEFAULT_NAMESPACE

    def __post_init__(self) -> None:
        if not re.match(NAMESPACE_PATTERN, self.namespace):
            raise ValueError(
                f"namespace {self.namespace!r} is not a valid name: use 1-32 of a-z, 0-9, '_' and '-', "
                "starting with a letter (it prefixes every exchange and queue name)"
            )

    @property
    def runs_exchange(self) -> str:
        return f"{self.namespace}.runs"

    @property
    def tasks_exchange(self) -> str:
        return f"{self.namespace}.tasks"

    @property
    def events_exchange(self) -> str:
        return f"{self.namespace}.events"

    @property
    def dead_letter_exchange(self) -> str:
        return f"{self.namespace}.dlx"

    @property
    def rejected_queue(self) -> str:
        return f"{self.namespace}.rejected"

    def start_exchange(self, shard_class: str) -> str:
        return f"{self.namespace}.start.{shard_class}"

    def shard_queue(self, shard: str) -> str:
        """``fast.3`` -> ``saga.shard.fast.3``."""
        return f"{self.namespace}.shard.{shard}"

    def task_queue(self, queue: str, contract: str) -> str:
        """Where tasks of ``contract`` (``name@version``) sent to task queue ``queue`` wait for a worker:
        ``tasks.parallel``, ``render@2`` -> ``saga.task.tasks.parallel:render@2``."""
        name = f"{self.namespace}.task.{queue}:{contract}"
        if len(name.encode()) > MAX_NAME_BYTES:
            raise ValueError(
                f"queue {queue!r} with contract {contract!r} makes the broker queue name {name[:60]}... "
                f"longer than RabbitMQ's {MAX_NAME_BYTES} bytes: use a shorter queue or contract name"
            )
        return name

    def task_dead_letters(self, queue: str) -> str:
        """The dead-letter queue every contract queue of task queue ``queue`` shares."""
        return dead_letter_queue(f"{self.namespace}.task.{queue}")

    def owns(self, queue: str) -> bool:
        """Whether ``queue`` belongs to this namespace."""
        return queue.startswith(f"{self.namespace}.")

    def is_dead_letter_queue(self, queue: str) -> bool:
        return self.owns(queue) and (queue == self.rejected_queue or queue.endswith(DLQ_SUFFIX))


def shard_numbers(spec: str) -> set[int] | None:
    """The numbers a ``--shards`` option names: ``"0-3"``, ``"1,3"``; None for ``""`` (all of them)."""
    numbers: set[int] = set()
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise ValueError(f"shard range {part!r} is not N or N-M")
        if high and int(high) < int(low):
            raise ValueError(f"shard range {part!r} is reversed; write it low-high")
        numbers.update(range(int(low), int(high or low) + 1))
    return numbers or None


def parse_shards(spec: str, classes: tuple[str, ...], count: int) -> list[str]:
    """Shard ids for ``--class``/``--shards`` options over ``count`` shards per class (all for ``""``)."""
    numbers = shard_numbers(spec)
    chosen = sorted(numbers) if numbers is not None else list(range(count))
    bad = [n for n in chosen if not 0 <= n < count]
    if bad:
        raise ValueError(f"shard numbers {bad} are outside 0-{count - 1} (SAGA_SHARD_COUNT={count})")
    return [shard_id(c, n) for c in classes for n in chosen]

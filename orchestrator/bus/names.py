"""Every RabbitMQ name, in one place. Pure functions; unit-tested.

* starts:   exchange ``saga.start.<class>`` (x-consistent-hash, routing key = run id) -> shard queues
* runs:     exchange ``saga.runs`` (direct, routing key = shard id) -> the shard queue that owns the run
* tasks:    exchange ``saga.tasks`` (direct, routing key = queue name) -> task queues
* events:   exchange ``saga.events`` (topic) -> whoever subscribes (run completions, cancellations)
* refused:  queue ``saga.rejected`` for messages refused before any write
* dead letters: exchange ``saga.dlx`` (direct), one ``<queue>.dlq`` per queue
"""

from __future__ import annotations

RUNS_EXCHANGE = "saga.runs"
TASKS_EXCHANGE = "saga.tasks"
EVENTS_EXCHANGE = "saga.events"
DEAD_LETTER_EXCHANGE = "saga.dlx"
REJECTED_QUEUE = "saga.rejected"
SERIAL_TASKS = "tasks.serial"
PARALLEL_TASKS = "tasks.parallel"
ACTION_TASKS = "tasks.actions"
BUILTIN_TASK_QUEUES = (SERIAL_TASKS, PARALLEL_TASKS, ACTION_TASKS)


def shard_id(shard_class: str, number: int) -> str:
    return f"{shard_class}.{number}"


def shard_queue(shard: str) -> str:
    """``fast.3`` -> ``orch.fast.3``."""
    return f"orch.{shard}"


def start_exchange(shard_class: str) -> str:
    return f"saga.start.{shard_class}"


def dead_letter_queue(queue: str) -> str:
    return f"{queue}.dlq"


def parse_shards(spec: str, classes: tuple[str, ...], count: int) -> list[str]:
    """Shard ids for ``--class``/``--shards`` options: ``"0-3"``, ``"1,3"``, ``""`` (all)."""
    numbers: list[int] = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise ValueError(f"shard range {part!r} is not N or N-M")
        if high and int(high) < int(low):
            raise ValueError(f"shard range {part!r} is reversed; write it low-high")
        numbers.extend(range(int(low), int(high or low) + 1))
    if not numbers:
        numbers = list(range(count))
    bad = [n for n in numbers if not 0 <= n < count]
    if bad:
        raise ValueError(f"shard numbers {bad} are outside 0-{count - 1} (SAGA_SHARD_COUNT={count})")
    return [shard_id(c, n) for c in classes for n in sorted(set(numbers))]

"""The broker topology as one pure function of settings (DESIGN section 4).

:func:`build_topology` says which exchanges, queues and bindings exist; :func:`apply_topology` declares
them on a live broker (``saga topology apply``) and :func:`to_definitions` writes them in RabbitMQ's
definitions.json format (``saga topology export``), so a broker can also be provisioned from a file at boot.

Every queue is a durable quorum queue. Applying is idempotent and additive: it never deletes or unbinds, so
scaling shards down (stop binding new starts to a shard, let it drain) is an operator's step, not this one.
RabbitMQ refuses to redeclare a queue with different arguments (``PRECONDITION_FAILED``): changing, say, the
delivery limit of existing queues needs a policy or a delete-and-redeclare, not a new ``apply``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from orchestrator.bus.names import BUILTIN_TASK_QUEUES, Names, dead_letter_queue
from orchestrator.shardmap import ShardMap, ShardState

if TYPE_CHECKING:
    import aio_pika.abc
    from pamqp.common import FieldTable

    from orchestrator.contracts import Contract, Registry
    from orchestrator.settings import Settings

ArgumentValue = str | int | bool
Arguments = Mapping[str, ArgumentValue]

DIRECT = "direct"
TOPIC = "topic"
CONSISTENT_HASH = "x-consistent-hash"
#: The routing key of a binding to an x-consistent-hash exchange is the queue's weight on the hash ring.
HASH_WEIGHT = "1"

_RESERVED_PREFIXES = ("orch.", "saga.", "amq.")
_RESERVED_SUFFIX = ".dlq"


def _frozen(arguments: Mapping[str, ArgumentValue] | None = None) -> Arguments:
    return MappingProxyType(dict(arguments or {}))


@dataclass(frozen=True)
class Exchange:
    """A durable exchange; ``type`` is ``direct``, ``topic`` or ``x-consistent-hash``."""

    name: str
    type: str
    arguments: Arguments = field(default_factory=_frozen, hash=False)


@dataclass(frozen=True)
class Queue:
    """A durable queue (always a quorum queue here: ``x-queue-type`` is in its arguments)."""

    name: str
    arguments: Arguments = field(default_factory=_frozen, hash=False)


@dataclass(frozen=True)
class Binding:
    """Exchange ``source`` routes to queue ``destination`` with ``routing_key``."""

    source: str
    destination: str
    routing_key: str
    arguments: Arguments = field(default_factory=_frozen, hash=False)


@dataclass(frozen=True)
class Topology:
    exchanges: tuple[Exchange, ...]
    queues: tuple[Queue, ...]
    bindings: tuple[Binding, ...]

    def exchange(self, name: str) -> Exchange:
        for exchange in self.exchanges:
            if exchange.name == name:
                return exchange
        raise KeyError(f"no exchange {name!r} in the topology")

    def queue(self, name: str) -> Queue:
        for queue in self.queues:
            if queue.name == name:
                return queue
        raise KeyError(f"no queue {name!r} in the topology")

    def bindings_to(self, queue: str) -> list[Binding]:
        return [b for b in self.bindings if b.destination == queue]

    def summary(self) -> str:
        return f"{len(self.exchanges)} exchanges, {len(self.queues)} queues, {len(self.bindings)} bindings"


# ---- the pure function -----------------------------------------------------------------------------------


def _quorum(group_size: int | None) -> dict[str, ArgumentValue]:
    """A quorum queue's arguments; ``group_size`` replicas, or the broker's default (``quorum_cluster_size``,
    3 on RabbitMQ 3.10, capped at the cluster's node count) when None. RabbitMQ refuses to redeclare a
    queue with another group size, so the setting must stay what a namespace's queues were declared with."""
    if group_size is None:
        return {"x-queue-type": "quorum"}
    return {"x-queue-type": "quorum", "x-quorum-initial-group-size": group_size}


def _dead_lettered(
    queue: str,
    dead_letters: str,
    names: Names,
    extra: Mapping[str, ArgumentValue] | None = None,
    group_size: int | None = None,
) -> Queue:
    """A quorum queue whose refused/expired/over-limit messages go to ``dead_letters`` through the dlx.

    at-least-once dead-lettering needs ``x-overflow: reject-publish`` (RabbitMQ falls back to at-most-once
    otherwise) and, on 3.10, the ``stream_queue`` feature flag."""
    return Queue(
        queue,
        _frozen(
            {
                **_quorum(group_size),
                **(extra or {}),
                "x-dead-letter-exchange": names.dead_letter_exchange,
                "x-dead-letter-routing-key": dead_letters,
                "x-dead-letter-strategy": "at-least-once",
                "x-overflow": "reject-publish",
            }
        ),
    )


def _plain(queue: str, group_size: int | None = None) -> Queue:
    return Queue(queue, _frozen(_quorum(group_size)))


def _check_task_queue(name: str) -> None:
    if name.startswith(_RESERVED_PREFIXES) or name.endswith(_RESERVED_SUFFIX):
        raise ValueError(
            f"task queue {name!r} uses a reserved name: names starting with "
            f"{', '.join(_RESERVED_PREFIXES)} or ending with {_RESERVED_SUFFIX} belong to the orchestrator"
        )


def _check_settings(delivery_limit: int, queues: Iterable[str]) -> None:
    if delivery_limit < 1:
        raise ValueError(f"delivery limit must be at least 1, got {delivery_limit}")
    for name in queues:
        _check_task_queue(name)


@dataclass(frozen=True)
class TaskQueueLayout:
    """The broker objects behind task queue ``queue`` for one contract version: the contract queue, its
    binding, and the dead-letter queue (with its binding) that every contract queue of ``queue`` shares.

    Declared alike by ``saga topology apply``, by the orchestrator before it first sends a task there (so a
    task for a contract no worker has served yet waits in its queue instead of being unroutable) and by
    every worker that serves the contract. No ``x-single-active-consumer`` on the serial queue's contract
    queues: workers of different contracts consume them side by side, and one Redis lease held while a
    handler runs keeps serial tasks one at a time (``workers/serial_lane.py``)."""

    queue: Queue
    binding: Binding
    dead_letters: Queue
    dead_letter_binding: Binding

    @classmethod
    def of(
        cls, names: Names, queue: str, contract: str, delivery_limit: int, group_size: int | None = None
    ) -> TaskQueueLayout:
        name = names.task_queue(queue, contract)
        dlq = names.task_dead_letters(queue)
        return cls(
            # a poison task (one that kills its worker every time) reaches the DLQ after the delivery limit
            _dead_lettered(name, dlq, names, {"x-delivery-limit": delivery_limit}, group_size),
            Binding(names.tasks_exchange, name, name),
            _plain(dlq, group_size),
            Binding(names.dead_letter_exchange, dlq, dlq),
        )


def build_topology(
    names: Names,
    shard_map: ShardMap,
    task_queues: Iterable[tuple[str, str]],
    delivery_limit: int,
    group_size: int | None = None,
) -> Topology:
    """Every exchange and queue the orchestrator uses, and the contract queues of ``task_queues`` (pairs of
    task queue and contract ``name@version``), each quorum queue with ``group_size`` replicas (None: the
    broker's default). Pure and deterministic.

    Shards follow the map: an active shard's queue is bound to its class's start exchange and to the runs
    exchange; a draining one only to the runs exchange (no new starts, its runs still reach it); a retired
    one is not there at all. Raises ValueError for settings no broker layout can satisfy (a delivery limit
    below 1, a task queue with an orchestrator-reserved name)."""
    pairs = sorted(set(task_queues))
    _check_settings(delivery_limit, {queue for queue, _ in pairs})

    exchanges: list[Exchange] = [
        Exchange(names.runs_exchange, DIRECT),
        Exchange(names.tasks_exchange, DIRECT),
        Exchange(names.events_exchange, TOPIC),
        Exchange(names.dead_letter_exchange, DIRECT),
    ]
    queues: list[Queue] = []
    bindings: list[Binding] = []

    for shard_class in shard_map.classes:
        exchanges.append(Exchange(names.start_exchange(shard_class), CONSISTENT_HASH))
    for entry in shard_map.shards:
        if entry.state is ShardState.RETIRED:
            continue
        name = names.shard_queue(entry.id)
        dlq = dead_letter_queue(name)
        queues.append(
            _dead_lettered(
                name,
                dlq,
                names,
                {"x-single-active-consumer": True, "x-delivery-limit": delivery_limit},
                group_size,
            )
        )
        if entry.state is ShardState.ACTIVE:
            bindings.append(Binding(names.start_exchange(entry.shard_class), name, HASH_WEIGHT))
        bindings.append(Binding(names.runs_exchange, name, entry.id))
        queues.append(_plain(dlq, group_size))
        bindings.append(Binding(names.dead_letter_exchange, dlq, dlq))

    dead_letter_queues: dict[str, tuple[Queue, Binding]] = {}
    for queue, contract in pairs:
        layout = TaskQueueLayout.of(names, queue, contract, delivery_limit, group_size)
        queues.append(layout.queue)
        bindings.append(layout.binding)
        dead_letter_queues[layout.dead_letters.name] = (layout.dead_letters, layout.dead_letter_binding)
    for dead_letters, binding in dead_letter_queues.values():
        queues.append(dead_letters)
        bindings.append(binding)

    queues.append(_plain(names.rejected_queue, group_size))
    return Topology(tuple(exchanges), tuple(queues), tuple(bindings))


def serving_queues(contracts: Iterable[Contract], queues: Iterable[str] = ()) -> list[tuple[str, str]]:
    """The (task queue, contract) pairs served for ``contracts``: each contract on the task queues named,
    or, when none are, on its own default queue and on every built-in one (a stage may send any contract
    to a built-in queue)."""
    chosen = tuple(queues)
    pairs = set()
    for contract in contracts:
        for queue in chosen or (contract.queue, *BUILTIN_TASK_QUEUES):
            pairs.add((queue, contract.ref))
    return sorted(pairs)


def topology_for(settings: Settings, registry: Registry, shard_map: ShardMap | None = None) -> Topology:
    """The topology of ``shard_map`` (None: the first map the settings seed)."""
    chosen = shard_map or ShardMap.seed(settings.shard_classes, settings.shard_count)
    return build_topology(
        settings.names(),
        chosen,
        serving_queues(registry.contracts()),
        settings.delivery_limit,
        settings.quorum_group_size,
    )


# ---- definitions.json ------------------------------------------------------------------------------------


def _natural(name: str) -> tuple[tuple[int, int | str], ...]:
    """``orch.fast.2`` sorts before ``orch.fast.10``."""
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in re.split(r"(\d+)", name) if p)


def to_definitions(
    topology: Topology,
    vhost: str = "/",
    users: Sequence[tuple[str, str]] = (),
    role_users: Sequence[tuple[str, str, tuple[str, str, str]]] = (),
) -> dict[str, Any]:
    """The topology in RabbitMQ's definitions format (``load_definitions`` / ``rabbitmqctl
    import_definitions``), in a stable order.

    ``users`` are (name, password) pairs given administrator tags and full permissions on ``vhost``: a node
    that loads definitions at boot does not create ``default_user``/``default_vhost`` from rabbitmq.conf, so
    a file meant for boot must carry its own vhost and users. ``role_users`` are (name, password,
    (configure, write, read)): each role's user with only its permissions (``orchestrator/access.py``)."""
    out: dict[str, Any] = {
        "vhosts": [{"name": vhost}],
        "exchanges": [
            {
                "name": e.name,
                "vhost": vhost,
                "type": e.type,
                "durable": True,
                "auto_delete": False,
                "internal": False,
                "arguments": dict(e.arguments),
            }
            for e in sorted(topology.exchanges, key=lambda e: _natural(e.name))
        ],
        "queues": [
            {
                "name": q.name,
                "vhost": vhost,
                "durable": True,
                "auto_delete": False,
                "arguments": dict(q.arguments),
            }
            for q in sorted(topology.queues, key=lambda q: _natural(q.name))
        ],
        "bindings": [
            {
                "source": b.source,
                "vhost": vhost,
                "destination": b.destination,
                "destination_type": "queue",
                "routing_key": b.routing_key,
                "arguments": dict(b.arguments),
            }
            for b in sorted(
                topology.bindings,
                key=lambda b: (_natural(b.source), _natural(b.destination), _natural(b.routing_key)),
            )
        ],
    }
    if users or role_users:
        out["users"] = [
            {"name": name, "password": password, "tags": "administrator"} for name, password in sorted(users)
        ] + [{"name": name, "password": password, "tags": ""} for name, password, _ in sorted(role_users)]
        out["permissions"] = [
            {"user": name, "vhost": vhost, "configure": ".*", "write": ".*", "read": ".*"}
            for name, _ in sorted(users)
        ] + [
            {"user": name, "vhost": vhost, "configure": c, "write": w, "read": r}
            for name, _, (c, w, r) in sorted(role_users)
        ]
    return out


# ---- applying to a live broker ---------------------------------------------------------------------------


def _table(arguments: Arguments) -> FieldTable:
    return dict(arguments)


async def apply_topology(channel: aio_pika.abc.AbstractChannel, topology: Topology) -> None:
    """Declare every exchange, queue and binding (durable; idempotent while arguments are unchanged).

    Raises aiormq's ``ChannelPreconditionFailed`` when something exists with other arguments or type."""
    exchanges: dict[str, aio_pika.abc.AbstractExchange] = {}
    for exchange in topology.exchanges:
        exchanges[exchange.name] = await channel.declare_exchange(
            exchange.name, exchange.type, durable=True, arguments=_table(exchange.arguments)
        )
    queues: dict[str, aio_pika.abc.AbstractQueue] = {}
    for queue in topology.queues:
        queues[queue.name] = await channel.declare_queue(
            queue.name, durable=True, arguments=_table(queue.arguments)
        )
    for binding in topology.bindings:
        await queues[binding.destination].bind(
            exchanges[binding.source], binding.routing_key, arguments=_table(binding.arguments)
        )


async def declare_task_queue(channel: aio_pika.abc.AbstractChannel, layout: TaskQueueLayout) -> None:
    """Declare one contract queue, its dead-letter queue and their bindings (idempotent). The exchanges
    must exist: ``saga topology apply`` makes them, and aiormq's ``ChannelNotFoundEntity`` says they don't."""
    dlq = await channel.declare_queue(
        layout.dead_letters.name, durable=True, arguments=_table(layout.dead_letters.arguments)
    )
    await dlq.bind(layout.dead_letter_binding.source, layout.dead_letter_binding.routing_key)
    queue = await channel.declare_queue(
        layout.queue.name, durable=True, arguments=_table(layout.queue.arguments)
    )
    await queue.bind(layout.binding.source, layout.binding.routing_key)


__all__ = [
    "CONSISTENT_HASH",
    "HASH_WEIGHT",
    "Binding",
    "Exchange",
    "Queue",
    "TaskQueueLayout",
    "Topology",
    "apply_topology",
    "build_topology",
    "declare_task_queue",
    "serving_queues",
    "to_definitions",
    "topology_for",
]

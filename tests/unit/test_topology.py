"""The broker topology is one pure function of settings (DESIGN section 4); rabbitmq/definitions.json is its
export and must stay in sync with it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from orchestrator.access import AccessRole, rabbitmq_permissions
from orchestrator.bus.names import Names
from orchestrator.bus.topology import (
    Binding,
    Queue,
    TaskQueueLayout,
    Topology,
    build_topology,
    serving_queues,
    to_definitions,
    topology_for,
)
from orchestrator.cli import main
from orchestrator.contracts import Registry
from orchestrator.settings import Settings
from orchestrator.shardmap import ShardMap

ROOT = Path(__file__).resolve().parents[2]
DEFINITIONS_FILE = ROOT / "rabbitmq" / "definitions.json"
#: The compose broker loads the file at boot, which skips rabbitmq.conf's default_user: the file carries it.
COMPOSE_USERS = [("saga", "saga-dev-password")]
#: ... and a least-privilege user per role (orchestrator/access.py), with placeholder passwords
COMPOSE_ROLES = ("orchestrator", "worker", "client", "server")
ROLE_OPTIONS = [f"--role-user={role}:{role}-dev-password" for role in COMPOSE_ROLES]
REGENERATE = (
    "saga topology export --user saga:saga-dev-password "
    + " ".join(ROLE_OPTIONS)
    + " --output rabbitmq/definitions.json"
)

NAMES = Names()
RUNS_EXCHANGE, TASKS_EXCHANGE = NAMES.runs_exchange, NAMES.tasks_exchange
EVENTS_EXCHANGE, DEAD_LETTER_EXCHANGE = NAMES.events_exchange, NAMES.dead_letter_exchange
REJECTED_QUEUE = NAMES.rejected_queue
TASK_QUEUES = ["tasks.serial", "tasks.parallel", "tasks.actions"]
NAMED_QUEUES = ["analysis", "metadata", "rendering"]  # declared by workers.demo contracts
SHARDS = [f"saga.shard.{c}.{n}" for c in ("fast", "slow") for n in range(4)]


@pytest.fixture(autouse=True)
def _default_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Settings() here means the defaults, whatever SAGA_* the shell running the tests exports."""
    for key in list(os.environ):
        if key.startswith("SAGA_"):
            monkeypatch.delenv(key)
    # no Redis: export then describes the first shard map the settings seed, whatever the machine's
    # Redis holds for the default namespace
    monkeypatch.setenv("SAGA_REDIS_URL", "redis://127.0.0.1:1/0")


@pytest.fixture(scope="module")
def topo(registry: Registry) -> Topology:
    return build_topology(NAMES, ShardMap.seed(("fast", "slow"), 4), serving_queues(registry.contracts()), 20)


def _names(queues: tuple[Queue, ...]) -> list[str]:
    return [q.name for q in queues]


# ---- exchanges ---------------------------------------------------------------------------------------------


def test_exchanges_and_types(topo: Topology) -> None:
    assert {e.name: e.type for e in topo.exchanges} == {
        RUNS_EXCHANGE: "direct",
        TASKS_EXCHANGE: "direct",
        EVENTS_EXCHANGE: "topic",
        DEAD_LETTER_EXCHANGE: "direct",
        "saga.start.fast": "x-consistent-hash",
        "saga.start.slow": "x-consistent-hash",
    }
    assert all(dict(e.arguments) == {} for e in topo.exchanges)


# ---- shard queues ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SHARDS)
def test_shard_queue_arguments(topo: Topology, name: str) -> None:
    assert dict(topo.queue(name).arguments) == {
        "x-queue-type": "quorum",
        "x-single-active-consumer": True,
        "x-delivery-limit": 20,
        "x-dead-letter-exchange": "saga.dlx",
        "x-dead-letter-routing-key": f"{name}.dlq",
        "x-dead-letter-strategy": "at-least-once",
        "x-overflow": "reject-publish",
    }


@pytest.mark.parametrize("name", SHARDS)
def test_shard_queue_bindings(topo: Topology, name: str) -> None:
    _, _, shard_class, number = name.split(".")
    assert set(topo.bindings_to(name)) == {
        Binding(f"saga.start.{shard_class}", name, "1"),  # consistent-hash weight
        Binding(RUNS_EXCHANGE, name, f"{shard_class}.{number}"),
    }


def test_shard_count_and_delivery_limit_come_from_the_arguments() -> None:
    topo = build_topology(NAMES, ShardMap.seed(("fast",), 12), [], 7)
    shards = [q for q in topo.queues if q.name.startswith("saga.shard.") and not q.name.endswith(".dlq")]
    assert _names(tuple(shards)) == [f"saga.shard.fast.{n}" for n in range(12)]
    assert {q.arguments["x-delivery-limit"] for q in shards} == {7}
    assert "saga.start.slow" not in {e.name for e in topo.exchanges}


# ---- task queues -------------------------------------------------------------------------------------------


def _contract_queues(topo: Topology) -> list[str]:
    return [b.destination for b in topo.bindings if b.source == TASKS_EXCHANGE]


def test_contract_queue_arguments_and_binding(topo: Topology, registry: Registry) -> None:
    for queue, contract in serving_queues(registry.contracts()):
        name = f"saga.task.{queue}:{contract}"
        assert dict(topo.queue(name).arguments) == {
            "x-queue-type": "quorum",
            "x-dead-letter-exchange": "saga.dlx",
            "x-dead-letter-routing-key": f"saga.task.{queue}.dlq",  # shared by the queue's contracts
            "x-dead-letter-strategy": "at-least-once",
            "x-overflow": "reject-publish",
            "x-delivery-limit": 20,  # a poison task reaches its DLQ instead of looping forever
        }
        assert topo.bindings_to(name) == [Binding(TASKS_EXCHANGE, name, name)]


def test_no_single_active_consumer_on_task_queues(topo: Topology) -> None:
    """tasks.serial is made serial by the serial lane: a single active consumer would hand every serial
    task to one worker, whether it serves the contract or not."""
    assert not any(topo.queue(n).arguments.get("x-single-active-consumer") for n in _contract_queues(topo))


def test_a_contract_is_served_on_its_own_queue_and_every_builtin_one(registry: Registry) -> None:
    render = next(c for c in registry.contracts() if c.queue == "rendering")
    assert serving_queues([render]) == sorted((q, render.ref) for q in ["rendering", *TASK_QUEUES])
    assert serving_queues([render], ["tasks.serial"]) == [("tasks.serial", render.ref)]


def test_named_queues_from_contracts_are_present(registry: Registry, topo: Topology) -> None:
    assert {c.queue for c in registry.contracts()} >= set(NAMED_QUEUES)
    for contract in registry.contracts():
        assert f"saga.task.{contract.queue}:{contract.ref}" in _contract_queues(topo)


def test_contract_queues_are_deduplicated_and_sorted() -> None:
    pairs = [("zeta", "b@1"), ("alpha", "a@1"), ("zeta", "b@1"), ("tasks.serial", "a@1")]
    topo = build_topology(NAMES, ShardMap.seed(("fast",), 1), pairs, 20)
    assert _contract_queues(topo) == [
        "saga.task.alpha:a@1",
        "saga.task.tasks.serial:a@1",
        "saga.task.zeta:b@1",
    ]


def test_no_task_queue_without_a_contract() -> None:
    topo = build_topology(NAMES, ShardMap.seed(("fast",), 1), [], 20)
    assert _contract_queues(topo) == []


@pytest.mark.parametrize("name", ["orch.fast.9", "saga.rejected", "saga.anything", "rendering.dlq", "amq.x"])
def test_task_queues_with_reserved_names_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match=f"task queue '{name}' uses a reserved name"):
        build_topology(NAMES, ShardMap.seed(("fast",), 4), [(name, "x@1")], 20)


@pytest.mark.parametrize(
    ("classes", "count", "limit", "message"),
    [
        ((), 4, 20, "at least one shard class"),
        (("fast", "fast"), 4, 20, "listed twice"),
        (("fast",), 0, 20, "shard count must be at least 1"),
        (("fast",), 4, 0, "delivery limit must be at least 1"),
    ],
)
def test_impossible_settings_are_refused(
    classes: tuple[str, ...], count: int, limit: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        build_topology(NAMES, ShardMap.seed(classes, count), [], limit)


# ---- dead letters and saga.rejected ------------------------------------------------------------------------


def test_every_queue_has_its_dead_letter_queue(topo: Topology) -> None:
    names = set(_names(topo.queues))
    primaries = {n for n in names if not n.endswith(".dlq") and n != REJECTED_QUEUE}
    for name in primaries:
        args = topo.queue(name).arguments
        assert args["x-dead-letter-exchange"] == DEAD_LETTER_EXCHANGE
        dlq = str(args["x-dead-letter-routing-key"])
        assert dlq in names
        assert topo.bindings_to(dlq) == [Binding(DEAD_LETTER_EXCHANGE, dlq, dlq)]
    assert {n for n in names if n.endswith(".dlq")} == {
        *(f"{s}.dlq" for s in SHARDS),
        *(f"saga.task.{q}.dlq" for q in TASK_QUEUES + NAMED_QUEUES),
    }


def test_dead_letter_queues_and_rejected_are_plain_quorum_queues(topo: Topology) -> None:
    plain = [q for q in topo.queues if q.name.endswith(".dlq") or q.name == REJECTED_QUEUE]
    assert len(plain) == len(SHARDS + TASK_QUEUES + NAMED_QUEUES) + 1
    for queue in plain:
        assert dict(queue.arguments) == {"x-queue-type": "quorum"}, queue.name
    assert topo.bindings_to(REJECTED_QUEUE) == []  # published through the default exchange


def test_every_binding_joins_a_declared_exchange_and_queue(topo: Topology) -> None:
    exchanges = {e.name for e in topo.exchanges}
    queues = set(_names(topo.queues))
    assert len(queues) == len(topo.queues)  # no queue declared twice
    for binding in topo.bindings:
        assert binding.source in exchanges
        assert binding.destination in queues
    assert len(set(topo.bindings)) == len(topo.bindings)


# ---- purity, determinism, settings -------------------------------------------------------------------------


def test_deterministic(registry: Registry) -> None:
    queues = serving_queues(registry.contracts())
    first = build_topology(NAMES, ShardMap.seed(("fast", "slow"), 4), queues, 20)
    again = build_topology(NAMES, ShardMap.seed(("fast", "slow"), 4), list(reversed(queues)) + queues, 20)
    assert first == again
    assert json.dumps(to_definitions(first)) == json.dumps(to_definitions(again))


def test_values_are_immutable(topo: Topology) -> None:
    queue = topo.queue("saga.shard.fast.0")
    with pytest.raises(TypeError):
        queue.arguments["x-delivery-limit"] = 1  # type: ignore[index]
    assert hash(queue) == hash(topo.queue("saga.shard.fast.0"))


def test_topology_for_reads_settings_and_registry(registry: Registry) -> None:
    settings = Settings(shard_classes=("fast",), shard_count=2, delivery_limit=5)
    topo = topology_for(settings, registry)
    assert topo == build_topology(NAMES, ShardMap.seed(("fast",), 2), serving_queues(registry.contracts()), 5)
    assert topo.queue("saga.shard.fast.1").arguments["x-delivery-limit"] == 5


def test_the_quorum_group_size_is_the_broker_s_default_unless_set(registry: Registry, topo: Topology) -> None:
    assert all("x-quorum-initial-group-size" not in q.arguments for q in topo.queues)
    sized = topology_for(Settings(quorum_group_size=3), registry)
    assert {q.arguments.get("x-quorum-initial-group-size") for q in sized.queues} == {3}
    assert all(q.arguments["x-queue-type"] == "quorum" for q in sized.queues)
    # a contract queue declared later (by a worker or the orchestrator) is sized alike
    layout = TaskQueueLayout.of(NAMES, "tasks.parallel", "x@1", 20, 3)
    assert layout.queue.arguments["x-quorum-initial-group-size"] == 3
    assert layout.dead_letters.arguments["x-quorum-initial-group-size"] == 3


def test_a_namespace_renames_every_exchange_and_queue(registry: Registry) -> None:
    topo = topology_for(Settings(namespace="blue"), registry)
    assert all(e.name.startswith("blue.") for e in topo.exchanges)
    assert all(q.name.startswith("blue.") for q in topo.queues)
    assert all(b.source.startswith("blue.") for b in topo.bindings)


# ---- definitions.json --------------------------------------------------------------------------------------


def test_definitions_format(topo: Topology) -> None:
    defs = to_definitions(topo, vhost="v1")
    assert set(defs) == {"vhosts", "exchanges", "queues", "bindings"}
    assert defs["vhosts"] == [{"name": "v1"}]
    assert len(defs["exchanges"]) == len(topo.exchanges)
    assert len(defs["queues"]) == len(topo.queues)
    assert len(defs["bindings"]) == len(topo.bindings)
    for exchange in defs["exchanges"]:
        assert exchange["vhost"] == "v1"
        assert (exchange["durable"], exchange["auto_delete"], exchange["internal"]) == (True, False, False)
    for queue in defs["queues"]:
        assert (queue["vhost"], queue["durable"], queue["auto_delete"]) == ("v1", True, False)
        assert queue["arguments"] == dict(topo.queue(queue["name"]).arguments)
    for binding in defs["bindings"]:
        assert (binding["vhost"], binding["destination_type"]) == ("v1", "queue")
    start = next(e for e in defs["exchanges"] if e["name"] == "saga.start.fast")
    assert start["type"] == "x-consistent-hash"


def test_definitions_order_is_natural() -> None:
    defs = to_definitions(build_topology(NAMES, ShardMap.seed(("fast",), 12), [], 20))
    shards = [
        q["name"] for q in defs["queues"] if q["name"].startswith("saga.shard") and "dlq" not in q["name"]
    ]
    assert shards == [f"saga.shard.fast.{n}" for n in range(12)]


def test_definitions_users() -> None:
    defs = to_definitions(
        build_topology(NAMES, ShardMap.seed(("fast",), 1), [], 20), "v", [("b", "pw-b"), ("a", "pw-a")]
    )
    assert defs["users"] == [
        {"name": "a", "password": "pw-a", "tags": "administrator"},
        {"name": "b", "password": "pw-b", "tags": "administrator"},
    ]
    assert defs["permissions"] == [
        {"user": u, "vhost": "v", "configure": ".*", "write": ".*", "read": ".*"} for u in ("a", "b")
    ]


def _export(*args: str) -> str:
    result = CliRunner().invoke(main, ["topology", "export", *args])
    assert result.exit_code == 0, result.output
    return result.stdout


def test_export_command_prints_sorted_json_with_trailing_newline(registry: Registry) -> None:
    text = _export()
    assert text.endswith("}\n")
    expected = to_definitions(topology_for(Settings(), registry))
    assert text == json.dumps(expected, indent=2, sort_keys=True) + "\n"


def test_export_command_writes_a_file(tmp_path: Path) -> None:
    out = tmp_path / "defs.json"
    result = CliRunner().invoke(main, ["topology", "export", "--vhost", "x", "--output", str(out)])
    assert result.exit_code == 0, result.output
    assert "6 exchanges, 59 queues, 66 bindings" in result.stderr
    assert json.loads(out.read_text())["vhosts"] == [{"name": "x"}]
    assert out.read_text() == _export("--vhost", "x")


def test_export_command_rejects_a_user_without_password() -> None:
    result = CliRunner().invoke(main, ["topology", "export", "--user", "saga"])
    assert result.exit_code == 2
    assert "is not NAME:PASSWORD" in result.output


def test_export_command_reports_reserved_queue_names(tmp_path: Path) -> None:
    reg = tmp_path / "registry.json"
    contract = {
        "name": "x.y",
        "version": 1,
        "kind": "worker",
        "queue": "orch.fast.0",
        "input_schema": {"type": "object"},
        "output_schema": {"type": "object"},
    }
    reg.write_text(json.dumps({"contracts": [contract]}))
    result = CliRunner().invoke(main, ["topology", "export", "--registry", str(reg)])
    assert result.exit_code == 2
    assert "reserved name" in result.output


def test_apply_command_names_an_unreachable_broker_without_its_password(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SAGA_AMQP_URL", "amqp://someone:s3cret-pw@127.0.0.1:1/some-vhost")
    result = CliRunner().invoke(main, ["topology", "apply"])
    assert result.exit_code == 2, result.output
    assert "cannot connect to RabbitMQ at amqp://someone:***@127.0.0.1:1/some-vhost" in result.output
    assert "s3cret-pw" not in result.output


def test_definitions_file_is_in_sync_with_the_topology() -> None:
    """rabbitmq/definitions.json is generated from the default settings and registry: after changing either
    (or bus names, or the topology), regenerate it."""
    settings = Settings()
    roles = []
    for role in COMPOSE_ROLES:
        allowed = rabbitmq_permissions(settings.namespace, AccessRole(role))
        roles.append(
            (f"saga-{role}", f"{role}-dev-password", (allowed.configure, allowed.write, allowed.read))
        )
    expected = to_definitions(
        topology_for(settings, Registry.from_modules(settings.contracts)), "/", COMPOSE_USERS, roles
    )
    text = json.dumps(expected, indent=2, sort_keys=True) + "\n"
    assert DEFINITIONS_FILE.read_text() == text, (
        f"{DEFINITIONS_FILE.relative_to(ROOT)} is out of date with the topology; run `{REGENERATE}`"
    )
    assert _export("--user", "saga:saga-dev-password", *ROLE_OPTIONS) == text

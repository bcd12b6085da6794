"""The orchestrator, workers and clients on a 3-node RabbitMQ cluster (SAGA_AMQP_URL listing every node).

Quorum queues are replicated on all three nodes; one node, the one that leads every queue, is killed hard
under load. Every start a client saw confirmed becomes a run that completes, nothing is lost or applied
twice (the fault suite's invariant checks), and every shard and task queue is consumed again from a live
node within 30 s."""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pika.exceptions
import pytest

from orchestrator.client import SyncClient
from tests.cluster.rabbit import SERVER, LocalRabbitCluster
from tests.faults import invariants
from tests.integration.stack import Stack, poll

pytestmark = [
    pytest.mark.services,
    pytest.mark.skipif(
        not Path(SERVER).exists() or os.geteuid() != 0,
        reason=f"starts extra RabbitMQ nodes with {SERVER} as the rabbitmq user: needs that install and root",
    ),
]

RUNS = 90
KILL_AFTER = 30  # confirmed starts before the node is killed
TAKEOVER_S = 30.0


@pytest.fixture(scope="module")
def rabbit_cluster() -> Iterator[LocalRabbitCluster]:
    found = LocalRabbitCluster(3)
    try:
        found.start()
        yield found
    finally:
        found.stop()


@pytest.fixture(scope="module")
def stack(rabbit_cluster: LocalRabbitCluster) -> Iterator[Stack]:
    # rabbitmqctl asks the last node: the test kills the first
    s = Stack(
        "rmq",
        amqp_hosts=rabbit_cluster.hosts,
        rabbitmq_node=rabbit_cluster.nodes[-1].name,
        env={"SAGA_QUORUM_GROUP_SIZE": "3"},
    )
    s.settings = s.settings.model_copy(update={"quorum_group_size": 3})  # topology apply declares alike
    s.setup()
    try:
        yield s
    finally:
        # deleting quorum queues with a member down waits on it: the cluster goes away whole instead
        s.teardown(drop_vhost=False)


def queue_rows(stack: Stack, *columns: str) -> list[dict[str, object]]:
    out = stack.rabbitmqctl("list_queues", "-p", stack.vhost, "name", *columns, "--formatter", "json")
    return json.loads(out)  # type: ignore[no-any-return]


def leaders(stack: Stack) -> dict[str, str]:
    """Each quorum queue's leader node (the workers' exclusive queues for cancel events are classic, on
    whichever node each worker is connected to)."""
    rows = queue_rows(stack, "type", "leader")
    return {str(row["name"]): str(row["leader"]) for row in rows if row["type"] == "quorum"}


def served_queues(stack: Stack) -> list[str]:
    """Every shard queue and contract queue (the ones a process must consume), not dead-letter queues."""
    names = [str(row["name"]) for row in queue_rows(stack)]
    return [n for n in names if re.search(r"\.shard\.|\.task\.", n) and not n.endswith(".dlq")]


def wait_consumed(stack: Stack, live_nodes: set[str], timeout_s: float) -> None:
    """Until every shard and task queue has a consumer on a live node; on timeout, say which have none."""
    try:
        poll(lambda: set(served_queues(stack)) <= consumed_from(stack, live_nodes), timeout_s, interval_s=0.5,
             what="every shard and task queue to be consumed from a live node")  # fmt: skip
    except AssertionError as exc:
        missing = set(served_queues(stack)) - consumed_from(stack, live_nodes)
        raise AssertionError(f"{exc}: not consumed: {sorted(missing)}") from None


def consumed_from(stack: Stack, live_nodes: set[str]) -> set[str]:
    """Queues with a consumer whose channel is on a live node (a channel pid names its node)."""
    # the table form names a channel's node (<node.a.b.c>); the JSON form gives a bare #PID<...>
    out = stack.rabbitmqctl("list_consumers", "-p", stack.vhost, "queue_name", "channel_pid")
    found = set()
    for line in out.splitlines():
        queue, _, pid = line.partition("\t")
        node = re.match(r"<(.+@[^.]+)\.", pid)
        if node and node.group(1) in live_nodes:
            found.add(queue)
    return found


def start_with_retries(stack: Stack, key: str, confirmed: list[str], deadline: float) -> None:
    """Start one run as a service would: until the broker confirms it, retry with the same idempotency
    key (so a start that reached the broker before its connection died makes one run, not two)."""
    while True:
        run_id: str | None = None
        try:
            with SyncClient(stack.settings) as client:
                run_id = client.start("model-ingest", {"modelId": key}, idempotency_key=key)
        except (pika.exceptions.AMQPError, OSError):
            # Closing the connection can fail after the broker confirmed the start (its node died
            # between the two): the start is made, and is counted once
            if run_id is None:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
                continue
        confirmed.append(run_id)
        return


def stuck_report(stack: Stack, run_ids: list[str]) -> str:
    """What a run that did not finish last did and what the processes said of it, for the failure."""
    lines = [f"queue depths: {stack.queue_depths()}"]
    logs = {name: stack.log(name) for name in ("orch-a", "orch-b", "worker-a", "worker-b")}
    for run_id in run_ids:
        record = stack.record(run_id)
        if record.get("status") in ("completed", "failed", "cancelled"):
            continue
        lines.append(f"run {run_id}: {json.dumps(record)[:600]}")
        for event in stack.history(run_id)[-8:]:
            lines.append(f"  {json.dumps(event)[:300]}")
        for name, text in logs.items():
            lines += [f"  {name}: {line[:300]}" for line in text.splitlines() if run_id in line][-6:]
    for name, text in logs.items():  # what each process said of the broker, whichever run it was about
        said = [line for line in text.splitlines() if " WARNING " in line or " ERROR " in line]
        lines += [f"  {name} said: {line[:240]}" for line in said[-25:]]
    return "\n".join(lines)


def test_quorum_queues_are_replicated_on_every_node(stack: Stack, rabbit_cluster: LocalRabbitCluster) -> None:
    everyone = sorted(node.name for node in rabbit_cluster.nodes)
    rows = queue_rows(stack, "type", "members")
    assert rows, "the topology declared no queue"
    for row in rows:
        assert row["type"] == "quorum", row
        assert sorted(row["members"]) == everyone, row  # type: ignore[arg-type]


def test_a_node_killed_under_load_loses_no_confirmed_message(
    stack: Stack, rabbit_cluster: LocalRabbitCluster
) -> None:
    # Given two orchestrators and two workers, their connections spread over the three nodes
    for name in ("orch-a", "orch-b"):
        stack.start_orchestrator(name)
    for name in ("worker-a", "worker-b"):
        stack.start_worker(name)
    wait_consumed(stack, {n.name for n in rabbit_cluster.nodes}, 60)
    doomed = rabbit_cluster.nodes[0]  # topology apply declared every queue there: it leads them all
    led = leaders(stack)
    assert set(led.values()) == {doomed.name}, {
        queue: node for queue, node in led.items() if node != doomed.name
    }

    # When runs are started in a steady stream and the node leading every queue is killed midway
    confirmed: list[str] = []
    deadline = time.monotonic() + 120
    starter = threading.Thread(
        target=lambda: [
            (start_with_retries(stack, f"rmq-{i}", confirmed, deadline), time.sleep(0.02))
            for i in range(RUNS)
        ],
        daemon=True,
    )
    starter.start()
    poll(lambda: len(confirmed) >= KILL_AFTER, 60, what=f"{KILL_AFTER} confirmed starts")
    rabbit_cluster.kill(doomed)
    killed_at = time.monotonic()
    live = {node.name for node in rabbit_cluster.live()}

    # Then every shard and task queue has a consumer on a live node again within 30 s
    wait_consumed(stack, live, TAKEOVER_S)
    took_s = time.monotonic() - killed_at
    print(f"consumed again {took_s:.1f} s after the kill")
    assert set(leaders(stack).values()) <= live

    # And every confirmed start became one run that completed, with the invariants intact
    starter.join(timeout=150)
    assert not starter.is_alive(), "the starts did not finish"
    assert len(confirmed) == RUNS and len(set(confirmed)) == RUNS
    left = invariants.wait_for_convergence(stack.redis, stack.prefix, confirmed, timeout_s=90)
    assert left == [], f"{len(left)} runs did not finish, e.g. {left[:3]}\n{stuck_report(stack, confirmed)}"
    for run_id in confirmed:
        assert stack.record(run_id)["status"] == "completed", run_id
    invariants.assert_no_violations(
        invariants.check_runs(stack.redis, stack.prefix, confirmed, all_runs=True), "the invariants"
    )
    assert invariants.dead_letters(stack.queue_depths()) == []

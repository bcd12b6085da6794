"""Sensitive values against the real services (orchestrator/redaction.py): a run of a definition whose
context and contracts mark a card number and a token sensitive completes, its worker gets the real
values, and neither value appears anywhere a person or a tool looks: the run's history stream as Redis
holds it, the orchestrator's and the worker's logs, ``saga status`` and ``saga history``, the API, and
the dead-letter listing and ``show`` of a message that carried one. Each appears as a marker with a keyed
hash, the same marker wherever the same value is."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from orchestrator.auth.roles import Role
from orchestrator.auth.tokens import TokenStore
from orchestrator.bus.envelope import Envelope, Signer, encode
from orchestrator.client import SyncClient
from orchestrator.contracts import Registry
from orchestrator.keys.ring import Scope
from orchestrator.keys.ringfile import load_ring
from orchestrator.provision import provision
from orchestrator.sealing import Sealer
from orchestrator.settings import redis_client
from orchestrator.store.keys import ShardKeys
from orchestrator.wire import ids
from orchestrator.wire.kinds import Kind
from tests.faults.invariants import assert_sound
from tests.integration.refusals import NAMES, parked_one
from tests.integration.rings import active, write_ring
from tests.integration.served import serve
from tests.integration.stack import Stack, now_ms, poll

pytestmark = pytest.mark.services

PROBES = Path(__file__).parent / "probe_apps"
APP = "tests.integration.probe_apps.payments"
CARD = "4111222233334444"
TOKEN = "tok-" + CARD[::-1]
MARKER = re.compile(r"\[sensitive:[0-9a-f]{8}\]")


RING = [
    active("orch", Scope.ORCHESTRATOR),
    active("dispatch", Scope.DISPATCH),
    active("pool", Scope.WORKER, contracts=["*"]),
    active("client", Scope.CLIENT, tenants=["default"]),
    active("server", Scope.SERVER, tenants=["*"]),
    active("data", Scope.DATA),
]


@pytest.fixture(scope="module", params=[False, True], ids=["as-given", "sealed-at-rest"])
def paying(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Stack, Path, str]]:
    """The stack, with sensitive values kept in Redis as given, then sealed (SAGA_ENCRYPT_SENSITIVE)."""
    folder = tmp_path_factory.mktemp("redaction")
    write_ring(folder / "ring.yaml", RING)
    env = {
        "SAGA_KEY_RING_FILE": str(folder / "ring.yaml"),
        "SAGA_ENCRYPT_SENSITIVE": str(request.param).lower(),
    }
    stack = Stack("redaction", env=env)
    stack.setup()
    asyncio.run(provision(stack.settings, Registry.from_modules([APP]), [PROBES / "probe-payment.yaml"]))
    try:
        stack.start_orchestrator()
        stack.start_worker("worker", "--app", APP)
        yield stack, folder, serve(stack)
    finally:
        stack.teardown()


def test_sensitive_values_reach_the_worker_and_nowhere_else(paying: tuple[Stack, Path, str]) -> None:
    stack, folder, base = paying
    settings = stack.settings.model_copy(update={"key_ring_file": str(folder / "ring.yaml")})
    # Given a run charging a card, whose first attempt fails quoting the card
    with SyncClient(settings) as client:
        run_id = client.start("probe-payment", {"card": CARD, "amount": 42})
        assert client.wait(run_id, timeout_s=60).state == "completed"
    record = stack.record(run_id)
    # Then the worker got the real card (its token is derived from it) and the run kept what it needs
    kept = Sealer(lambda: load_ring(folder / "ring.yaml", 0, {})).unseal_record(record, run_id)
    assert json.loads(kept["s:charge:result"])["token"] == TOKEN
    # And a result that carried the token, replayed too late, is parked on saga.rejected
    keys = Signer(load_ring(folder / "ring.yaml", 0, {}))
    late = keys.sign(
        Envelope(
            kind=Kind.RESULT,
            message_id=ids.result_id(ids.stage_task_id(run_id, "charge", record["s:charge:fence"], None, 2)),
            run_id=run_id,
            shard=record["shard"],
            stage="charge",
            attempt=2,
            fence=record["s:charge:fence"],
            digest=record["digest"],
            contract="probe.charge@1",
            issued_at_ms=now_ms() - 3 * 86_400_000,
            body={"ok": True, "result": {"token": TOKEN, "last4": "4444"}},
        )
    )
    stack.publish_raw(NAMES.runs_exchange, record["shard"], encode(late))
    poll(lambda: parked_one(stack, late.message_id), 30, what="the late result parked")
    # When every place a person or a tool looks is read
    token = asyncio.run(_token(stack))
    headers = {"Authorization": f"Bearer {token}"}
    api = {
        f"GET {path} {params}": httpx.get(base + path, params=params, headers=headers, timeout=30).text
        for path, params in (
            (f"/api/v1/runs/{run_id}", {}),
            (f"/api/v1/runs/{run_id}", {"inputs": "true"}),
            (f"/api/v1/runs/{run_id}/history", {}),
            (f"/api/v1/dead-letters/{late.message_id}", {}),
        )
    }
    cli = {
        args: stack.saga(*args).stdout
        for args in (
            ("status", run_id, "--json"),
            ("status", run_id, "--inputs"),
            ("history", run_id, "--json"),
            ("wait", run_id, "--json"),
            ("runs", "--json"),
            ("dead-letters", "list", "--queue", NAMES.rejected_queue, "--json"),
            ("dead-letters", "show", late.message_id, "--json"),
            ("dead-letters", "show", late.message_id),
        )
    }
    history_key = ShardKeys(stack.prefix, record["shard"]).history(run_id)
    stored_history = json.dumps(stack.redis.xrange(history_key))
    logs = {f"{name}.log": stack.log(name) for name in ("orchestrator", "worker", "server")}
    # Then neither value is anywhere
    places = {
        **api,
        **{" ".join(args): text for args, text in cli.items()},
        "history": stored_history,
        **logs,
    }
    for place, text in places.items():
        assert CARD not in text and TOKEN not in text, place
    # (the views answered, with the values marked: none is empty or an error)
    shown = [*api.values(), *(text for args, text in cli.items() if not {"list", "runs"} & set(args))]
    assert all(MARKER.search(text) for text in shown), [
        text[:200] for text in shown if not MARKER.search(text)
    ]
    # ... and each shows as one marker with a keyed hash, the same wherever it is
    status = json.loads(cli[("status", run_id, "--json")])
    token_marker = status["output"]["token"]
    assert MARKER.fullmatch(token_marker) and status["output"]["last4"] == "4444"
    assert status["stages"]["charge"]["result"]["token"] == token_marker
    [shown] = json.loads(cli[("dead-letters", "show", late.message_id, "--json")])
    assert shown["body"]["body"]["result"]["token"] == token_marker
    history = json.loads(cli[("history", run_id, "--json")])["events"]
    [failed] = [e for e in history if e["kind"] == "stage.failed"]
    assert MARKER.search(failed["error"]) and "was declined" in failed["error"]
    assert_sound(stack.redis, stack.prefix, [run_id])


async def _token(stack: Stack) -> str:
    client = redis_client(stack.settings)
    try:
        secret, _ = await TokenStore(client, stack.prefix).create("reader", Role.OPERATOR, actor="tests")
        return secret
    finally:
        await client.aclose()


def test_saga_start_wait_shows_the_output_with_its_sensitive_values_marked(
    paying: tuple[Stack, Path, str],
) -> None:
    stack, _, _ = paying
    card = "5500111122223333"
    context = json.dumps({"card": card, "amount": 7})
    done = stack.saga("start", "probe-payment", "--context", context, "--wait", "60", "--json")
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout)
    assert shown["state"] == "completed" and MARKER.fullmatch(shown["output"]["token"])
    assert card not in done.stdout + done.stderr and card[::-1] not in done.stdout + done.stderr


def test_sealed_at_rest_no_sensitive_value_is_anywhere_in_redis(paying: tuple[Stack, Path, str]) -> None:
    """With SAGA_ENCRYPT_SENSITIVE, the whole keyspace of the stack holds neither value, after runs that
    carried them completed (and one failed attempt that quoted the card)."""
    stack, folder, _ = paying
    if stack.env["SAGA_ENCRYPT_SENSITIVE"] != "true":
        pytest.skip("values are kept as given on this stack")
    settings = stack.settings.model_copy(update={"key_ring_file": str(folder / "ring.yaml")})
    with SyncClient(settings) as client:
        run_id = client.start("probe-payment", {"card": CARD, "amount": 3})
        result = client.wait(run_id, timeout_s=60)
    assert result.state == "completed" and result.output["token"] == TOKEN  # the client holds the data key
    dump = keyspace(stack)
    assert CARD not in dump and TOKEN not in dump and "$saga-sealed:v1:data:" in dump


def keyspace(stack: Stack) -> str:
    """Every key of the stack with everything it holds, as one text."""
    found = []
    for key in sorted(stack.redis.scan_iter(match=f"{stack.prefix}:*", count=1000)):
        kind = stack.redis.type(key)
        read = {
            "string": stack.redis.get,
            "hash": stack.redis.hgetall,
            "list": lambda k: stack.redis.lrange(k, 0, -1),
            "set": lambda k: sorted(stack.redis.smembers(k)),
            "zset": lambda k: stack.redis.zrange(k, 0, -1, withscores=True),
            "stream": stack.redis.xrange,
        }[kind]
        found.append(f"{key} {read(key)}")
    return "\n".join(found)

"""Tenants against the real services: two tenants' clients side by side on one stack, each starting runs
with its own client key; neither can list, read, cancel or re-drive the other's runs through the client,
the CLI, the control-plane API or a forged message; and each shard admits a tenant's starts within its
share of the tenant's limits (SAGA_TENANT_LIMITS), refusing the rest at once with the reason."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from orchestrator.auth.roles import Role
from orchestrator.auth.tokens import TokenStore
from orchestrator.bus.envelope import Envelope, Signer, canonical, encode
from orchestrator.client import RunNotFound, SyncClient
from orchestrator.keys.ring import Scope
from orchestrator.keys.ringfile import RingFile, load_ring, write_ring_file
from orchestrator.settings import Settings, redis_client
from orchestrator.wire import bodies
from orchestrator.wire.kinds import Kind
from tests.faults.invariants import assert_sound
from tests.integration.refusals import NAMES, parked, parked_one
from tests.integration.rings import active, write_ring
from tests.integration.served import serve
from tests.integration.stack import Stack, now_ms, poll

pytestmark = pytest.mark.services

LIMITS = {"globex": {"max_runs": 1}, "initech": {"starts_per_s": 1}}
TENANTS = ("acme", "globex", "initech")


RING = [
    active("orch", Scope.ORCHESTRATOR),
    active("dispatch", Scope.DISPATCH),
    active("pool", Scope.WORKER, contracts=["*"]),
    active("server", Scope.SERVER, tenants=["*"]),
    *(active(f"client-{t}", Scope.CLIENT, tenants=[t]) for t in TENANTS),
]


@pytest.fixture(scope="module")
def tenanted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, Path, str]]:
    """A stack whose processes hold the whole ring, a ring file per tenant's client (its key alone) and
    ``saga server`` (its server key acts for every tenant)."""
    folder = tmp_path_factory.mktemp("tenants")
    write_ring(folder / "ring.yaml", RING)
    for tenant in TENANTS:
        own = [e for e in RING if e.id == f"client-{tenant}"]
        write_ring_file(folder / f"{tenant}.yaml", RingFile(keys=own))
    env = {
        "SAGA_KEY_RING_FILE": str(folder / "ring.yaml"),
        "SAGA_TENANT_LIMITS": json.dumps(LIMITS),
        "SAGA_BAG_WINDOW": "8",  # a bag of more items takes refills
    }
    stack = Stack("tenants", env=env)
    stack.setup()
    try:
        stack.start_orchestrator()
        stack.start_worker()
        yield stack, folder, serve(stack)
    finally:
        stack.teardown()


def client_of(stack: Stack, folder: Path, tenant: str) -> SyncClient:
    return SyncClient(stack.settings.model_copy(update={"key_ring_file": str(folder / f"{tenant}.yaml")}))


def as_tenant(stack: Stack, folder: Path, tenant: str) -> dict[str, str]:
    """The environment of a CLI of ``tenant``: its ring (its client key alone)."""
    return {"SAGA_KEY_RING_FILE": str(folder / f"{tenant}.yaml")}


async def _token(settings: Settings, name: str, tenant: str, role: Role = Role.OPERATOR) -> str:
    client = redis_client(settings)
    try:
        secret, _ = await TokenStore(client, settings.key_prefix).create(name, role, tenant, actor="t")
        return secret
    finally:
        await client.aclose()


def test_tenants_cannot_see_or_touch_each_others_runs(tenanted: tuple[Stack, Path, str]) -> None:
    stack, folder, base = tenanted
    # Given a run of acme and one of globex, each started by its tenant's client key
    with client_of(stack, folder, "acme") as acme, client_of(stack, folder, "globex") as globex:
        mine = acme.start("model-ingest", {"modelId": "acme-1"})
        theirs = globex.start("model-ingest", {"modelId": "globex-1"})
        assert acme.wait(mine, timeout_s=60).state == "completed"
        assert globex.wait(theirs, timeout_s=60).state == "completed"
        # Then each run is its starter's key's tenant's
        assert stack.record(mine)["tenant"] == "acme" and stack.record(theirs)["tenant"] == "globex"
        # And neither client reads the other's
        assert acme.status(mine)["state"] == "completed"
        with pytest.raises(RunNotFound):
            acme.status(theirs)
        with pytest.raises(RunNotFound):
            globex.status(mine)
    # Nor the CLI, with acme's key
    env = as_tenant(stack, folder, "acme")
    listed = json.loads(stack.saga("runs", "--json", extra_env=env).stdout)["runs"]
    assert [r["run_id"] for r in listed] == [mine] and listed[0]["tenant"] == "acme"
    for command in (["status", theirs], ["history", theirs], ["cancel", theirs], ["redrive", theirs]):
        done = stack.saga(*command, extra_env=env)
        assert done.returncode == 1 and "not found" in done.stderr.lower(), (command, done.stderr)
    # ... while the platform's view (the stack's own ring: no client key binds it) sees both
    every = {r["run_id"] for r in json.loads(stack.saga("runs", "--json").stdout)["runs"]}
    assert {mine, theirs} <= every
    # Nor the API, with an operator token of acme
    token = asyncio.run(_token(stack.settings, "acme-operator", "acme"))
    headers = {"Authorization": f"Bearer {token}"}

    def call(method: str, path: str, **kwargs: Any) -> httpx.Response:
        return httpx.request(method, base + "/api/v1" + path, headers=headers, timeout=30, **kwargs)

    assert [r["run_id"] for r in call("GET", "/runs").json()["runs"]] == [mine]
    for method, path in (
        ("GET", f"/runs/{theirs}"),
        ("GET", f"/runs/{theirs}/history"),
        ("POST", f"/runs/{theirs}/cancel"),
        ("POST", f"/runs/{theirs}/redrive"),
    ):
        answer = call(method, path, json={} if method == "POST" else None)
        assert answer.status_code == 404, (method, path, answer.text)
    assert call("GET", f"/runs/{mine}").json()["state"] == "completed"
    # ... and a run it starts through the API is acme's
    started = call("POST", "/runs", json={"definition": "model-ingest", "context": {"modelId": "acme-api"}})
    assert started.status_code == 202, started.text
    run_id = started.json()["run_id"]
    poll(lambda: stack.record(run_id).get("tenant"), 30, what="the API's run created")
    assert stack.record(run_id)["tenant"] == "acme"
    [started_event] = [e for e in stack.history(run_id) if e["kind"] == "run.started"]
    assert started_event["detail"]["requested_by"] == "acme-operator"  # the token the server acted for
    # Nor a message forged with acme's key: a cancel of globex's run is refused before any write
    keys = Signer(load_ring(folder / "acme.yaml", 0, {}))
    record = stack.record(theirs)
    cancel = keys.sign(
        Envelope(
            kind=Kind.CANCEL_RUN,
            message_id=f"cancel.run-forged-{theirs}",
            run_id=theirs,
            shard=record["shard"],
            issued_at_ms=now_ms(),
            body=bodies.request("not yours", "acme"),
        )
    )
    assert cancel.tenant == "acme"  # a client key signs its own tenant in
    stack.publish_raw(NAMES.runs_exchange, record["shard"], encode(cancel))
    letter = poll(lambda: parked_one(stack, cancel.message_id), 30, what="the forged cancel parked")
    assert letter["reason"] == "wrong-tenant" and "which is not of tenant 'acme'" in letter["detail"]
    assert "globex" not in letter["detail"]  # the run's tenant is not the sender's to learn
    # ... and naming it as globex's, the key is out of its scope
    lie = cancel.model_copy(
        update={"tenant": "globex", "message_id": f"cancel.run-lie-{theirs}", "signature": ""}
    )
    lie = lie.model_copy(update={"signature": keys.mac("client-acme", canonical(lie))})
    stack.publish_raw(NAMES.runs_exchange, record["shard"], encode(lie))
    letter = poll(lambda: parked_one(stack, lie.message_id), 30, what="the lying cancel parked")
    assert letter["reason"] == "out-of-scope"
    assert_sound(stack.redis, stack.prefix, [mine, theirs, run_id])


def test_a_tenant_over_its_runs_in_flight_is_refused_at_once_and_admitted_again_once_some_end(
    tenanted: tuple[Stack, Path, str],
) -> None:
    stack, folder, _ = tenanted
    # Given no worker, so runs stay in flight: globex may have one a shard (a limit of 1 over 2 shards)
    stack.stop("worker")
    try:
        with client_of(stack, folder, "globex") as globex:
            started = [globex.start("model-ingest", {"modelId": f"globex-limit-{i}"}) for i in range(6)]
            # When more start than its shares allow, the others are refused at once, with the reason
            results = {
                r: poll(lambda r=r: _settled(globex, r), 30, what=f"run {r} created or refused")
                for r in started
            }
            refused = [r for r, doc in results.items() if doc["state"] == "refused"]
            running = [r for r, doc in results.items() if doc["state"] != "refused"]
            assert 1 <= len(running) <= 2 and refused, results
            assert all(
                "tenant 'globex' is at its share of 1 runs in flight" in results[r]["reason"] for r in refused
            )
            assert len({stack.shard_of(r) for r in running}) == len(running)  # one a shard
    finally:
        stack.start_worker()
    with client_of(stack, folder, "globex") as globex:
        for run_id in running:
            assert globex.wait(run_id, timeout_s=60).state == "completed"
        # Then, its runs ended, globex starts again
        again = globex.start("model-ingest", {"modelId": "globex-again"})
        assert globex.wait(again, timeout_s=60).state == "completed"
    assert_sound(stack.redis, stack.prefix, [*running, again])


def test_a_tenant_over_its_starts_a_second_is_refused_and_others_are_not_slowed(
    tenanted: tuple[Stack, Path, str],
) -> None:
    stack, folder, _ = tenanted
    with client_of(stack, folder, "initech") as initech, client_of(stack, folder, "acme") as acme:
        burst = [initech.start("model-ingest", {"modelId": f"initech-{i}"}) for i in range(8)]
        others = [acme.start("model-ingest", {"modelId": f"acme-burst-{i}"}) for i in range(8)]
        states = {r: initech.wait(r, timeout_s=60) for r in burst}
        refused = [r for r, result in states.items() if result.state == "refused"]
        assert refused and len(refused) < len(burst), states
        assert all("over its start rate of 1/s" in (states[r].reason or "") for r in refused)
        assert {acme.wait(r, timeout_s=60).state for r in others} == {"completed"}


def _settled(client: SyncClient, run_id: str) -> dict[str, Any] | None:
    try:
        document = client.status(run_id)
    except RunNotFound:
        return None
    return document if document["state"] in ("refused", "running", "completed", "failed") else None


def test_a_tenants_map_whose_refills_and_release_are_messages_completes(
    tenanted: tuple[Stack, Path, str],
) -> None:
    """A bag's refills and its barrier's release are the shard's own messages about the run: they name its
    tenant, so its shard takes them (they would otherwise be refused as another tenant's). The stack sends
    a bag 8 items at a time, so 40 items take refills."""
    stack, folder, _ = tenanted
    with client_of(stack, folder, "acme") as acme:
        batch = acme.start("thumbnail-batch", {"modelIds": [f"acme-batch-{i}" for i in range(40)]})
        assert acme.wait(batch, timeout_s=90).state == "completed"
    history = [e["kind"] for e in stack.history(batch)]
    assert stack.record(batch)["tenant"] == "acme" and "stage.completed" in history
    assert not [m for m in parked(stack) if m["reason"] == "wrong-tenant" and m["run_id"] == batch]
    assert_sound(stack.redis, stack.prefix, [batch])


def test_a_tenants_admin_manages_its_own_tenants_tokens_only(tenanted: tuple[Stack, Path, str]) -> None:
    stack, _, base = tenanted
    admin = asyncio.run(_token(stack.settings, "acme-admin", "acme", Role.ADMIN))
    platform = asyncio.run(_token(stack.settings, "platform-viewer", "default", Role.VIEWER))
    headers = {"Authorization": f"Bearer {admin}"}

    def call(method: str, path: str, **kwargs: Any) -> httpx.Response:
        return httpx.request(method, base + "/api/v1" + path, headers=headers, timeout=30, **kwargs)

    # A token it creates is its tenant's; one of the platform's tenant is refused
    made = call("POST", "/tokens", json={"name": "acme-ci", "role": "operator"})
    assert made.status_code == 201 and made.json()["tenant"] == "acme", made.text
    refused = call("POST", "/tokens", json={"name": "sneaky", "role": "admin", "tenant": "default"})
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "forbidden", refused.text
    # It lists only its tenant's, and another tenant's token is not found to revoke
    listed = {t["name"] for t in call("GET", "/tokens").json()}
    assert {"acme-admin", "acme-ci"} <= listed and "platform-viewer" not in listed
    assert call("POST", "/tokens/platform-viewer/revoke").status_code == 404
    still = httpx.get(base + "/api/v1/runs", headers={"Authorization": f"Bearer {platform}"}, timeout=30)
    assert still.status_code == 200, still.text  # not revoked

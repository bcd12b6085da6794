"""The key ring against the real services (orchestrator/keys): scoped keys, forgeries of every kind refused
before any write, and keys rotated under load without a restart.

The stack runs on a ring of scoped keys. The orchestrator holds every secret (the orchestrator key's only
through its environment); the worker holds its pool's key and the dispatch key it verifies tasks with; the
test, as a client and an operator, holds the client and operator keys, and (to forge) every other."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from orchestrator.bus.batch import BATCH_HEADER, CHECKSUM_HEADER
from orchestrator.bus.envelope import Envelope, Signer, canonical, encode
from orchestrator.client import SyncClient, start_envelope
from orchestrator.keys.ring import KeyState, Scope
from orchestrator.keys.ringfile import KeyEntry, load_ring
from orchestrator.settings import Settings
from orchestrator.wire import bodies
from orchestrator.wire.kinds import Kind
from tests.faults.invariants import assert_sound
from tests.integration.refusals import NAMES, parked, parked_one, publish_report, run_keys
from tests.integration.rings import write_ring
from tests.integration.stack import Stack, now_ms, poll

GRACE_MS = 3_000
ORCH_SECRET_ENV = "SAGA_TEST_ORCHESTRATOR_KEY"
ORCH_SECRET = "orchestrator-only-" + "x" * 32

pytestmark = pytest.mark.services


def entry(key_id: str, scope: Scope, state: KeyState = KeyState.ACTIVE, **more: object) -> KeyEntry:
    where = (
        {"secret_env": ORCH_SECRET_ENV} if scope is Scope.ORCHESTRATOR else {"secret_file": f"{key_id}.key"}
    )
    return KeyEntry.model_validate({"id": key_id, "scope": scope, "state": state, **where, **more})


RING = [
    entry("orch-1", Scope.ORCHESTRATOR),
    entry("dispatch-1", Scope.DISPATCH),
    entry("pool-1", Scope.WORKER, contracts=["*"]),
    entry("client-1", Scope.CLIENT, tenants=["default"]),
    entry("operator-1", Scope.OPERATOR),
    # for forgeries: a pool that serves another contract, a client of another tenant, a long-retired key
    entry("pool-other", Scope.WORKER, contracts=["thumbnail.render"]),
    entry("client-acme", Scope.CLIENT, tenants=["acme"]),
    entry("old", Scope.CLIENT, KeyState.RETIRED, tenants=["default"], retired_at_ms=1),
]


def reloads(stack: Stack, name: str) -> int:
    return stack.log(name).count("reloaded: holding")


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, Path]]:
    with keyed_stack("keyring", tmp_path_factory.mktemp("ring") / "ring.yaml", RING) as running:
        yield running


@contextmanager
def keyed_stack(name: str, path: Path, entries: list[KeyEntry]) -> Iterator[tuple[Stack, Path]]:
    """A stack on the ring of ``entries`` at ``path``: the orchestrator alone holds its own key."""
    write_ring(path, entries)
    env = {"SAGA_KEY_RING_FILE": str(path), "SAGA_KEY_RETIRE_GRACE_MS": str(GRACE_MS)}
    stack = Stack(name, env=env)
    stack.setup()
    try:
        stack.start_orchestrator(extra_env={ORCH_SECRET_ENV: ORCH_SECRET})
        stack.start_worker()
        yield stack, path
    finally:
        stack.teardown()


def settings_of(stack: Stack, path: Path) -> Settings:
    return stack.settings.model_copy(update={"key_ring_file": str(path), "key_retire_grace_ms": GRACE_MS})


def forger(path: Path) -> Signer:
    """Every key of the ring, the orchestrator's included: what a forger could at most have stolen."""
    return Signer(load_ring(path, GRACE_MS, {ORCH_SECRET_ENV: ORCH_SECRET}))


def test_each_process_holds_only_the_secrets_it_needs(keyed: tuple[Stack, Path]) -> None:
    stack, _ = keyed
    worker, orchestrator = (ring_line(stack, name) for name in ("worker", "orchestrator"))
    assert "dispatch-1 (dispatch, active)" in worker and "pool-1 (worker, active)" in worker
    assert "not holding orch-1" in worker  # its secret is in the orchestrator's environment only
    assert "orch-1 (orchestrator, active)" in orchestrator


def ring_line(stack: Stack, name: str) -> str:
    """The line process ``name`` logged its key ring in, once it has."""
    return str(
        poll(
            lambda: next((line for line in stack.log(name).splitlines() if "key ring" in line), None),
            30,
            what=f"the {name}'s key ring logged",
        )
    )


def test_forgeries_of_every_kind_are_refused_before_any_write_and_runs_complete(
    keyed: tuple[Stack, Path],
) -> None:
    stack, path = keyed
    keys = forger(path)
    with SyncClient(settings_of(stack, path)) as client:
        # Given a completed run, whose keys are dumped
        done, record, before = completed_run(stack, client, "forged-1")
        genuine = keys.sign(publish_report(record, done, now_ms()))
        # When forgeries of every kind name it
        forged = forgeries(keys, genuine)
        for _, raw, headers in forged:
            stack.publish_raw(NAMES.runs_exchange, record["shard"], raw, headers)
        # ... and a run is started and works meanwhile
        running = client.start("model-ingest", {"modelId": "forged-2"})
        # Then every one is parked with its reason
        letters = poll(lambda: _parked_reasons(stack, len(forged)), 30, what="every forgery parked")
        assert sorted(letters) == sorted(reason for reason, _, _ in forged)
        details = [m["detail"] for m in parked(stack) if m["reason"] == "out-of-scope"]
        assert len(details) == 3 and all("may not sign" in d for d in details), details
        # And nothing of the run changed: no refusal record either
        assert run_keys(stack, done) == before
        assert client.wait(running, timeout_s=60).state == "completed"
        assert_sound(stack.redis, stack.prefix, [done, running])


def completed_run(stack: Stack, client: SyncClient, model: str) -> tuple[str, dict[str, str], dict[str, Any]]:
    """A completed run of model-ingest: its id, its record and a dump of its keys."""
    run_id = client.start("model-ingest", {"modelId": model})
    assert client.wait(run_id, timeout_s=60).state == "completed"
    return run_id, stack.record(run_id), run_keys(stack, run_id)


def _parked_reasons(stack: Stack, count: int) -> list[str] | None:
    found = [m["reason"] for m in parked(stack)]
    return found if len(found) >= count else None


def signed_with(keys: Signer, key_id: str, envelope: Envelope) -> Envelope:
    """``envelope`` signed with key ``key_id``, whatever its scope."""
    unsigned = envelope.model_copy(update={"key_id": key_id, "signature": ""})
    return unsigned.model_copy(update={"signature": keys.mac(key_id, canonical(unsigned))})


def forgeries(keys: Signer, genuine: Envelope) -> list[tuple[str, bytes, dict[str, Any] | None]]:
    """(the reason each is refused for, its bytes, its headers): every way a message can be forged."""
    raw = encode(genuine)
    report = genuine.model_copy(update={"signature": ""})

    def signed_as(key_id: str, envelope: Envelope) -> bytes:
        return encode(signed_with(keys, key_id, envelope))

    start = start_envelope(keys, "forged-start", "model-ingest", genuine.digest, {"modelId": "f"})
    cancel = Envelope(
        kind=Kind.CANCEL_RUN,
        message_id=f"cancel.run-forged-{genuine.run_id}",
        run_id=genuine.run_id,
        shard=genuine.shard,
        tenant="acme",
        issued_at_ms=genuine.issued_at_ms,
        body=bodies.request("forged", "mallory"),
    )
    as_container = {BATCH_HEADER: 2, CHECKSUM_HEADER: 1}  # headers saying two messages travel in one
    return [
        ("bad-signature", encode(genuine.model_copy(update={"signature": "0" * 64})), None),
        ("unknown-key", encode(genuine.model_copy(update={"key_id": "nobody"})), None),
        ("retired-key", signed_as("old", start), None),
        # a pool's key about a contract it does not serve; the dispatch key signing a report
        ("out-of-scope", signed_as("pool-other", report), None),
        ("out-of-scope", signed_as("dispatch-1", report), None),
        ("bad-signature", raw.replace(b'"cat-x"', b'"cat-y"'), None),  # the body altered after signing
        ("bad-signature", raw.replace(b'"attempt":1', b'"attempt":2'), None),  # an identity field altered
        ("malformed-batch", raw, as_container),  # its headers altered
        ("malformed", raw[: len(raw) // 2], None),  # truncated
        ("oversized", raw[:-1] + b"," + b" " * 1_100_000 + b"}", None),
        # a client key of tenant acme, for a start in tenant default
        ("out-of-scope", signed_as("client-acme", start.model_copy(update={"tenant": "default"})), None),
        # ... and for a cancel of its own tenant, of a run of tenant default
        ("wrong-tenant", signed_as("client-acme", cancel), None),
    ]


def test_a_pool_key_cannot_report_on_a_task_of_a_contract_it_does_not_serve(
    keyed: tuple[Stack, Path],
) -> None:
    stack, path = keyed
    keys = forger(path)
    with SyncClient(settings_of(stack, path)) as client:
        # Given a completed run
        run_id, record, before = completed_run(stack, client, "forged-3")
        # When a pool serving thumbnail.render signs a report on its publish stage (catalogue.publish),
        # claiming the contract it serves, so that its key's scope admits it
        # (under an id of its own: the genuine report's is a recognised duplicate before anything else)
        lie = publish_report(record, run_id, now_ms()).model_copy(
            update={"contract": "thumbnail.render@3", "message_id": f"result-forged-{run_id}"}
        )
        signed = signed_with(keys, "pool-other", lie)
        stack.publish_raw(NAMES.runs_exchange, record["shard"], encode(signed))
        # Then the run refuses it, as a report on a task that was not for that contract: one refusal record
        refusal = poll(lambda: _refusal_of(stack, run_id), 30, what="the report refused")
        assert "names contract thumbnail.render@3, but its task was for catalogue.publish@2" in str(refusal)
        after = run_keys(stack, run_id)
        history = next(k for k in after if k.endswith(":history"))
        assert len(after[history]) == len(before[history]) + 1
        assert {k: v for k, v in after.items() if k != history} == {
            k: v for k, v in before.items() if k != history
        }


def _refusal_of(stack: Stack, run_id: str) -> dict[str, Any] | None:
    return next((e for e in stack.history(run_id) if "rejected" in e["kind"]), None)


ROTATED = [
    entry("orch-1", Scope.ORCHESTRATOR),
    entry("dispatch-1", Scope.DISPATCH),
    entry("pool-1", Scope.WORKER, contracts=["*"]),
    entry("client-1", Scope.CLIENT, tenants=["default"]),
]
SUCCESSORS = {
    "dispatch-1": ("dispatch-2", ["--scope", "dispatch"]),
    "pool-1": ("pool-2", ["--scope", "worker", "--contract", "*"]),
    "client-1": ("client-2", ["--scope", "client", "--tenant", "default"]),
}


@pytest.fixture
def rotating(tmp_path: Path) -> Iterator[tuple[Stack, Path]]:
    with keyed_stack("rotation", tmp_path / "ring.yaml", ROTATED) as running:
        yield running


def test_keys_rotate_under_load_without_a_restart_and_the_old_ones_are_refused_after_their_grace(
    rotating: tuple[Stack, Path],
) -> None:
    stack, path = rotating
    for name in ("orchestrator", "worker"):
        ring_line(stack, name)
    started: list[str] = []
    failures: list[BaseException] = []

    def start_steadily() -> None:
        try:
            with SyncClient(settings_of(stack, path)) as client:
                for i in range(200):
                    started.append(client.start("model-ingest", {"modelId": f"rotated-{i}"}))
                    time.sleep(0.08)  # 200 over at least 16 s: the rotation happens among them
        except BaseException as exc:  # reported by the test, not lost in the thread
            failures.append(exc)

    # Given 200 runs starting and running all along
    load = threading.Thread(target=start_steadily)
    load.start()
    poll(lambda: len(started) >= 30, 30, what="runs under way")
    # When the dispatch, pool and client keys are each replaced: added, activated, the old ones retired
    for new, options in SUCCESSORS.values():
        keys_command(stack, "add", new, *options)
    wait_reloaded(stack, "(dispatch, verify)")
    for new, _ in SUCCESSORS.values():
        keys_command(stack, "activate", new)
    wait_reloaded(stack, "dispatch-2 (dispatch, active)")
    for old in SUCCESSORS:
        keys_command(stack, "retire", old)
    wait_reloaded(stack, "dispatch-1 (dispatch, retired)")
    assert len(started) < 200, "the rotation ended after the last run started: make the load longer"
    load.join(timeout=120)
    assert not failures, failures
    # Then every run completes, and nothing was refused
    with SyncClient(settings_of(stack, path)) as client:
        states = {run_id: client.wait(run_id, timeout_s=120).state for run_id in started}
        assert len(states) == 200 and set(states.values()) == {"completed"}, states
        assert parked(stack) == []
        # When the grace period has passed, runs go on under the new keys alone
        time.sleep(GRACE_MS / 1000 + 0.5)
        after = client.start("model-ingest", {"modelId": "rotated-after"})
        assert client.wait(after, timeout_s=60).state == "completed"
        # ... and a start signed with the retired client key is refused
        keys = Signer(load_ring(path, GRACE_MS, {}))
        digest = stack.active_digest("model-ingest")
        assert digest is not None
        late = signed_with(keys, "client-1", start_envelope(keys, "late-start", "model-ingest", digest, {}))
        stack.publish_raw(NAMES.start_exchange("fast"), late.run_id, encode(late))
        letter = poll(lambda: parked_one(stack, late.message_id), 30, what="the old key's start parked")
        assert letter["reason"] == "retired-key"
    assert_sound(stack.redis, stack.prefix, [*started, after])


def keys_command(stack: Stack, *args: str) -> None:
    done = stack.saga("keys", *args)
    assert done.returncode == 0, done.stderr


def wait_reloaded(stack: Stack, holding: str) -> None:
    """Until the orchestrator and the worker have each reloaded a ring in which they hold ``holding``."""
    for name in ("orchestrator", "worker"):
        poll(
            lambda name=name: holding in _last_reload(stack, name),  # type: ignore[misc]
            30,
            what=f"the {name} to reload its key ring ({holding})",
        )


def _last_reload(stack: Stack, name: str) -> str:
    lines = [line for line in stack.log(name).splitlines() if "reloaded: holding" in line]
    return lines[-1] if lines else ""

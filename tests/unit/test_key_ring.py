"""The key ring (orchestrator/keys): scopes, the signing key, retirement, the ring file and its changes,
and a process reloading it."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from orchestrator.bus.envelope import (
    Envelope,
    EnvelopeRejected,
    Signer,
    canonical,
    decode,
    encode,
    signed_message,
)
from orchestrator.errors import SagaError
from orchestrator.keys.reload import RingFollower, RingSource, keep_reloaded, reload
from orchestrator.keys.ring import (
    REPLAYERS,
    SCOPE_KINDS,
    KeyState,
    Ring,
    RingKey,
    Scope,
    out_of_scope,
)
from orchestrator.keys.ringfile import (
    KeyEntry,
    KeyRingError,
    RingFile,
    activated,
    added,
    load_ring,
    read_ring_file,
    retired,
    write_ring_file,
    write_secret_file,
)
from orchestrator.settings import Settings
from orchestrator.wire.kinds import Kind

MAX = 1_048_576
GRACE = 10_000


def key(key_id: str, scope: Scope, state: KeyState = KeyState.ACTIVE, **more: object) -> RingKey:
    return RingKey(key_id, scope, state, f"secret-of-{key_id}".encode(), **more)  # type: ignore[arg-type]


RING = Ring(
    (
        key("orch", Scope.ORCHESTRATOR),
        key("dispatch", Scope.DISPATCH),
        key("pool", Scope.WORKER, contracts=frozenset({"images.resize"})),
        key("client", Scope.CLIENT, tenants=frozenset({"acme"})),
        key("operator", Scope.OPERATOR),
        key("server", Scope.SERVER, tenants=frozenset({"acme", "globex"})),
        key("old", Scope.OPERATOR, KeyState.RETIRED, retired_at_ms=1_000),
        key("data", Scope.DATA),
    ),
    GRACE,
)


def envelope(kind: Kind = Kind.RESULT, **fields: object) -> Envelope:
    base: dict[str, object] = {
        "kind": kind,
        "message_id": f"{kind.value}-1",
        "run_id": "run-1",
        "shard": "fast.0",
        "stage": "resize",
        "fence": "1.1",
        "attempt": 1,
        "digest": "d" * 64,
        "contract": "images.resize@2",
        "tenant": "acme",
        "issued_at_ms": 5,
    }
    return Envelope.model_validate({**base, **fields})


# ---- scopes -----------------------------------------------------------------------------------------------


@given(st.sampled_from([s for s in Scope if s is not Scope.ANY]), st.sampled_from(list(Kind)))
def test_a_key_verifies_only_the_kinds_its_scope_signs(scope: Scope, kind: Kind) -> None:
    found = next(k for k in RING.keys if k.scope is scope)
    refusal = out_of_scope(found, kind, "images.resize@2", "acme")
    assert (refusal is None) == (kind in SCOPE_KINDS[scope]), (scope, kind, refusal)


def test_an_unscoped_key_signs_everything() -> None:
    unscoped = key("any", Scope.ANY)
    assert all(out_of_scope(unscoped, kind, None, "whoever") is None for kind in Kind)


def test_a_pool_key_reports_only_on_tasks_of_its_contracts() -> None:
    pool = RING.get("pool")
    assert pool is not None
    assert out_of_scope(pool, Kind.RESULT, "images.resize@2", "acme") is None  # by name, any version
    assert "for contract images.crop@1" in str(out_of_scope(pool, Kind.RESULT, "images.crop@1", "acme"))
    assert "for contract (none)" in str(out_of_scope(pool, Kind.HEARTBEAT, None, "acme"))
    exact = key("exact", Scope.WORKER, contracts=frozenset({"images.resize@2"}))
    assert out_of_scope(exact, Kind.RESULT, "images.resize@2", "acme") is None
    assert out_of_scope(exact, Kind.RESULT, "images.resize@3", "acme") is not None


def test_client_and_server_keys_act_only_for_their_tenants() -> None:
    client, server = RING.get("client"), RING.get("server")
    assert client is not None and server is not None
    assert out_of_scope(client, Kind.START, None, "acme") is None
    assert "for tenant 'globex'" in str(out_of_scope(client, Kind.START, None, "globex"))
    assert out_of_scope(server, Kind.REDRIVE, None, "globex") is None
    assert out_of_scope(server, Kind.CANCEL_RUN, None, "initech") is not None
    everyone = key("all", Scope.SERVER, tenants=frozenset({"*"}))
    assert out_of_scope(everyone, Kind.START, None, "initech") is None


# ---- signing and verifying ------------------------------------------------------------------------------


def test_each_kind_is_signed_by_the_first_active_key_whose_scope_signs_it() -> None:
    signer = Signer(RING)
    assert signer.key_for(Kind.RELEASE).key_id == "orch"
    assert signer.key_for(Kind.TASK).key_id == "dispatch"
    assert signer.key_for(Kind.RESULT, "images.resize@2").key_id == "pool"
    assert signer.key_for(Kind.START).key_id == "client"
    assert signer.key_for(Kind.REDRIVE).key_id == "operator"
    with pytest.raises(SagaError, match="no active key this process holds may sign a result message for "):
        signer.key_for(Kind.RESULT, "images.crop@1")


def test_a_client_key_signs_for_its_tenant_whatever_was_asked() -> None:
    signer = Signer(RING)
    asked = envelope(Kind.START, tenant="globex", contract=None, stage=None, fence=None, attempt=None)
    signed = signer.sign(asked)
    assert signed.key_id == "client" and signed.tenant == "acme"
    fields = asked.model_dump(exclude={"signature", "key_id"})
    assert decode(signed_message(signer, **fields), signer, MAX).tenant == "acme"


def test_a_message_signed_outside_its_keys_scope_is_refused_like_a_forgery() -> None:
    signer = Signer(RING)
    # a genuine MAC under the dispatch key, on a report: the dispatch key signs tasks only
    report = envelope().model_copy(update={"key_id": "dispatch"})
    raw = encode(report.model_copy(update={"signature": signer.mac("dispatch", canonical(report))}))
    with pytest.raises(EnvelopeRejected) as caught:
        decode(raw, signer, MAX)
    assert caught.value.reason == "out-of-scope"
    assert "key 'dispatch' (dispatch) may not sign result messages" in caught.value.detail


def test_a_retired_key_verifies_until_its_grace_ends_and_never_signs() -> None:
    now = {"ms": 1_000 + GRACE - 1}
    signer = Signer(RING, clock_ms=lambda: now["ms"])
    redrive = envelope(Kind.REDRIVE, message_id="redrive-1").model_copy(update={"key_id": "old"})
    raw = encode(redrive.model_copy(update={"signature": signer.mac("old", canonical(redrive))}))
    assert decode(raw, signer, MAX).key_id == "old"  # inside the grace period
    now["ms"] += 1
    with pytest.raises(EnvelopeRejected) as caught:
        decode(raw, signer, MAX)
    assert caught.value.reason == "retired-key" and "grace period of 10000 ms" in caught.value.detail
    assert signer.key_for(Kind.REDRIVE).key_id == "operator"  # the retired key signs nothing


def test_a_key_whose_secret_this_process_lacks_neither_signs_nor_verifies() -> None:
    ring = Ring((RingKey("elsewhere", Scope.DISPATCH, KeyState.ACTIVE, None), key("here", Scope.DISPATCH)), 0)
    elsewhere = Signer(Ring((key("elsewhere", Scope.DISPATCH),), 0))
    raw = encode(elsewhere.sign(envelope(Kind.TASK)))
    signer = Signer(ring)
    assert signer.key_for(Kind.TASK).key_id == "here"
    with pytest.raises(EnvelopeRejected) as caught:
        decode(raw, signer, MAX)
    assert caught.value.reason == "unknown-key"


# ---- the ring file ------------------------------------------------------------------------------------


def entry(key_id: str, scope: Scope, **more: object) -> KeyEntry:
    return KeyEntry.model_validate({"id": key_id, "scope": scope, "secret_file": f"{key_id}.key"} | more)


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"id": "w", "scope": "worker", "secret_file": "w"}, "must list the contracts its pool serves"),
        ({"id": "c", "scope": "client", "secret_file": "c"}, "must name exactly one tenant"),
        ({"id": "c", "scope": "client", "secret_file": "c", "tenants": ["a", "b"]}, "exactly one tenant"),
        ({"id": "s", "scope": "server", "secret_file": "s"}, "must list the tenants it acts for"),
        ({"id": "d", "scope": "dispatch", "secret_file": "d", "tenants": ["a"]}, "only client and server"),
        ({"id": "d", "scope": "dispatch", "secret_file": "d", "contracts": ["a"]}, "only worker keys"),
        ({"id": "d", "scope": "dispatch"}, "exactly one of secret_file and secret_env"),
        ({"id": "d", "scope": "dispatch", "secret_file": "d", "secret_env": "D"}, "exactly one of"),
        ({"id": "d", "scope": "dispatch", "secret_file": "d", "state": "retired"}, "must say when"),
    ],
)
def test_a_key_that_cannot_be_used_is_refused_with_what_to_change(
    fields: dict[str, object], problem: str
) -> None:
    with pytest.raises(ValueError, match=problem):
        KeyEntry.model_validate(fields)


def test_activating_a_key_replaces_the_one_of_its_scope_and_retiring_stops_it_signing() -> None:
    ring = RingFile()
    ring = added(ring, entry("d1", Scope.DISPATCH, state="active"), 1, "ops")
    ring = added(ring, entry("p1", Scope.WORKER, state="active", contracts=["a"]), 2, "ops")
    ring = added(ring, entry("p2", Scope.WORKER, contracts=["b"]), 3, "ops")  # another pool: not a successor
    ring = added(ring, entry("d2", Scope.DISPATCH), 4, "ops")
    assert ring.entry("d2").state is KeyState.VERIFY
    ring = activated(ring, "d2", 5, "ops")
    assert [ring.entry(k).state for k in ("d1", "d2")] == [KeyState.VERIFY, KeyState.ACTIVE]
    ring = activated(ring, "p2", 6, "ops")
    assert ring.entry("p1").state is KeyState.ACTIVE  # a pool of other contracts is not replaced
    ring = retired(ring, "d1", 7, "ops")
    assert ring.entry("d1").state is KeyState.RETIRED and ring.entry("d1").retired_at_ms == 7
    assert [(c.verb, c.key, c.actor) for c in ring.changes][-3:] == [
        ("activate", "d2", "ops"),
        ("activate", "p2", "ops"),
        ("retire", "d1", "ops"),
    ]
    assert ring.changes[4].detail == "replaces d1"


def test_changes_that_would_break_signing_are_refused() -> None:
    ring = added(RingFile(), entry("d1", Scope.DISPATCH, state="active"), 1, "ops")
    with pytest.raises(KeyRingError, match="only active dispatch key of its kind"):
        retired(ring, "d1", 2, "ops")
    ring = retired(ring, "d1", 2, "ops", force=True)
    with pytest.raises(KeyRingError, match="retired and cannot sign again"):
        activated(ring, "d1", 3, "ops")
    with pytest.raises(KeyRingError, match="already in the key ring"):
        added(ring, entry("d1", Scope.DISPATCH), 4, "ops")
    with pytest.raises(KeyRingError, match="no key 'nope' in the key ring"):
        activated(ring, "nope", 5, "ops")


def test_the_ring_file_holds_no_secret_and_a_process_holds_only_the_secrets_it_has(tmp_path: Path) -> None:
    path = tmp_path / "ring.yaml"
    ring = added(RingFile(), entry("d1", Scope.DISPATCH, state="active"), 1, "ops")
    ring = added(ring, KeyEntry(id="o1", scope=Scope.ORCHESTRATOR, secret_env="ORCH_KEY"), 2, "ops")
    write_secret_file(tmp_path / "d1.key")
    write_ring_file(path, ring)
    secret = (tmp_path / "d1.key").read_text().strip()
    assert secret not in path.read_text() and len(secret) == 64
    assert oct((tmp_path / "d1.key").stat().st_mode & 0o777) == "0o600"
    assert read_ring_file(path) == ring
    loaded = load_ring(path, GRACE, {})
    assert [k.key_id for k in loaded.held()] == ["d1"]
    assert [k.key_id for k in load_ring(path, GRACE, {"ORCH_KEY": "o" * 20}).held()] == ["d1", "o1"]
    with pytest.raises(KeyRingError, match="has 5 characters, under 16"):
        load_ring(path, GRACE, {"ORCH_KEY": "short"})


def test_a_ring_file_that_cannot_be_read_says_where(tmp_path: Path) -> None:
    path = tmp_path / "ring.yaml"
    path.write_text("keys:\n- id: a\n  scope: nobody\n  secret_file: a\n")
    with pytest.raises(KeyRingError, match=r"ring.yaml is invalid at keys.0.scope"):
        read_ring_file(path)
    path.write_text("keys: [\n")
    with pytest.raises(KeyRingError, match="cannot read the key ring file"):
        read_ring_file(path)


# ---- reloading --------------------------------------------------------------------------------------


def _ring_at(tmp_path: Path, active: str) -> Path:
    path = tmp_path / "ring.yaml"
    ring = RingFile()
    for key_id in ("d1", "d2"):
        write_secret_file(tmp_path / f"{key_id}.key")
        ring = added(
            ring, entry(key_id, Scope.DISPATCH, state="active" if key_id == active else "verify"), 1, "t"
        )
    write_ring_file(path, ring)
    return path


def test_a_process_reloads_the_ring_on_a_change_and_keeps_its_ring_when_the_file_is_broken(
    tmp_path: Path,
) -> None:
    path = _ring_at(tmp_path, "d1")
    source = RingSource(path, GRACE, {})
    signer = Signer(source.load())
    seen = source.fingerprint()
    write_ring_file(path, activated(read_ring_file(path), "d2", 2, "t"))
    assert source.fingerprint() != seen
    assert reload(signer, source) and signer.key_for(Kind.TASK).key_id == "d2"
    path.write_text("keys: [\n")
    assert not reload(signer, source)
    assert signer.key_for(Kind.TASK).key_id == "d2"  # the ring it had


def test_a_running_process_reloads_on_sighup_and_on_a_file_change(tmp_path: Path) -> None:
    path = _ring_at(tmp_path, "d1")
    source = RingSource(path, GRACE, {})
    signer = Signer(source.load())

    async def scenario() -> list[str]:
        watcher = asyncio.create_task(keep_reloaded(signer, source, poll_s=30))  # only SIGHUP within the test
        await asyncio.sleep(0.05)
        signed = [signer.key_for(Kind.TASK).key_id]
        write_ring_file(path, activated(read_ring_file(path), "d2", 2, "t"))
        os.kill(os.getpid(), signal.SIGHUP)
        for _ in range(100):
            await asyncio.sleep(0.01)
            if signer.key_for(Kind.TASK).key_id == "d2":
                break
        signed.append(signer.key_for(Kind.TASK).key_id)
        watcher.cancel()
        return signed

    assert asyncio.run(scenario()) == ["d1", "d2"]


def test_a_blocking_client_reloads_before_it_signs(tmp_path: Path) -> None:
    path = _ring_at(tmp_path, "d1")
    signer = Signer(load_ring(path, GRACE, {}))
    follower = RingFollower(signer, Settings(key_ring_file=str(path)), poll_s=0)
    write_ring_file(path, activated(read_ring_file(path), "d2", 2, "t"))
    follower.check()
    assert signer.key_for(Kind.TASK).key_id == "d2"


def test_an_operators_key_signs_other_kinds_only_to_issue_a_dead_letter_again() -> None:
    signer = Signer(RING)
    assert signer.key_for(Kind.RESULT, "images.resize@2", REPLAYERS).key_id == "operator"
    assert signer.key_for(Kind.START, None, REPLAYERS).key_id == "operator"


def test_a_ring_file_that_is_not_there_is_an_error_and_a_reload_keeps_the_ring_in_use(tmp_path: Path) -> None:
    path = _ring_at(tmp_path, "d1")
    source = RingSource(path, GRACE, {})
    signer = Signer(source.load())
    path.unlink()
    with pytest.raises(KeyRingError, match="does not exist: check SAGA_KEY_RING_FILE"):
        load_ring(path, GRACE, {})
    assert not reload(signer, source) and signer.key_for(Kind.TASK).key_id == "d1"


def test_a_reload_that_would_lose_a_held_keys_secret_keeps_that_secret_and_takes_the_rest(
    tmp_path: Path,
) -> None:
    path = _ring_at(tmp_path, "d1")
    source = RingSource(path, GRACE, {})
    signer = Signer(source.load())
    (tmp_path / "d1.key").unlink()  # its secret gone mid-deploy, the key still in the ring
    write_ring_file(path, activated(read_ring_file(path), "d2", 2, "t"))
    assert reload(signer, source)
    assert signer.key_for(Kind.TASK).key_id == "d2"  # the change is taken ...
    assert [k.key_id for k in signer.ring.held()] == ["d1", "d2"]  # ... and d1 still verifies


def test_ring_file_edits_keep_its_mode_and_refuse_a_shared_secret(tmp_path: Path) -> None:
    path = _ring_at(tmp_path, "d1")
    assert oct(path.stat().st_mode & 0o777) == "0o644"  # no secret in it: readable by every process
    path.chmod(0o640)
    write_ring_file(path, activated(read_ring_file(path), "d2", 2, "t"))
    assert oct(path.stat().st_mode & 0o777) == "0o640"
    with pytest.raises(KeyRingError, match=r"both take their secret from file d1\.key"):
        added(read_ring_file(path), entry("d3", Scope.DISPATCH, secret_file="d1.key"), 3, "t")


def test_a_report_must_name_its_contract_even_under_a_key_for_every_contract() -> None:
    everything = key("pool-all", Scope.WORKER, contracts=frozenset({"*"}))
    assert out_of_scope(everything, Kind.RESULT, "any.thing@9", "acme") is None
    assert out_of_scope(everything, Kind.RESULT, None, "acme") is not None

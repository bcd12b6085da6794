"""Releasing a definition on the real services: immutable versions, review by another actor, a canary
under load, promote, rollback and retire, with runs in flight that never change plan; and the shard
refusing a start of an unreviewed or retired plan that a forged message slips past the client."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from orchestrator.client import SyncClient, run_id_for, start_envelope
from orchestrator.compiler import compile_text
from orchestrator.governance.lifecycle import (
    Actor,
    Change,
    DefinitionState,
    State,
    approve,
    on_canary,
    retire,
)
from orchestrator.governance.service import publish_verb
from orchestrator.governance.store import DefinitionChanged, DefinitionStore, definition_key
from orchestrator.settings import redis_client
from orchestrator.store.keys import index_key
from tests.integration.stack import REGISTRY, ROOT, Stack, poll, running

pytestmark = pytest.mark.services

MODEL_INGEST = (ROOT / "definitions" / "model-ingest.yaml").read_text()
ALICE = {"SAGA_ACTOR": "alice", "SAGA_REQUIRE_SEPARATE_APPROVER": "1"}
BOB = {"SAGA_ACTOR": "bob", "SAGA_REQUIRE_SEPARATE_APPROVER": "1"}


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with running("governance") as s:
        yield s


def version_file(tmp: Path, version: str, deadline_ms: int = 200_000) -> Path:
    """model-ingest under another version, with another meaning (its render deadline)."""
    text = MODEL_INGEST.replace('version: "2.3.0"', f'version: "{version}"')
    text = text.replace("execution_deadline_ms: 300000", f"execution_deadline_ms: {deadline_ms}")
    path = tmp / f"model-ingest-{version}-{deadline_ms}.yaml"
    path.write_text(text)
    return path


def saga(stack: Stack, *args: str, env: dict[str, str] | None = None, code: int = 0) -> Any:
    """``saga ARGS --json`` as an actor; asserts its exit code; its JSON (a refusal's error document)."""
    done = stack.saga(*args, "--json", extra_env=env)
    assert done.returncode == code, (args, done.stdout, done.stderr)
    return json.loads(done.stdout)


def versions(stack: Stack) -> dict[str, dict[str, Any]]:
    return {row["version"]: row for row in saga(stack, "definitions", "list", "model-ingest")}


def forged_start(stack: Stack, run_id: str, digest: str) -> None:
    """A correctly signed start that names ``digest``, sent straight to the start exchange: what a client
    that skips the checks (or an old one) would send."""
    envelope = start_envelope(stack.signer, run_id, "model-ingest", digest, {"modelId": run_id})
    stack.publish_envelope(envelope, stack.settings.names().start_exchange("fast"), run_id)


def start_many(client: SyncClient, prefix: str, n: int) -> list[str]:
    with ThreadPoolExecutor(1) as pool:  # one connection: SyncClient is not thread-safe
        return list(
            pool.map(
                lambda i: client.start("model-ingest", {"modelId": f"{prefix}-{i}"}, f"{prefix}-{i}"),
                range(n),
            )
        )


def test_republishing_a_version_is_a_no_op_and_another_file_under_it_is_refused(
    stack: Stack, tmp_path: Path
) -> None:
    first = version_file(tmp_path, "9.0.0")
    (published,) = saga(stack, "definitions", "publish", str(first), env=ALICE)
    assert published["state"] == "published" and published["changed"]
    # The same file again changes nothing
    (again,) = saga(stack, "definitions", "publish", str(first), env=BOB)
    assert again == {**published, "changed": False}
    # Another file under the same version is refused, naming both digests, and changes nothing
    before = versions(stack)["9.0.0"]
    other = version_file(tmp_path, "9.0.0", deadline_ms=100_000)
    refused = saga(stack, "definitions", "publish", str(other), env=ALICE, code=1)["error"]
    assert refused["code"] == "version_exists"
    assert published["digest"] in refused["message"] and "bump 'version'" in refused["message"]
    assert refused["ids"]["stored_digest"] == published["digest"] != refused["ids"]["digest"]
    assert versions(stack)["9.0.0"] == before
    # The publisher may not approve it where separate approval is on; someone else may
    refused = saga(stack, "definitions", "approve", "model-ingest", "--version", "9.0.0", env=ALICE, code=1)
    assert refused["error"]["ids"]["reason"] == "separate_approver_required"
    assert "alice" in refused["error"]["message"]
    # and 'publish --activate' is refused there
    done = stack.saga(
        "definitions", "publish", "--activate", str(version_file(tmp_path, "9.0.1")), extra_env=BOB
    )
    assert done.returncode == 1 and "separate approval is on" in done.stderr
    saga(stack, "definitions", "retire", "model-ingest", "--version", "9.0.0", env=BOB)
    # Usage errors exit 2, unknown names and versions 1, each saying what to do
    assert (
        stack.saga("definitions", "canary", "model-ingest", "--version", "9.0.0", "--percent", "0").returncode
        == 2
    )
    unknown = saga(stack, "definitions", "approve", "model-ingst", "--version", "1", code=1)["error"]
    assert unknown["code"] == "definition_not_found" and unknown["ids"]["did_you_mean"] == "model-ingest"
    missing = saga(stack, "definitions", "activate", "model-ingest", "--version", "7.7.7", code=1)["error"]
    assert missing["ids"]["reason"] == "unknown_version" and "publish it first" in missing["message"]
    down = stack.saga("definitions", "list", extra_env={"SAGA_REDIS_URL": "redis://127.0.0.1:1/0"})
    assert down.returncode == 2 and "Redis" in down.stderr


def test_a_release_under_load_canary_promote_rollback_retire_never_moves_a_run(
    stack: Stack, tmp_path: Path
) -> None:
    client = SyncClient(stack.settings)
    old = versions(stack)["2.3.0"]
    assert old["state"] == "active"
    # Given 100 runs of 2.3.0 in flight
    pinned: dict[str, str] = {run: old["digest"] for run in start_many(client, "before", 100)}

    # When 2.4.0 is published by alice...
    (new,) = saga(stack, "definitions", "publish", str(version_file(tmp_path, "2.4.0")), env=ALICE)
    assert new["state"] == "published" and new["digest"] != old["digest"]
    # ...it cannot be started yet, at the client...
    done = stack.saga("start", "model-ingest", "--version", "2.4.0", "--context", '{"modelId": "x"}')
    assert done.returncode == 1 and "version 2.4.0 is published (not approved yet)" in done.stderr
    assert "versions you may start: 2.3.0" in done.stderr
    # ...nor at the shard, when a start forged past the client names its plan
    forged = "forged-unapproved"
    forged_start(stack, forged, new["digest"])
    refused = client.wait(forged, timeout_s=30)
    assert refused.state == "refused" and "2.4.0" in (refused.reason or "")
    assert "not approved" in (refused.reason or "")
    assert saga(stack, "status", forged)["state"] == "refused"
    assert stack.saga("wait", forged).returncode == 1
    # and the shard claims a start's run id only once its version may start runs: a refused start
    # holds no run id
    assert stack.redis.get(index_key(stack.prefix, forged)) is None

    # When bob approves it, the same forged start creates its run after all (status shows the run)
    saga(stack, "definitions", "approve", "model-ingest", "--version", "2.4.0", env=BOB)
    forged_start(stack, forged, new["digest"])
    poll(lambda: client.status(forged)["state"] != "refused", 30, what="the run created after all")
    assert client.wait(forged, timeout_s=60).state == "completed"
    assert saga(stack, "status", forged)["digest"] == new["digest"]
    # and he puts it on a 30 % canary
    canary = saga(
        stack, "definitions", "canary", "model-ingest", "--version", "2.4.0", "--percent", "30", env=BOB
    )
    assert canary["canary"] == "2.4.0" and canary["canary_percent"] == 30
    # Then nothing but promote or abort changes the definition meanwhile
    for verb in (["retire", "--version", "2.3.0"], ["activate", "--version", "2.4.0"], ["rollback"]):
        refused = saga(stack, "definitions", verb[0], "model-ingest", *verb[1:], env=BOB, code=1)
        assert refused["error"]["ids"]["reason"] == "canary_in_progress", verb
    # And 300 starts with fixed idempotency keys split exactly as the run-id rule says
    canary_client = SyncClient(stack.settings)  # not the one that cached the routing before the canary
    runs = start_many(canary_client, "canary", 300)
    assert runs == [run_id_for("model-ingest", f"canary-{i}") for i in range(300)]
    for run in runs:
        pinned[run] = new["digest"] if on_canary(run, 30) else old["digest"]
    on_new = sum(1 for run in runs if pinned[run] == new["digest"])
    assert 50 < on_new < 150  # the rule's share of these ids (exactly checked run by run below)
    # and a re-sent start picks the same version (the same run)
    assert start_many(canary_client, "canary", 20) == runs[:20]

    # When bob promotes the canary, then rolls back
    promoted = saga(stack, "definitions", "promote", "model-ingest", env=BOB)
    assert promoted["active"] == "2.4.0" and promoted["canary"] is None
    after_promote = SyncClient(stack.settings)
    for run in start_many(after_promote, "promoted", 20):
        pinned[run] = new["digest"]
    rolled = saga(stack, "definitions", "rollback", "model-ingest", "--reason", "render regressions", env=BOB)
    assert rolled["active"] == "2.3.0"
    after_rollback = SyncClient(stack.settings)
    for run in start_many(after_rollback, "rolled-back", 20):
        pinned[run] = old["digest"]
    # and retires 2.4.0: no new runs of it, at the client or at the shard
    saga(stack, "definitions", "retire", "model-ingest", "--version", "2.4.0", env=BOB)
    done = stack.saga("start", "model-ingest", "--version", "2.4.0", "--context", '{"modelId": "y"}')
    assert done.returncode == 1 and "version 2.4.0 is retired" in done.stderr
    forged_start(stack, "forged-retired", new["digest"])
    refused = client.wait("forged-retired", timeout_s=30)
    assert refused.state == "refused" and "retired" in (refused.reason or "")
    assert stack.redis.get(index_key(stack.prefix, "forged-retired")) is None
    # even for a run id whose claim outlived its run (a crash between claim and create, an expired run)
    stack.redis.set(index_key(stack.prefix, "forged-orphan"), "fast.0")
    forged_start(stack, "forged-orphan", new["digest"])
    refused = client.wait("forged-orphan", timeout_s=30)
    assert refused.state == "refused" and "retired" in (refused.reason or "")

    # Then every run completes on the plan it was pinned to
    for run, digest in pinned.items():
        assert client.wait(run, timeout_s=120).state == "completed", run
        assert client.status(run)["digest"] == digest, run
    # and the retired version's runs drain to 0 in the listing, which says who did what
    listed = poll(
        lambda: (rows := versions(stack))["2.4.0"]["unfinished_runs"] == 0 and rows,
        30,
        what="2.4.0 drained",
    )
    assert listed["2.4.0"]["state"] == "retired" and listed["2.3.0"]["state"] == "active"
    assert listed["2.4.0"]["published_by"] == "alice" and listed["2.4.0"]["approved_by"] == "bob"
    assert listed["2.3.0"]["unfinished_runs"] == 0
    audit = [
        (a["action"], a["version"], a["from"], a["to"], a["actor"])
        for a in saga(stack, "definitions", "show", "model-ingest")["audit"]
        if a["version"] == "2.4.0" or a["action"] in ("promote", "rollback")
    ]
    assert audit == [
        ("publish", "2.4.0", "", "published", "alice"),
        ("approve", "2.4.0", "published", "approved", "bob"),
        ("canary", "2.4.0", "approved", "canary", "bob"),
        ("promote", "2.3.0", "active", "standby", "bob"),
        ("promote", "2.4.0", "canary", "active", "bob"),
        ("rollback", "2.4.0", "active", "standby", "bob"),
        ("rollback", "2.3.0", "standby", "active", "bob"),
        ("retire", "2.4.0", "standby", "retired", "bob"),
    ]
    rollback = next(
        a for a in saga(stack, "definitions", "show", "model-ingest")["audit"] if a["action"] == "rollback"
    )
    assert rollback["reason"] == "render regressions"
    diff = saga(stack, "definitions", "diff", "model-ingest", "2.3.0", "2.4.0")
    assert diff["stages_changed"]["render-thumbnail"] == [
        {"path": "execution_deadline_ms", "before": 300_000, "after": 200_000}
    ]
    for c in (client, canary_client, after_promote, after_rollback):
        c.close()


def test_two_lifecycle_changes_at_once_never_both_win(stack: Stack, tmp_path: Path) -> None:
    """A change stored over a revision someone else moved meanwhile is computed again from the new
    state; one that keeps losing gives up with DefinitionChanged, storing nothing."""
    key = definition_key(stack.prefix, "model-ingest")

    def someone_else_writes() -> None:  # between this command's read and its write
        stack.redis.eval(BUMP, 1, key)

    async def main() -> None:
        client = redis_client(stack.settings)
        store = DefinitionStore(client, stack.prefix)
        try:
            for version in ("9.1.0", "9.2.0"):
                plan = compile_text(version_file(tmp_path, version).read_text(), f"{version}.yaml", REGISTRY)
                await store.change("model-ingest", publish_verb(plan, activate=False), "alice", "", plan)
            first = (await store.load("model-ingest")).revision
            seen: list[int] = []

            def loses_once(state: DefinitionState, actor: Actor, _: list[str]) -> Change:
                seen.append(state.revision)
                if len(seen) == 1:
                    someone_else_writes()
                return approve(state, "9.2.0", actor, separate_approver=True)

            change = await store.change("model-ingest", loses_once, "bob", "race")
            assert seen == [first, first + 1]  # computed again from the state the other write left
            state = await store.load("model-ingest")
            assert state.revision == first + 2 and state.versions["9.2.0"].state is State.APPROVED
            assert [r.actor for r in change.records] == ["bob"]

            def always_loses(state: DefinitionState, actor: Actor, _: list[str]) -> Change:
                someone_else_writes()
                return retire(state, "9.2.0", actor)

            with pytest.raises(DefinitionChanged, match="nothing was changed"):
                await store.change("model-ingest", always_loses, "bob", "")
            assert (await store.load("model-ingest")).versions["9.2.0"].state is State.APPROVED
        finally:
            await client.aclose()

    asyncio.run(main())


#: Another writer's change, as far as the revision check can tell.
BUMP = """
local doc = cjson.decode(redis.call('GET', KEYS[1]))
doc.revision = doc.revision + 1
redis.call('SET', KEYS[1], cjson.encode(doc))
"""

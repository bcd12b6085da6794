"""Tokens on the real Redis (``orchestrator/auth/tokens.py``) and ``saga tokens`` as real subprocesses:
create, verify, list and revoke; a revoked token refused at once; one live token per name, even under
concurrent creates; no secret anywhere in Redis; every change audited; JSON and exit codes.

Each test runs under a key prefix of its own: a :class:`Stack` that is never set up (no vhost, no
processes), whose teardown deletes the prefix's keys.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import pytest

from orchestrator.auth import tokens
from orchestrator.auth.roles import Identity, Role, RoleUnknown
from orchestrator.auth.tokens import (
    TokenNameInvalid,
    TokenNameTaken,
    TokenNotFound,
    TokenStore,
    hash_secret,
    token_key,
)
from tests.integration.stack import Stack

pytestmark = pytest.mark.services

T = TypeVar("T")


@pytest.fixture
def stack() -> Iterator[Stack]:
    s = Stack("tokens")
    try:
        yield s
    finally:
        s.teardown(drop_vhost=False)


def with_store(stack: Stack, test: Callable[[TokenStore], Awaitable[T]]) -> T:
    async def main() -> T:
        async with tokens.opened(stack.settings) as store:
            return await test(store)

    return asyncio.run(main())


def stored_text(stack: Stack) -> str:
    """Every key of the stack's prefix and every value in it (hash fields, set members, stream entries),
    as one string."""
    parts: list[str] = []
    for key in stack.redis.scan_iter(match=f"{stack.prefix}:*"):
        parts.append(key)
        kind = stack.redis.type(key)
        if kind == "hash":
            parts.extend(f"{k}={v}" for k, v in stack.redis.hgetall(key).items())
        elif kind == "set":
            parts.extend(stack.redis.smembers(key))
        elif kind == "stream":
            for entry_id, fields in stack.redis.xrange(key):
                parts.append(entry_id)
                parts.extend(f"{k}={v}" for k, v in fields.items())
        elif kind == "string":
            parts.append(stack.redis.get(key) or "")
        else:
            raise AssertionError(f"{key}: a {kind} the test does not read")
    return "\n".join(parts)


def saga(stack: Stack, *args: str, code: int = 0, actor: str = "alice") -> Any:
    """``saga ARGS --json`` as ``actor``; asserts its exit code; its JSON (a refusal's error document)."""
    done = stack.saga(*args, "--json", extra_env={"SAGA_ACTOR": actor})
    assert done.returncode == code, (args, done.stdout, done.stderr)
    return json.loads(done.stdout)


# ---- the store --------------------------------------------------------------------------------------


def test_create_verify_list_revoke(stack: Stack) -> None:
    async def test(store: TokenStore) -> None:
        # Given a token created by alice
        before = await store.now_ms()
        secret, record = await store.create("ci-bot", Role.OPERATOR, "team-a", actor="alice")
        after = await store.now_ms()
        assert secret.startswith(f"saga_{record.token_id}_")
        assert len(secret.split("_", 2)[2]) == 43  # 32 random bytes, URL-safe base64
        assert (record.name, record.role, record.tenant, record.created_by) == (
            "ci-bot",
            Role.OPERATOR,
            "team-a",
            "alice",
        )
        assert before <= record.created_at <= after
        assert record.live

        # Then its secret verifies as its identity, and anything close to it does not
        identity = Identity("ci-bot", Role.OPERATOR, "team-a", record.token_id)
        assert await store.verify(secret) == identity
        assert await store.verify(secret[:-1] + ("A" if secret[-1] != "A" else "B")) is None
        assert await store.verify(f"saga_{'0' * 12}_{secret.split('_', 2)[2]}") is None
        assert await store.verify("") is None
        assert await store.verify("Bearer " + secret) is None

        # And list shows it, as get does by name and by id
        assert await store.list() == [record]
        assert await store.get("ci-bot") == record
        assert await store.get(record.token_id) == record

        # When bob revokes it
        revoked, changed = await store.revoke("ci-bot", "bob")

        # Then the very next verify refuses it, on this connection and on another
        assert changed
        assert await store.verify(secret) is None
        async with tokens.opened(stack.settings) as other:
            assert await other.verify(secret) is None
        assert revoked.revoked_by == "bob"
        assert revoked.revoked_at is not None and revoked.revoked_at >= record.created_at
        assert not revoked.live
        assert await store.list() == [revoked]

        # And revoking it again by id changes nothing; by name there is no live token of that name
        again, changed = await store.revoke(record.token_id, "carol")
        assert (again, changed) == (revoked, False)
        with pytest.raises(TokenNotFound) as caught:
            await store.revoke("ci-bot", "bob")
        assert caught.value.code == "token_not_found"
        assert caught.value.ids == {"token": "ci-bot"}

    with_store(stack, test)


def test_a_live_name_is_refused_and_free_again_once_revoked(stack: Stack) -> None:
    async def test(store: TokenStore) -> None:
        # Given a live token named deploy
        first_secret, first = await store.create("deploy", "author", actor="alice")

        # When another is created under that name, Then it is refused naming the live one
        with pytest.raises(TokenNameTaken) as caught:
            await store.create("deploy", "viewer", actor="bob")
        assert caught.value.code == "token_name_taken"
        assert caught.value.ids == {"name": "deploy", "token_id": first.token_id}
        assert "saga tokens revoke deploy" in str(caught.value)
        assert len(await store.list()) == 1

        # When the first is revoked, Then the name can be used again, and only the new secret verifies
        await store.revoke("deploy", "alice")
        second_secret, second = await store.create("deploy", "viewer", actor="alice")
        assert second.token_id != first.token_id
        assert await store.verify(first_secret) is None
        verified = await store.verify(second_secret)
        assert verified is not None and verified.role is Role.VIEWER
        assert await store.get("deploy") == second
        assert [r.token_id for r in await store.list()] == [first.token_id, second.token_id]

    with_store(stack, test)


def test_concurrent_creates_of_one_name_leave_one_token(stack: Stack) -> None:
    async def create(name: str) -> str:
        async with tokens.opened(stack.settings) as store:
            try:
                await store.create(name, Role.VIEWER, actor="racer")
            except TokenNameTaken:
                return "taken"
            return "created"

    async def race() -> list[str]:
        return list(await asyncio.gather(*(create("shared") for _ in range(12))))

    # When twelve clients create the same name at once, Then exactly one succeeds
    outcomes = asyncio.run(race())
    assert sorted(outcomes) == ["created"] + ["taken"] * 11
    assert [r.name for r in with_store(stack, lambda s: s.list())] == ["shared"]


def test_invalid_input_is_refused_before_anything_is_stored(stack: Stack) -> None:
    async def test(store: TokenStore) -> None:
        with pytest.raises(TokenNameInvalid):
            await store.create("bad name", Role.VIEWER, actor="alice")
        with pytest.raises(TokenNameInvalid):
            await store.create("ok", Role.VIEWER, "bad tenant", actor="alice")
        with pytest.raises(RoleUnknown):
            await store.create("ok", "root", actor="alice")
        with pytest.raises(TokenNotFound):
            await store.revoke("nobody", "alice")
        with pytest.raises(TokenNotFound):
            await store.get("0123456789ab")

    with_store(stack, test)
    assert stored_text(stack) == ""


def test_redis_holds_no_secret_only_its_hash_and_an_audit_of_every_change(stack: Stack) -> None:
    async def test(store: TokenStore) -> list[str]:
        made = [await store.create(f"bot-{i}", role, actor="alice") for i, role in enumerate(Role)]
        await store.revoke("bot-0", "bob")
        return [secret for secret, _ in made]

    secrets_made = with_store(stack, test)
    text = stored_text(stack)

    # Then neither a secret nor its random part is anywhere in Redis; each hash is, once
    for secret in secrets_made:
        random_part = secret.split("_", 2)[2]
        assert secret not in text
        assert random_part not in text
        assert text.count(hash_secret(secret)) == 1
    # And every key is under the {auth} hash tag (one slot: the Lua scripts touch several at once)
    keys = list(stack.redis.scan_iter(match=f"{stack.prefix}:*"))
    assert keys and all(key.startswith(f"{stack.prefix}:{{auth}}:") for key in keys)
    # And list never carries the hash
    records = with_store(stack, lambda s: s.list())
    assert all("hash" not in r.to_json() for r in records)
    # (tokens made in the same millisecond list in id order, so find the first by its name)
    first_id = next(r.token_id for r in records if r.name == "bot-0")
    assert stack.redis.hget(token_key(stack.prefix, first_id), "hash") == hash_secret(secrets_made[0])

    # And the audit has one entry per create and revoke: who, when, what
    audit = with_store(stack, lambda s: s.audit())
    assert [(a["action"], a["actor"], a["name"]) for a in audit] == [
        *(("create", "alice", f"bot-{i}") for i in range(len(Role))),
        ("revoke", "bob", "bot-0"),
    ]
    assert [a["role"] for a in audit[:-1]] == [r.value for r in Role]
    assert all(isinstance(a["at"], int) and a["at"] > 0 for a in audit)
    assert audit[-1]["token_id"] == first_id


# ---- saga tokens --------------------------------------------------------------------------------------


def test_cli_create_list_revoke_with_json(stack: Stack) -> None:
    # When alice creates a token with --json
    created = saga(stack, "tokens", "create", "--name", "ci-bot", "--role", "operator", "--tenant", "t1")

    # Then the document has the secret (once), the warning, and the record
    secret = created["secret"]
    assert "not shown again" in created["warning"]
    assert (created["name"], created["role"], created["tenant"], created["created_by"]) == (
        "ci-bot",
        "operator",
        "t1",
        "alice",
    )
    assert created["live"] is True and created["revoked_at"] is None
    identity = with_store(stack, lambda s: s.verify(secret))
    assert identity == Identity("ci-bot", Role.OPERATOR, "t1", created["token_id"])

    # And list shows it, without the secret or its hash
    listed = saga(stack, "tokens", "list")
    assert [t["token_id"] for t in listed] == [created["token_id"]]
    assert secret not in json.dumps(listed) and hash_secret(secret) not in json.dumps(listed)

    # When the name is used again: refused, exit 1
    error = saga(stack, "tokens", "create", "--name", "ci-bot", "--role", "viewer", code=1)["error"]
    assert error["code"] == "token_name_taken"
    assert error["ids"] == {"name": "ci-bot", "token_id": created["token_id"]}

    # When bob revokes it: done, and the secret no longer verifies
    revoked = saga(stack, "tokens", "revoke", "ci-bot", actor="bob")
    assert (revoked["changed"], revoked["live"], revoked["revoked_by"]) == (True, False, "bob")
    assert with_store(stack, lambda s: s.verify(secret)) is None

    # And again by id: nothing changes (exit 0); by name: not found (exit 1)
    assert saga(stack, "tokens", "revoke", created["token_id"])["changed"] is False
    error = saga(stack, "tokens", "revoke", "ci-bot", code=1)["error"]
    assert (error["code"], error["ids"]) == ("token_not_found", {"token": "ci-bot"})


def test_cli_usage_errors_exit_2(stack: Stack) -> None:
    error = saga(stack, "tokens", "create", "--name", "x", "--role", "root", code=2)["error"]
    assert error["code"] == "usage" and "root" in error["message"]
    error = saga(stack, "tokens", "create", "--name", "bad name", "--role", "viewer", code=2)["error"]
    assert error["code"] == "usage" and "bad name" in error["message"]
    done = stack.saga("tokens", "list", "--json", extra_env={"SAGA_REDIS_URL": "redis://127.0.0.1:1/0"})
    assert done.returncode == 2, done.stderr
    assert json.loads(done.stdout)["error"]["code"] == "redis_unreachable"
    assert stored_text(stack) == ""


def test_cli_text_prints_the_secret_alone_on_stdout(stack: Stack) -> None:
    # When a token is created without --json
    done = stack.saga(
        "tokens", "create", "--name", "human", "--role", "admin", extra_env={"SAGA_ACTOR": "al"}
    )

    # Then stdout is the secret alone (TOKEN=$(saga tokens create ...)); stderr says it is shown once
    assert done.returncode == 0, done.stderr
    secret = done.stdout.strip()
    assert done.stdout == secret + "\n"
    assert "not shown again" in done.stderr and "human" in done.stderr
    identity = with_store(stack, lambda s: s.verify(secret))
    assert identity is not None and (identity.name, identity.role) == ("human", Role.ADMIN)

    # And the text list shows it, and revoke says so
    listed = stack.saga("tokens", "list")
    assert listed.returncode == 0
    assert "human" in listed.stdout and "admin" in listed.stdout and "live" in listed.stdout
    assert secret not in listed.stdout
    revoked = stack.saga("tokens", "revoke", "human")
    assert revoked.returncode == 0 and "revoked token human" in revoked.stdout
    assert "revoked" in stack.saga("tokens", "list").stdout

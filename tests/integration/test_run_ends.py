"""A run's end is announced to whoever waits for it (``orchestrator/run_ends.py``): ``Client.wait`` and
``SyncClient.wait`` return at the announcement, not at their next read of the run, for a run that
completes, a start the shard refuses and a run a poison message fails; a subscription whose connection
Redis dropped is restored before the run ends.

Each wait here reads its run only every ``NO_POLL_S`` (longer than its timeout), and once more at its
deadline: without an announcement it sits out its whole timeout (a minute) before that last read, which
the tests tell from a return within half of it (the runs take well under a second).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import Iterator

import pytest
import redis
import redis.asyncio as aioredis

from orchestrator.bus.envelope import Signer
from orchestrator.client import Client, RunResult, SyncClient, start_envelope
from orchestrator.run_ends import Ending, RunEnds, parse_ending
from orchestrator.settings import DEVELOPMENT_SIGNING_KEY
from orchestrator.shard.processor import Processor
from orchestrator.store.keys import finished_channel, refused_key
from orchestrator.store.redis_store import RedisStore
from tests.conftest import DEFINITIONS, compile_yaml
from tests.faults import invariants
from tests.integration.stack import Stack, publish_active, running

pytestmark = pytest.mark.services

NO_POLL_S = 600.0
TIMEOUT_S = 60.0
UNKNOWN_DIGEST = "sha256:" + "0" * 64


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with running("run-ends") as s:
        yield s


async def _announced_wait(client: Client, run_id: str) -> RunResult:
    began = time.monotonic()
    result = await client.wait(run_id, timeout_s=TIMEOUT_S, poll_s=NO_POLL_S)
    assert time.monotonic() - began < TIMEOUT_S / 2, "the wait sat out its timeout: nothing announced the end"
    return result


def _invariants_hold(stack: Stack, run_ids: list[str]) -> None:
    """The fault suite's shared checks over runs whose end was announced: the announcement is the
    transition's last call and writes nothing, so every run invariant holds as without it."""
    assert invariants.wait_for_convergence(stack.redis, stack.prefix, run_ids, TIMEOUT_S) == []
    assert invariants.check_runs(stack.redis, stack.prefix, run_ids, effects=False) == []


def _forged_start(stack: Stack, run_id: str) -> None:
    """A signed start of a plan that was never published: the shard refuses it (no run is created)."""
    envelope = start_envelope(stack.signer, run_id, "model-ingest", UNKNOWN_DIGEST, {"modelId": run_id})
    stack.publish_envelope(envelope, stack.settings.names().start_exchange("fast"), run_id)


async def _pubsub_port(client: Client) -> int:
    ends = client._run_ends()
    assert ends._pubsub is not None and ends._pubsub.connection is not None
    return int(ends._pubsub.connection._writer.get_extra_info("sockname")[1])  # type: ignore[union-attr]


def test_a_wait_returns_at_the_announcement_of_the_runs_end(stack: Stack) -> None:
    async def main() -> str:
        async with Client(stack.settings) as client:
            run_id = await client.start("model-ingest", {"modelId": "announced"})
            result = await _announced_wait(client, run_id)
            document = await client.status(run_id)  # what the announcement carried is what the run holds
            assert document is not None and result.state == "completed" == document["state"]
            assert result.output == document["output"] and result.output is not None
            assert result.reason == document["reason"]
            assert client._run_ends()._channels == {}  # unsubscribed once it returned
            return run_id

    _invariants_hold(stack, [asyncio.run(main())])


def test_a_blocking_wait_returns_at_the_announcement_too(stack: Stack) -> None:
    client = SyncClient(stack.settings)
    try:
        run_id = client.start("model-ingest", {"modelId": "announced-sync"})
        began = time.monotonic()
        assert client.wait(run_id, timeout_s=TIMEOUT_S, poll_s=NO_POLL_S).state == "completed"
        assert time.monotonic() - began < TIMEOUT_S / 2, "the wait sat out its timeout: nothing announced"
    finally:
        client.close()
    _invariants_hold(stack, [run_id])


def test_a_refused_start_is_announced_to_a_wait_that_began_before_it(stack: Stack) -> None:
    async def main() -> None:
        async with Client(stack.settings) as client:
            run_id = f"refused-{uuid.uuid4().hex[:8]}"
            waiting = asyncio.create_task(_announced_wait(client, run_id))
            await asyncio.sleep(0.5)  # subscribed, and its first read found no run
            assert not waiting.done()
            await asyncio.to_thread(_forged_start, stack, run_id)
            result = await waiting
            assert result.state == "refused" and UNKNOWN_DIGEST in (result.reason or "")

    asyncio.run(main())


def test_a_subscription_redis_dropped_is_restored_before_the_run_ends(stack: Stack) -> None:
    async def main() -> None:
        async with Client(stack.settings) as client:
            run_id = f"dropped-{uuid.uuid4().hex[:8]}"
            waiting = asyncio.create_task(_announced_wait(client, run_id))
            await asyncio.sleep(0.5)
            port = await _pubsub_port(client)
            admin = aioredis.Redis.from_url(stack.settings.redis_url, decode_responses=True)
            try:
                assert await admin.client_kill_filter(addr=f"127.0.0.1:{port}") == 1
            finally:
                await admin.aclose()
            await asyncio.sleep(1.5)  # the reader meets the closed connection, reconnects, subscribes again
            assert not waiting.done()
            await asyncio.to_thread(_forged_start, stack, run_id)
            assert (await waiting).state == "refused"
            assert await _pubsub_port(client) != port

    asyncio.run(main())


async def _started(store: RedisStore, signer: Signer, run_id: str, context: dict[str, str]) -> None:
    """A model-ingest run ``run_id`` created on shard fast.0 by the shard's processor, as a start makes it
    (the library loaded and the definition published first)."""
    await store.load_library()
    plan = compile_yaml((DEFINITIONS / "model-ingest.yaml").read_text())
    await publish_active(store, plan)
    start = start_envelope(signer, run_id, "model-ingest", plan.digest, context)
    await Processor(store, lambda: int(time.time() * 1000)).handle_batch("fast.0", [start])


def test_a_run_failed_by_a_poison_message_is_announced() -> None:
    prefix = f"t{uuid.uuid4().hex}"
    signer = Signer.from_settings((DEVELOPMENT_SIGNING_KEY,))

    async def main() -> None:
        client = aioredis.Redis.from_url("redis://127.0.0.1:6379/0", decode_responses=True)
        store = RedisStore(client, prefix=prefix)
        ends = client.pubsub(ignore_subscribe_messages=True)
        try:
            await _started(store, signer, "poisoned", {"modelId": "p"})
            await ends.subscribe(finished_channel(prefix, "poisoned"))
            assert await store.poison("fast.0", "poisoned", "poison-1", "test", int(time.time() * 1000)) == 0
            async with asyncio.timeout(TIMEOUT_S):
                message = None
                while message is None:  # None too for the subscription's own confirmation
                    message = await ends.get_message(ignore_subscribe_messages=True, timeout=1.0)
            ending = parse_ending(message["data"])
            assert ending is not None and ending.state == "failed" and "poison-1" in (ending.reason or "")
        finally:
            await ends.aclose()
            async for key in client.scan_iter(match=f"{prefix}:*"):
                await client.delete(key)
            await client.aclose()

    asyncio.run(main())


def test_waits_begun_together_share_one_subscription_connection_and_each_hears_its_end() -> None:
    prefix = f"t{uuid.uuid4().hex}"
    name = f"run-ends-{uuid.uuid4().hex[:8]}"  # every connection of this client carries it

    async def main() -> None:
        redis = aioredis.Redis.from_url("redis://127.0.0.1:6379/0", decode_responses=True, client_name=name)
        ends = RunEnds(redis, prefix)
        try:
            async with contextlib.AsyncExitStack() as stack:
                runs = [f"run-{i}" for i in range(5)]
                watches = await asyncio.gather(*(stack.enter_async_context(ends.watching(r)) for r in runs))
                mine = [c for c in await redis.client_list() if c.get("name") == name]
                subscribed = [c for c in mine if int(c.get("sub", 0)) > 0]
                assert len(subscribed) == 1 and int(subscribed[0]["sub"]) == len(runs)
                for i, run in enumerate(runs):
                    ending = json.dumps({"state": "completed", "output": json.dumps({"n": i})})
                    await redis.publish(finished_channel(prefix, run), ending)
                async with asyncio.timeout(TIMEOUT_S):
                    await asyncio.gather(*(watch.ended.wait() for watch in watches))
                assert [w.ending for w in watches] == [Ending("completed", {"n": i}) for i in range(5)]
        finally:
            await ends.close()
            await redis.aclose()

    asyncio.run(main())


def test_a_wait_begun_as_the_last_one_on_its_run_leaves_is_still_announced_the_end() -> None:
    prefix = f"t{uuid.uuid4().hex}"

    async def main() -> None:
        redis = aioredis.Redis.from_url("redis://127.0.0.1:6379/0", decode_responses=True)
        ends = RunEnds(redis, prefix)
        try:
            async with ends.watching("again"):
                pass  # its unsubscribe is sent; the next wait's subscribe follows it on the connection
            async with ends.watching("again") as watch:
                await redis.publish(finished_channel(prefix, "again"), json.dumps({"state": "failed"}))
                async with asyncio.timeout(TIMEOUT_S):
                    await watch.ended.wait()
                assert watch.ending == Ending("failed")
        finally:
            await ends.close()
            await redis.aclose()

    asyncio.run(main())


@contextlib.contextmanager
def _user_without_channels() -> Iterator[str]:
    """A Redis user who may run every command on every key but subscribe to no channel (what Redis 7
    gives a new user unless told otherwise): its Redis URL."""
    admin = redis.Redis.from_url("redis://127.0.0.1:6379/0")
    name, password = f"t-ends-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    admin.acl_setuser(name, enabled=True, passwords=[f"+{password}"], keys=["*"], commands=["+@all"])
    admin.execute_command("ACL", "SETUSER", name, "resetchannels")
    try:
        yield f"redis://{name}:{password}@127.0.0.1:6379/0"
    finally:
        admin.acl_deluser(name)
        admin.close()


def test_where_subscriptions_are_refused_waits_read_their_runs(stack: Stack) -> None:
    with _user_without_channels() as url:

        async def main() -> None:
            redis = aioredis.Redis.from_url(url, decode_responses=True)
            ends = RunEnds(redis, f"t{uuid.uuid4().hex}")
            try:
                async with asyncio.timeout(TIMEOUT_S / 4), ends.watching("refused-here"):
                    pass
                assert not ends.announced  # from now on its waits read their runs
            finally:
                await ends.close()
                await redis.aclose()

        asyncio.run(main())
        with SyncClient(stack.settings) as starting:
            run_id = starting.start("model-ingest", {"modelId": "unannounced"})
        blocking = SyncClient(stack.settings.model_copy(update={"redis_url": url}))
        try:
            assert blocking.wait(run_id, timeout_s=TIMEOUT_S).state == "completed"
        finally:
            blocking.close()
    _invariants_hold(stack, [run_id])


def test_a_store_that_may_not_publish_still_commits_a_runs_end_and_its_refusals() -> None:
    """The announcement cannot fail what it announces: a Redis user without channel rights (Redis 7's
    default for a new user) refuses the PUBLISH inside the transition function, and the transition's
    writes stand all the same; a refused start is recorded all the same."""
    prefix = f"t{uuid.uuid4().hex}"
    signer = Signer.from_settings((DEVELOPMENT_SIGNING_KEY,))

    async def main(url: str) -> None:
        client = aioredis.Redis.from_url(url, decode_responses=True)
        store = RedisStore(client, prefix=prefix)
        try:
            await _started(store, signer, "muted", {"modelId": "m"})
            assert await store.poison("fast.0", "muted", "poison-1", "test", int(time.time() * 1000)) == 0
            assert await client.hget(store.keys("fast.0").run("muted"), "status") == "failed"
            await store.record_refusal("refused-muted", UNKNOWN_DIGEST, None, "not published", 0)
            assert await client.hget(refused_key(prefix, "refused-muted"), "reason") == "not published"
        finally:
            async for key in client.scan_iter(match=f"{prefix}:*"):
                await client.delete(key)
            await client.aclose()

    with _user_without_channels() as url:
        asyncio.run(main(url))

"""The demo's effect ledger on the real Redis: a connection dropped under a call (a Redis Cluster slot
moving closes it) is retried, and the effect is still recorded once."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from workers.demo.effects import AsyncDemoWorld, demo_key

pytestmark = pytest.mark.services


class _DropsFirstCalls(aioredis.Redis):
    """A client whose first ``drops`` script calls lose their connection after Redis ran them."""

    drops = 2

    async def eval(self, *args: Any) -> Any:
        reply = await super().eval(*args)  # type: ignore[misc]
        if self.drops:
            self.drops -= 1
            raise redis.exceptions.ConnectionError("Connection closed by server.")
        return reply


def test_an_effect_whose_connection_drops_is_retried_and_recorded_once() -> None:
    prefix = f"saga-test-demo-{uuid.uuid4().hex[:8]}"

    async def go() -> tuple[dict[str, str], dict[str, str]]:
        client = _DropsFirstCalls(host="127.0.0.1", port=6379, decode_responses=True)
        try:
            await AsyncDemoWorld(client, prefix).act("thumbnail.render@3", "m-1", "task-1")
            effects = await client.hgetall(demo_key(prefix, "effects"))  # type: ignore[misc]
            counts = await client.hgetall(demo_key(prefix, "counts"))  # type: ignore[misc]
            await client.delete(demo_key(prefix, "effects"), demo_key(prefix, "counts"))
            return effects, counts
        finally:
            await client.aclose()

    effects, counts = asyncio.run(go())
    assert effects == {"task-1": "thumbnail.render@3"} and counts == {"thumbnail.render@3": "1"}

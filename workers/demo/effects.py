"""The demo's own "outside world": an effect ledger and fault knobs, in Redis under ``<prefix>:demo:{demo}:``
(one hash tag, so the one script call per task names keys of one slot on a Redis Cluster).

* Every side effect is recorded once per idempotency key (``HSETNX``), so tests can count effects and
  prove a redelivered task did not act twice.
* Faults are set per model id (per run id for the audit finaliser):
  ``HSET <prefix>:demo:{demo}:faults:<modelId> fail:thumbnail.render 1 delay:semantic.analyse 200`` makes that
  contract fail, or sleep first, for that model only; ``fail-times:<contract> N`` fails its first N calls
  (then it succeeds: a transient failure for retries to get past).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import redis
import redis.asyncio as aioredis
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from orchestrator.store.connect import async_client

# One round trip per task: read the faults for (model, contract); unless told to fail, record the
# effect once per idempotency key. Returns {fail, delay_ms, first}.
ACT = """
local fail = redis.call('HGET', KEYS[1], 'fail:' .. ARGV[1])
if not fail and redis.call('HEXISTS', KEYS[1], 'fail-times:' .. ARGV[1]) == 1 then
  fail = redis.call('HINCRBY', KEYS[1], 'fail-times:' .. ARGV[1], -1) >= 0
end
local delay = redis.call('HGET', KEYS[1], 'delay:' .. ARGV[1])
if fail then return {1, tonumber(delay) or 0, 0} end
local first = redis.call('HSETNX', KEYS[2], ARGV[2], ARGV[1])
if first == 1 then redis.call('HINCRBY', KEYS[3], ARGV[1], 1) end
return {0, tonumber(delay) or 0, first}
"""


def demo_key(prefix: str, *parts: str) -> str:
    """``demo_key(p, "effects")``, ``demo_key(p, "counts")``, ``demo_key(p, "faults", model_id)``."""
    return ":".join([prefix, "demo", "{demo}", *parts])


@dataclass
class DemoWorld:
    client: redis.Redis
    prefix: str = "saga"

    def _key(self, *parts: str) -> str:
        return demo_key(self.prefix, *parts)

    def record_effect(self, contract: str, idempotency_key: str) -> bool:
        """Record the effect once; returns False when this key already acted (a duplicate delivery)."""
        first = bool(self.client.hsetnx(self._key("effects"), idempotency_key, contract))
        if first:
            self.client.hincrby(self._key("counts"), contract, 1)
        return first

    def effect_counts(self) -> dict[str, int]:
        raw = self.client.hgetall(self._key("counts"))
        return {str(k): int(v) for k, v in raw.items()}  # type: ignore[union-attr]

    def effects(self) -> dict[str, str]:
        raw = self.client.hgetall(self._key("effects"))
        return {str(k): str(v) for k, v in raw.items()}  # type: ignore[union-attr]

    def set_fault(
        self, model_id: str, contract: str, *, fail: bool = False, delay_ms: int = 0, fail_times: int = 0
    ) -> None:
        fields: dict[str, str] = {}
        if fail:
            fields[f"fail:{contract}"] = "1"
        if fail_times:
            fields[f"fail-times:{contract}"] = str(fail_times)
        if delay_ms:
            fields[f"delay:{contract}"] = str(delay_ms)
        if fields:
            self.client.hset(self._key("faults", model_id), mapping=fields)


@dataclass
class AsyncDemoWorld:
    """What the demo handlers use: one script call per task, no threads."""

    client: aioredis.Redis
    prefix: str = "saga"

    async def act(self, contract: str, model_id: str, idempotency_key: str) -> None:
        keys = [
            demo_key(self.prefix, "faults", model_id),
            demo_key(self.prefix, "effects"),
            demo_key(self.prefix, "counts"),
        ]
        # The ledger's connection may drop (a Redis Cluster slot moving closes it): the call is tried
        # again, as a handler should retry an idempotent effect, instead of failing the task. A retry
        # after a lost reply records nothing twice (HSETNX); it may use up one more of `fail-times`.
        async for attempt in AsyncRetrying(
            retry=retry_if_exception_type((redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)),
            stop=stop_after_attempt(5),
            wait=wait_exponential(multiplier=0.05, max=1.0),
            reraise=True,
        ):
            with attempt:
                fail, delay_ms, _ = await self.client.eval(ACT, 3, *keys, contract, idempotency_key)  # type: ignore[misc]
        if delay_ms:
            await asyncio.sleep(int(delay_ms) / 1000)
        if fail:
            raise RuntimeError(f"injected failure of {contract} for model {model_id}")


_world: AsyncDemoWorld | None = None


def configure(url: str, prefix: str) -> AsyncDemoWorld:
    global _world  # noqa: PLW0603 - one world per worker process, set at start-up
    _world = AsyncDemoWorld(async_client(url, decode_responses=True), prefix)
    return _world


def world() -> AsyncDemoWorld | None:
    return _world

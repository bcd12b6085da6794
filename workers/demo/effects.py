"""The demo's own "outside world": an effect ledger and fault knobs, in Redis under ``<prefix>:demo:``.

* Every side effect is recorded once per idempotency key (``HSETNX``), so tests can count effects and
  prove a redelivered task did not act twice.
* Faults are set per model id (per run id for the audit finaliser):
  ``HSET <prefix>:demo:faults:<modelId> fail:thumbnail.render 1 delay:semantic.analyse 200`` makes that
  contract fail, or sleep first, for that model only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis


@dataclass
class DemoWorld:
    client: redis.Redis
    prefix: str = "saga"

    def _key(self, *parts: str) -> str:
        return ":".join([self.prefix, "demo", *parts])

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

    def set_fault(self, model_id: str, contract: str, *, fail: bool = False, delay_ms: int = 0) -> None:
        fields: dict[str, str] = {}
        if fail:
            fields[f"fail:{contract}"] = "1"
        if delay_ms:
            fields[f"delay:{contract}"] = str(delay_ms)
        if fields:
            self.client.hset(self._key("faults", model_id), mapping=fields)

    def apply_faults(self, contract: str, model_id: str) -> None:
        faults: dict[str, str] = self.client.hgetall(self._key("faults", model_id))  # type: ignore[assignment]
        delay = faults.get(f"delay:{contract}")
        if delay:
            time.sleep(int(delay) / 1000)
        if faults.get(f"fail:{contract}"):
            raise RuntimeError(f"injected failure of {contract} for model {model_id}")


_world: DemoWorld | None = None


def configure(url: str, prefix: str) -> DemoWorld:
    global _world  # noqa: PLW0603 - one world per worker process, set at start-up
    _world = DemoWorld(redis.Redis.from_url(url, decode_responses=True), prefix)
    return _world


def world() -> DemoWorld | None:
    return _world

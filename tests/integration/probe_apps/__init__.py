"""Two small worker apps for the routing and serial-lane tests: each has its own contracts on the shared
``tasks.serial`` and ``tasks.parallel`` queues. Every handler records when it really ran (its own clock,
start and end, after any sleep a cancellation could not interrupt) in a Redis list, so a test can check
that no two serial handlers overlapped and that parallel ones did."""

from __future__ import annotations

import json
import os
import time

import redis
from pydantic import BaseModel


class Step(BaseModel):
    n: int
    hold_s: float = 0.03  # how long the handler runs; a thread cannot be stopped, so a cancelled one too


class Done(BaseModel):
    n: int
    pid: int


def record(kind: str, contract: str, payload: Step) -> Done:
    started = time.time()
    time.sleep(payload.hold_s)
    ended = time.time()
    client = redis.Redis.from_url(os.environ["SAGA_REDIS_URL"])
    entry = {"kind": kind, "contract": contract, "n": payload.n, "start": started, "end": ended}
    client.rpush(intervals_key(os.environ["SAGA_KEY_PREFIX"]), json.dumps({**entry, "pid": os.getpid()}))
    client.close()
    return Done(n=payload.n, pid=os.getpid())


def intervals_key(prefix: str) -> str:
    return f"{prefix}:probe:intervals"

"""A thumbnail.render-like contract at two versions, for the rolling-upgrade test: ``@3`` takes one
``size``, ``@4`` a ``width`` and a ``height`` and says its format. Every handler records which process ran
which contract version's task, and how (natively or through an adapter), in a Redis list."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from pydantic import BaseModel

from workers.runtime import TaskContext


class RenderInputV3(BaseModel):
    modelId: str  # noqa: N815 (the wire name)
    size: int
    hold_s: float = 0.02


class RenderOutputV3(BaseModel):
    uri: str
    size: int


class RenderInputV4(BaseModel):
    modelId: str  # noqa: N815 (the wire name)
    width: int
    height: int
    hold_s: float = 0.02


class RenderOutputV4(BaseModel):
    uri: str
    width: int
    height: int
    format: str


def renders_key(prefix: str) -> str:
    return f"{prefix}:probe:renders"


def record(handler: str, context: TaskContext, hold_s: float) -> None:
    """Hold for ``hold_s`` (a render taking time), then note who ran what."""
    time.sleep(hold_s)
    entry: dict[str, Any] = {
        "handler": handler,
        "contract": context.contract,
        "run_id": context.run_id,
        "stage": context.stage,
        "pid": os.getpid(),
    }
    client = redis.Redis.from_url(os.environ["SAGA_REDIS_URL"])
    client.rpush(renders_key(os.environ["SAGA_KEY_PREFIX"]), json.dumps(entry))
    client.close()

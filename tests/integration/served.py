"""``saga server`` as a process beside a running stack (an orchestrator and a worker), with a token of
each role asked for: what the API, remote CLI, fuzzing and browser tests all start from."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx

from orchestrator.auth.roles import Role
from orchestrator.auth.tokens import TokenStore
from orchestrator.settings import redis_client
from tests.integration.own_redis import free_port
from tests.integration.stack import Stack, poll, running


@dataclass
class Served:
    """The stack, the server's base URL and a token (its secret) per role."""

    stack: Stack
    base: str
    tokens: dict[Role, str] = field(default_factory=dict)

    def headers(self, role: Role) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[role]}"}

    def call(self, method: str, path: str, role: Role | None, **kwargs: Any) -> httpx.Response:
        """``method path`` as ``role``'s token (None: no token at all)."""
        headers = self.headers(role) if role else {}
        return httpx.request(method, self.base + path, headers=headers, timeout=30, **kwargs)


@contextmanager
def serving(
    name: str, roles: Iterable[Role] = tuple(Role), token_name: str = "{role}-token"
) -> Iterator[Served]:
    """A running stack named ``name`` with ``saga server`` on a free port, ready, and a token per role
    (named by ``token_name``); all torn down after."""
    with running(name) as stack:
        served = Served(stack, serve(stack))
        asyncio.run(_create_tokens(served, roles, token_name))
        yield served


def serve(stack: Stack) -> str:
    """Start ``saga server`` beside ``stack`` on a free port; its base URL, once it is ready."""
    port = free_port()
    stack._spawn("server", ["server", "--port", str(port)], None)
    base = f"http://127.0.0.1:{port}"
    poll(lambda: answers(base + "/readyz"), 30, what="the server ready")
    return base


async def _create_tokens(served: Served, roles: Iterable[Role], token_name: str) -> None:
    client = redis_client(served.stack.settings)
    try:
        store = TokenStore(client, served.stack.prefix)
        for role in roles:
            served.tokens[role], _ = await store.create(
                token_name.format(role=role.value), role, actor="tests"
            )
    finally:
        await client.aclose()


def answers(url: str) -> bool:
    """``url`` answers 200 now."""
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False

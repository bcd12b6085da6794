"""``/api/v1/dead-letters``, ``/api/v1/shards`` and ``/api/v1/tokens``: the operators' and admins' verbs of
``saga dead-letters``, ``saga shards`` and ``saga tokens``."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Annotated, Any, TypeVar

import aio_pika
from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, Field

from orchestrator import deadletters, shard_ops
from orchestrator.auth.roles import Action, Identity
from orchestrator.auth.tokens import TokenNotFound
from orchestrator.bus.connect import connect_once
from orchestrator.bus.topology import topology_for
from orchestrator.server.auth import Reader, require, tenant_scope
from orchestrator.server.errors import ApiError
from orchestrator.store import shardmap_store

router = APIRouter(prefix="/api/v1", tags=["operations"])
DeadLetterHandler = Annotated[Identity, Depends(require(Action.HANDLE_DEAD_LETTERS))]
ShardChanger = Annotated[Identity, Depends(require(Action.CHANGE_SHARDS))]
TokenAdmin = Annotated[Identity, Depends(require(Action.MANAGE_TOKENS))]
T = TypeVar("T")
_log = logging.getLogger(__name__)


@asynccontextmanager
async def _broker(request: Request) -> AsyncIterator[aio_pika.abc.AbstractConnection]:
    connection = await connect_once(request.app.state.settings.amqp_url)
    try:
        yield connection
    finally:
        await connection.close()


async def _queues(request: Request, queue: str | None) -> list[str]:
    """The queue asked for (a dead-letter queue), or every dead-letter queue of the topology."""
    settings = request.app.state.settings
    if queue is not None:
        return [deadletters.require_dead_letter_queue(queue, settings.names())]
    shard_map = await shardmap_store.current_map(settings, seed=False)
    topology = topology_for(settings, request.app.state.registry, shard_map)
    return deadletters.dead_letter_queues(topology, settings.names())


async def _on_queues(
    request: Request,
    queue: str | None,
    call: Callable[[aio_pika.abc.AbstractConnection, list[str]], Awaitable[T]],
) -> T:
    queues = await _queues(request, queue)
    async with _broker(request) as connection:
        return await call(connection, queues)


@router.get("/dead-letters", tags=["dead letters"])
async def list_dead_letters(
    request: Request,
    who: Reader,
    queue: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
) -> dict[str, Any]:
    """Per dead-letter queue: whether it exists, its count and its first ``limit`` messages (for a token of
    a tenant other than the platform's: only its tenant's messages, and their count)."""
    listings = await _on_queues(
        request, queue, lambda c, qs: deadletters.list_queues(c, qs, limit, missing_ok=queue is None)
    )
    scope = tenant_scope(request, who)
    queues = []
    for q in listings:
        letters = [m for m in q.letters if scope is None or m.tenant == scope]
        count = q.count if scope is None else len(letters)
        queues.append(
            {"queue": q.queue, "exists": q.exists, "count": count, "messages": [m.summary() for m in letters]}
        )
    return {"queues": queues}


@router.get("/dead-letters/{message_id}", tags=["dead letters"])
async def show_dead_letter(
    message_id: str, request: Request, who: Reader, queue: str | None = None
) -> list[dict[str, Any]]:
    """Every copy of a dead letter: properties, headers and decoded body (404 if none, or none of the
    caller's tenant)."""
    return [detail.document() for detail in await _visible_letter(request, who, message_id, queue)]


async def _visible_letter(
    request: Request, who: Identity, message_id: str, queue: str | None
) -> list[deadletters.Detail]:
    """Every copy of a dead letter the caller's tenant may see; raises MessageNotFound (404) if none."""
    found = await _on_queues(
        request, queue, lambda c, qs: deadletters.show(c, qs, message_id, missing_ok=queue is None)
    )
    scope = tenant_scope(request, who)
    visible = [d for d in found if scope is None or d.letter.tenant == scope]
    if not visible:
        raise deadletters.MessageNotFound(message_id, await _queues(request, queue))
    return await deadletters.redacted(visible, request.app.state.settings)


class Replay(BaseModel):
    message_id: str | None = Field(None, description="one dead letter (every copy of it); null: all")
    queue: str | None = None


@router.post("/dead-letters/replay", tags=["dead letters"])
async def replay(body: Replay, request: Request, who: DeadLetterHandler) -> dict[str, Any]:
    """Publish dead letters back to the queue they came from (each removed once the copy is confirmed).
    A token of a tenant other than the platform's replays only its tenant's letters, one by id."""
    if tenant_scope(request, who) is not None:
        if body.message_id is None:
            raise _platform_only(who, "replaying every dead letter")
        await _visible_letter(request, who, body.message_id, body.queue)
    done = await _on_queues(
        request,
        body.queue,
        lambda c, qs: deadletters.replay(
            c,
            qs,
            body.message_id,
            deadletters.replay_reissue(request.app.state.settings, body.message_id),
            missing_ok=body.queue is None,
        ),
    )
    return {
        "replayed": [
            {
                "message_id": d.letter.message_id,
                "queue": d.letter.queue,
                "target": d.target,
                "error": d.error,
                "reissued": d.reissued,
            }
            for d in done
        ]
    }


class Purge(BaseModel):
    queue: str | None = Field(None, description="one dead-letter queue (or null, with all)")
    all: bool = Field(False, description="with no queue: purge every dead-letter queue of the topology")


def _platform_only(who: Identity, what: str) -> ApiError:
    return _forbidden(
        who,
        f"{what} acts on every tenant's letters: token {who.name} is of tenant {who.tenant}, and only "
        "tokens of the platform's tenant (SAGA_PLATFORM_TENANT) may; replay your tenant's letters by id",
    )


def _forbidden(who: Identity, message: str) -> ApiError:
    """403 for what only a token of the platform's tenant may do, naming the caller's token and tenant."""
    return ApiError(403, "forbidden", message, {"token": who.name, "tenant": who.tenant})


@router.post("/dead-letters/purge", tags=["dead letters"])
async def purge(body: Purge, request: Request, who: DeadLetterHandler) -> dict[str, Any]:
    """Delete every message on ``queue`` (or, with ``all``, on every dead-letter queue) for good; how
    many each held. Only a token of the platform's tenant may: a queue holds every tenant's letters."""
    if tenant_scope(request, who) is not None:
        raise _platform_only(who, "purging dead letters")
    if body.queue is None and not body.all:
        raise ApiError(
            422,
            "invalid_request",
            "purge deletes dead letters for good: name the dead-letter queue in 'queue', or set 'all': "
            "true to purge every one (GET /api/v1/dead-letters shows what would go)",
        )

    def purged(done: deadletters.Purged) -> None:
        # nothing else keeps a trace of what went: the log names who purged what, queue by queue
        if done.removed:
            _log.warning("dead letters purged by %s: %d from %s", who.name, done.removed, done.queue)

    done = await _on_queues(
        request,
        body.queue,
        lambda c, qs: deadletters.purge(c, qs, missing_ok=body.queue is None, on_purged=purged),
    )
    return {"queues": [{"queue": p.queue, "exists": p.exists, "purged": p.removed} for p in done]}


@router.get("/shards", tags=["shards"])
async def list_shards(request: Request, _: Reader) -> dict[str, Any]:
    """Every shard: state, queue depth and consumers, unfinished runs, outbox, timers, dead letters, and
    the orchestrator process whose share it is."""
    shard_map, loads = await shard_ops.shard_loads(request.app.state.settings)
    return {"version": shard_map.version, "shards": [load.document() for load in loads]}


class AddShards(BaseModel):
    shard_class: str = Field(alias="class")
    count: int = Field(ge=1, le=256)


@router.post("/shards", tags=["shards"], status_code=201)
async def add_shards(body: AddShards, request: Request, _: ShardChanger) -> dict[str, Any]:
    """Add shards to a class (their queues declared, then they take new starts)."""
    return {"added": await shard_ops.add(request.app.state.settings, body.shard_class, body.count)}


@router.post("/shards/{shard}/drain", tags=["shards"])
async def drain_shard(shard: str, request: Request, _: ShardChanger) -> dict[str, Any]:
    """Stop new starts on a shard; its runs finish there."""
    await shard_ops.drain(request.app.state.settings, shard)
    return {"shard": shard, "state": "draining"}


@router.post("/shards/{shard}/retire", tags=["shards"])
async def retire_shard(shard: str, request: Request, _: ShardChanger) -> dict[str, Any]:
    """Retire a drained shard that holds no work (409 otherwise)."""
    await shard_ops.retire(request.app.state.settings, shard)
    return {"shard": shard, "state": "retired"}


class NewToken(BaseModel):
    name: str
    role: str
    tenant: str | None = Field(
        None, description="default: the caller's own tenant ('default' for a token of the platform's)"
    )


@router.post("/tokens", tags=["tokens"], status_code=201)
async def create_token(body: NewToken, request: Request, who: TokenAdmin) -> dict[str, Any]:
    """A new token: its secret is in this answer only (only its hash is kept). An admin of a tenant
    other than the platform's creates tokens of its own tenant only."""
    scope = tenant_scope(request, who)
    tenant = body.tenant or scope or "default"  # as the CLI's: the platform's callers name another tenant
    if scope is not None and tenant != scope:
        raise _forbidden(
            who,
            f"token {who.name} is of tenant {who.tenant}: it may create tokens of that tenant only; a token "
            "of the platform's tenant (SAGA_PLATFORM_TENANT) creates other tenants' tokens",
        )
    secret, record = await request.app.state.tokens.create(body.name, body.role, tenant, actor=who.name)
    return {"token": secret, **record.to_json()}


@router.get("/tokens", tags=["tokens"])
async def list_tokens(request: Request, who: TokenAdmin) -> list[dict[str, Any]]:
    """Every token of the caller's tenant (of every tenant, for the platform's), never its secret."""
    scope = tenant_scope(request, who)
    records = await request.app.state.tokens.list()
    return [r.to_json() for r in records if scope is None or r.tenant == scope]


@router.post("/tokens/{name_or_id}/revoke", tags=["tokens"])
async def revoke_token(name_or_id: str, request: Request, who: TokenAdmin) -> dict[str, Any]:
    """Revoke a token of the caller's tenant (any, for the platform's): it is refused from the next
    request on."""
    scope = tenant_scope(request, who)
    found = await request.app.state.tokens.get(name_or_id)  # resolved once: a name freed meanwhile and
    if scope is not None and found.tenant != scope:  # taken by another tenant's token is not revoked
        raise TokenNotFound(name_or_id)  # another tenant's: not this caller's to know of
    record, changed = await request.app.state.tokens.revoke(found.token_id, actor=who.name)
    return {**record.to_json(), "changed": changed}

"""The lifecycle verbs as the CLI (and later the API) call them: settings in, changes stored and audited."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from orchestrator.compiler import CompiledPlan
from orchestrator.governance import lifecycle
from orchestrator.governance.lifecycle import Actor, Change, DefinitionState, LifecycleRefused
from orchestrator.governance.store import DefinitionStore, Verb
from orchestrator.settings import Settings, redis_client
from orchestrator.store import shardmap_store
from orchestrator.store.live_runs import unfinished_by_digest

VERBS = ("approve", "activate", "canary", "promote", "abort", "rollback", "retire")


@dataclass(frozen=True)
class Request:
    """One lifecycle command: who, why, and the verb's own arguments."""

    actor: str
    reason: str = ""
    version: str | None = None
    percent: int = 0
    separate_approver: bool = False


def _verb(name: str, request: Request) -> Verb:
    version = request.version or ""
    if name == "approve":
        return lambda s, a, _: lifecycle.approve(s, version, a, separate_approver=request.separate_approver)
    if name == "activate":
        return lambda s, a, _: lifecycle.activate(s, version, a)
    if name == "canary":
        return lambda s, a, _: lifecycle.start_canary(s, version, request.percent, a)
    if name == "promote":
        return lambda s, a, _: lifecycle.promote(s, a)
    if name == "abort":
        return lambda s, a, _: lifecycle.abort(s, a)
    if name == "rollback":
        return lambda s, a, activations: lifecycle.rollback(s, activations, a)
    if name == "retire":
        return lambda s, a, _: lifecycle.retire(s, version, a)
    raise ValueError(f"unknown lifecycle verb {name!r}")


async def change(settings: Settings, verb: str, definition: str, request: Request) -> Change:
    """Apply one lifecycle verb to ``definition``; raises LifecycleRefused with the reason."""
    async with _store(settings) as store:
        await store.require(definition)
        return await store.change(definition, _verb(verb, request), request.actor, request.reason)


def refuse_publish_activate(settings: Settings, plans: Sequence[CompiledPlan]) -> None:
    if settings.separate_approver_required and plans:
        plan = plans[0]
        raise LifecycleRefused(
            plan.name,
            plan.version,
            "separate_approver_required",
            "'publish --activate' approves what its publisher published, which is refused while separate "
            "approval is on (SAGA_REQUIRE_SEPARATE_APPROVER, on in production mode): publish, have someone "
            "else approve, then activate",
        )


async def publish(
    settings: Settings,
    plans: Sequence[CompiledPlan],
    actor: str,
    reason: str = "",
    *,
    activate: bool = False,
) -> list[Change]:
    """Store each plan as a new ``published`` version (the same digest again: no change). With
    ``activate`` (only where separate approval is off), approve and activate it in the same change.
    Every plan is checked before any is stored, so a refused one stores none."""
    if activate:
        refuse_publish_activate(settings, plans)
    async with _store(settings) as store:
        # the check, before anything is stored: each plan against the state the ones before it leave (two
        # files under one name and version but different digests are refused here too)
        probe = Actor(actor, 0, reason)
        states: dict[str, DefinitionState] = {}
        for plan in plans:
            state = states.get(plan.name) or await store.load(plan.name)
            states[plan.name] = publish_verb(plan, activate)(state, probe, []).after
        return [
            await store.change(plan.name, publish_verb(plan, activate), actor, reason, plan) for plan in plans
        ]


def publish_verb(plan: CompiledPlan, activate: bool) -> Verb:
    """Publish ``plan`` as a new version (with ``activate``: approved and activated in the same change)."""

    def verb(state: DefinitionState, actor: Actor, _: list[str]) -> Change:
        steps: list[Callable[[DefinitionState], Change]] = [
            lambda s: lifecycle.publish(s, plan.version, plan.digest, actor)
        ]
        if activate:
            steps += [
                lambda s: lifecycle.approve(s, plan.version, actor, separate_approver=False),
                lambda s: lifecycle.activate(s, plan.version, actor),
            ]
        return lifecycle.chain(*steps)(state)

    return verb


def version_row(state: DefinitionState, version: str, unfinished: Mapping[str, int]) -> dict[str, Any]:
    """One version as ``list``, ``show`` and the API give it: its record, its canary share, its runs."""
    record = state.versions[version]
    return {
        "definition": state.name,
        **record.to_json(),
        "canary_percent": state.canary_percent if state.canary == version else None,
        "unfinished_runs": unfinished.get(record.digest, 0),
    }


def change_document(name: str, change: Change) -> dict[str, Any]:
    """What a lifecycle verb did, as ``--json`` and the API give it."""
    after = change.after
    return {
        "definition": name,
        "changed": not change.noop,
        "active": after.active,
        "canary": after.canary,
        "canary_percent": after.canary_percent if after.canary else None,
        "records": [r.to_fields() for r in change.records],
    }


async def states(settings: Settings, name: str | None = None) -> list[DefinitionState]:
    async with _store(settings) as store:
        if name is not None:
            return [await store.require(name)]
        return [await store.load(n) for n in await store.names()]


async def audit(settings: Settings, name: str) -> list[dict[str, Any]]:
    async with _store(settings) as store:
        await store.require(name)
        return await store.audit(name)


async def unfinished(settings: Settings) -> dict[str, int]:
    """Plan digest -> runs not yet finished, over every shard of the map."""
    shard_map = await shardmap_store.current_map(settings, seed=False)
    client = redis_client(settings)
    try:
        return await unfinished_by_digest(client, settings.key_prefix, shard_map.known)
    finally:
        await client.aclose()


async def plan_of(settings: Settings, digest: str) -> dict[str, Any]:
    from orchestrator.store.redis_store import RedisStore

    async with _store(settings) as store:
        return await RedisStore(store.client, settings.key_prefix).plan(digest)


@contextlib.asynccontextmanager
async def _store(settings: Settings) -> AsyncIterator[DefinitionStore]:
    client = redis_client(settings)
    try:
        yield DefinitionStore(client, settings.key_prefix)
    finally:
        await client.aclose()

"""``/api/v1/definitions``: the governance verbs of ``saga definitions``, acting as the token's identity."""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from orchestrator.auth.roles import Action
from orchestrator.compiler import compile_text
from orchestrator.governance import service
from orchestrator.governance.diff import diff_plans
from orchestrator.governance.lifecycle import DefinitionState, VersionRecord
from orchestrator.server.auth import Author, Reader, require
from orchestrator.server.errors import ApiError

router = APIRouter(prefix="/api/v1/definitions", tags=["definitions"])


def published(state: DefinitionState, version: str) -> VersionRecord:
    """``version`` of the definition: 404 naming the published ones when there is no such version (a
    read asks for something that is not there; a lifecycle verb's refusal is a 409)."""
    found = state.versions.get(version)
    if found is None:
        known = ", ".join(state.versions) or "none"
        raise ApiError(
            404,
            "version_not_found",
            f"{state.name} has no version {version!r} (published versions: {known})",
            {"definition": state.name, "version": version},
        )
    return found


class Publish(BaseModel):
    source: str = Field(description="the definition's YAML text")
    file: str = Field("definition.yaml", description="a name for the source, in problem locations")
    activate: bool = Field(False, description="also approve and activate it (where separate approval is off)")
    reason: str = ""


class LifecycleRequest(BaseModel):
    version: str | None = Field(None, description="the version (approve, activate, canary, retire)")
    percent: int = Field(0, ge=0, le=99, description="canary: the share of new runs")
    reason: str = ""


@router.get("")
async def list_definitions(request: Request, _: Reader) -> list[dict[str, Any]]:
    """Every version of every definition: state, digest, who did what and when, unfinished runs."""
    settings = request.app.state.settings
    states = await service.states(settings)
    unfinished = await service.unfinished(settings)
    return [service.version_row(s, v, unfinished) for s in states for v in s.versions]


@router.post("", status_code=201)
async def publish(request: Request, body: Publish, who: Author) -> dict[str, Any]:
    """Publish a version (the same source again: no change; another under a stored version: 409)."""
    settings, app = request.app.state.settings, request.app.state
    if body.activate:  # approving and activating it too is an approver's
        await require(Action.APPROVE)(request)
        await require(Action.ACTIVATE)(request)
    # compiling a large definition takes seconds of CPU: off the event loop, so other requests go on
    plan = await asyncio.to_thread(
        compile_text,
        body.source.encode(),
        body.file,
        app.registry,
        settings.admission_limits(),
        app.allowlist,
    )
    (change,) = await service.publish(settings, [plan], who.name, body.reason, activate=body.activate)
    state = change.after.versions[plan.version].state.value
    return {
        **service.change_document(plan.name, change),
        "version": plan.version,
        "digest": plan.digest,
        "state": state,
    }


@router.get("/{name}")
async def show(name: str, request: Request, _: Reader) -> dict[str, Any]:
    """A definition's versions, routing (active, canary) and audit history."""
    settings = request.app.state.settings
    (state,) = await service.states(settings, name)
    unfinished = await service.unfinished(settings)
    return {
        "definition": name,
        "active": state.active,
        "canary": state.canary,
        "canary_percent": state.canary_percent if state.canary else None,
        "versions": [service.version_row(state, v, unfinished) for v in state.versions],
        "audit": await service.audit(settings, name),
    }


@router.get("/{name}/diff")
async def diff(name: str, v1: str, v2: str, request: Request, _: Reader) -> dict[str, Any]:
    """What changed in the plan from version ``v1`` to ``v2``, by stage."""
    settings = request.app.state.settings
    (state,) = await service.states(settings, name)
    old = await service.plan_of(settings, published(state, v1).digest)
    new = await service.plan_of(settings, published(state, v2).digest)
    return {"definition": name, "from": v1, "to": v2, **diff_plans(old, new).to_json()}


Verb = Literal["approve", "activate", "canary", "promote", "abort", "rollback", "retire"]


@router.post("/{name}/{verb}")
async def lifecycle(name: str, verb: Verb, body: LifecycleRequest, request: Request) -> dict[str, Any]:
    """One lifecycle verb, as ``saga definitions VERB``; a refusal is 409 with the reason."""
    who = await require(Action(verb))(request)
    settings = request.app.state.settings
    change_request = service.Request(
        actor=who.name,
        reason=body.reason,
        version=body.version,
        percent=body.percent,
        separate_approver=settings.separate_approver_required,
    )
    return service.change_document(name, await service.change(settings, verb, name, change_request))

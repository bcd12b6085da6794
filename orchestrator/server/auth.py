"""Who is asking, and may they: a bearer token verified against the token store on every request (so a
revoked token stops working at once), and the role its action needs (403 naming it)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated

from fastapi import Depends, Request

from orchestrator.auth.roles import Action, Identity, allows, needed_roles, refusal
from orchestrator.auth.tokens import TokenStore
from orchestrator.server.errors import ApiError


async def identity_of(request: Request) -> Identity:
    header = request.headers.get("authorization", "")
    scheme, _, secret = header.partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        raise ApiError(
            401,
            "unauthenticated",
            "this needs a bearer token (Authorization: Bearer TOKEN); an admin creates one with "
            "'saga tokens create --name NAME --role ROLE'",
        )
    tokens: TokenStore = request.app.state.tokens
    found: Identity | None = await tokens.verify(secret.strip())
    if found is None:
        raise ApiError(
            401, "unauthenticated", "the token is unknown or revoked: ask an admin for a valid one"
        )
    return found


def require(action: Action) -> Callable[[Request], Awaitable[Identity]]:
    """A dependency: the caller's identity, if its role may do ``action`` (else 401 or 403)."""

    async def check(request: Request) -> Identity:
        who = await identity_of(request)
        if not allows(who.role, action):
            needed = [r.value for r in needed_roles(action)]
            raise ApiError(
                403,
                "forbidden",
                refusal(who, action),
                {"action": action.value, "role": who.role.value, "token": who.name, "needed": needed},
            )
        return who

    return check


# The identities the routes take, by what they do (FastAPI dependencies).
Reader = Annotated[Identity, Depends(require(Action.READ))]
Author = Annotated[Identity, Depends(require(Action.PUBLISH))]
Starter = Annotated[Identity, Depends(require(Action.START))]
Canceller = Annotated[Identity, Depends(require(Action.CANCEL))]
Redriver = Annotated[Identity, Depends(require(Action.REDRIVE))]

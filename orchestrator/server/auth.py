"""Who is asking, and may they: a bearer token (or the web console's session cookie, which holds one)
verified against the token store on every request (so a revoked token stops working at once), and the role
its action needs (403 naming it)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated

from fastapi import Depends, Request

from orchestrator.auth.roles import Action, Identity, allows, needed_roles, refusal
from orchestrator.auth.tokens import TokenStore
from orchestrator.server.errors import ApiError

#: The web console's session: the token's secret itself, in an HttpOnly (page scripts never see it),
#: SameSite=Strict cookie. Holding the secret, not a session id, keeps one source of truth: a revoked
#: token ends every console session with it from the next request on, as it does for API clients.
SESSION_COOKIE = "saga_session"
#: The header every cookie-authenticated request that changes something must carry (see identity_of).
CONSOLE_HEADER = "X-Saga-Console"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


async def identity_of(request: Request) -> Identity:
    """The identity of the bearer token, else of the console's session cookie; 401 without either."""
    header = request.headers.get("authorization")
    if header is None and SESSION_COOKIE in request.cookies:
        secret = request.cookies[SESSION_COOKIE]
        require_console_header(request)
    else:
        scheme, _, secret = (header or "").partition(" ")
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


def require_console_header(request: Request) -> None:
    """Refuse (403) a request that changes something unless it carries ``X-Saga-Console: 1``.

    A cookie rides along on every request the browser sends here, whoever's page made it: a form on
    another site posting to /api/v1/runs/ID/cancel would act as the signed-in user (cross-site request
    forgery). SameSite=Strict stops most of that, but not all: "site" means the registrable domain, so a
    page on a sibling host (another team's app under the same domain) still gets the cookie sent. A custom
    header closes the gap: a page can only add one to a request to another origin after a CORS preflight,
    which this server never grants, and plain forms cannot add headers at all. Only the console's own
    scripts, served from this origin, send it. Bearer clients are not affected: a page cannot make a
    browser attach an Authorization header it does not know."""
    if request.method in SAFE_METHODS or request.headers.get(CONSOLE_HEADER) == "1":
        return
    raise ApiError(
        403,
        "console_header_missing",
        f"a request signed in by the console's cookie that changes something must carry the header "
        f"'{CONSOLE_HEADER}: 1' (a defence against cross-site request forgery); API clients send "
        "'Authorization: Bearer TOKEN' instead",
        {"header": CONSOLE_HEADER},
    )


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


def tenant_scope(request: Request, who: Identity) -> str | None:
    """The tenant whose runs and dead letters ``who`` sees and acts on: its token's, or every tenant's
    (None) for a token of the platform's own tenant (``SAGA_PLATFORM_TENANT``)."""
    settings = request.app.state.settings
    return None if who.tenant == settings.platform_tenant else who.tenant

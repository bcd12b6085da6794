"""The server's application: one Redis client, one broker client (for starts and requests), the
registry definitions are compiled against, the token store; health, readiness, the API routers and the
web console."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from orchestrator import health
from orchestrator.allowlists import load_allowlist
from orchestrator.auth.tokens import TokenStore
from orchestrator.client import Client
from orchestrator.contracts import Registry
from orchestrator.server import bodies, console, console_api, definitions, operations, runs
from orchestrator.server.errors import ERROR_RESPONSES, HANDLERS, declare_errors
from orchestrator.settings import Settings, redis_client

API_VERSION = "v1"


class ControlPlane(FastAPI):
    """FastAPI, whose OpenAPI document lists every error status an operation can answer, each with the
    error document's schema, and no other (see errors.declare_errors)."""

    def openapi(self) -> dict[str, Any]:
        if self.openapi_schema is None:
            self.openapi_schema = declare_errors(super().openapi())
        return self.openapi_schema


class Readiness(BaseModel):
    status: Literal["ready", "not ready"]
    problems: list[str]


def create_app(settings: Settings, registry: Registry | None = None) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state = app.state
        state.settings = settings
        state.registry = registry or Registry.from_modules(settings.contracts)
        state.allowlist = load_allowlist(settings.allowlist_file)
        state.redis = redis_client(settings)
        state.tokens = TokenStore(state.redis, settings.key_prefix)
        async with Client(settings) as client:
            state.client = client
            try:
                yield
            finally:
                await state.redis.aclose()

    app = ControlPlane(
        title="saga-orchestrator control plane",
        version=API_VERSION,
        openapi_url=f"/api/{API_VERSION}/openapi.json",
        docs_url=None,
        redoc_url=None,
        lifespan=lifespan,
    )
    for error, handler in HANDLERS:
        app.add_exception_handler(error, handler)  # type: ignore[arg-type]
    # every API operation needs a token (401, 403), reads Redis (503)...: declared once, for all of them
    app.include_router(definitions.router, responses=ERROR_RESPONSES)
    app.include_router(console_api.router, responses=ERROR_RESPONSES)  # before runs: /runs/events
    app.include_router(runs.router, responses=ERROR_RESPONSES)
    app.include_router(operations.router, responses=ERROR_RESPONSES)
    console.install(app)  # the web console: its pages, session and static files
    bodies.install(app)  # bodies no store or signature could take: 400 at the door

    @app.get("/healthz", tags=["health"])
    async def healthz() -> dict[str, str]:
        """The process is alive."""
        return {"status": "ok"}

    @app.get(
        "/readyz",
        tags=["health"],
        response_model=None,
        responses={
            200: {"model": Readiness, "description": "Redis and RabbitMQ answer"},
            503: {"model": Readiness, "description": "Redis or RabbitMQ does not answer: problems say which"},
        },
    )
    async def readyz(request: Request) -> Any:
        """Redis and RabbitMQ answer: 200, else 503 naming what does not."""
        problems = await _readiness(request)
        body = {"status": "ready" if not problems else "not ready", "problems": problems}
        return JSONResponse(body, status_code=503 if problems else 200)

    return app


async def _readiness(request: Request) -> list[str]:
    state = request.app.state
    problems = []
    try:
        await state.redis.ping()
    except Exception as exc:  # any failure means not ready; the message says which
        problems.append(f"Redis: {exc}")
    connection = getattr(state.client, "_connection", None)
    if connection is None or not health.broker_connected(connection):  # reconnecting counts as not
        problems.append("RabbitMQ: not connected")
    return problems

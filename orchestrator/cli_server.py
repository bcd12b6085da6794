"""``saga server``: the control plane's HTTP API on uvicorn."""

from __future__ import annotations

import click

from orchestrator import loops
from orchestrator.cli_runtime import _event_loop, _settings

SHUTDOWN_GRACE_S = 5


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8080, show_default=True, type=click.IntRange(1, 65535), help="Port.")
@click.option("-v", "--verbose", is_flag=True, help="Log every request.")
def server(host: str, port: int, verbose: bool) -> None:
    """Serve the HTTP API (/api/v1, its OpenAPI document at /api/v1/openapi.json), /healthz and /readyz.
    Every request needs a bearer token ('saga tokens create'); what it may do follows the token's role."""
    import uvicorn

    from orchestrator.server.app import create_app

    settings = _settings()
    loop = loops.uvicorn_loop(_event_loop(settings))
    uvicorn.run(
        create_app(settings),
        host=host,
        port=port,
        log_level="info" if verbose else "warning",
        access_log=verbose,
        loop=loop,
        # the console's event streams never end by themselves: on SIGTERM, give requests this long to
        # finish, then close what is left (a browser's EventSource reconnects to the next server)
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
    )

"""The CLI through the control-plane API: ``saga --server URL`` (or ``SAGA_SERVER_URL``) sends every command
that has an API twin to ``URL/api/v1``, with the bearer token of ``SAGA_TOKEN``, instead of going to
RabbitMQ and Redis.

:class:`Remote` has the run verbs of :class:`~orchestrator.client.Client` with the same signatures
(``start``, ``cancel``, ``redrive``, ``answer``, ``wait``), so a run command runs the same code on either;
the other commands call :meth:`Remote.request`, whose JSON is the command's own ``--json`` document (or
what it is built from). Commands call :func:`remote_client` first: None means the direct path.

The API's error document becomes the CLI's, with the same ``code``, ``message`` and ``ids``, and the CLI's
exit codes: 1 for a refusal or something that is not there (404, 409, 422 and the like), 2 for a token
that is missing, unknown or revoked (401) or whose role may not (403), an invalid request, and a server
that cannot be reached or fails (5xx). ``run_not_found`` and ``redrive_refused`` come back as the errors
the direct path raises, so waiting and re-driving behave alike on both.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping
from typing import Any, Self
from urllib.parse import quote

import click
import httpx

from orchestrator.cli_errors import CONFIGURATION_ERRORS, EXIT_REFUSED, EXIT_USAGE, CliError
from orchestrator.client import (
    NoAnswer,
    RedriveRefused,
    RequestAnswer,
    RunNotFound,
    RunResult,
    WaitTimeout,
    answer_of,
    is_final,
)
from orchestrator.observe import RunFilter

API_PREFIX = "/api/v1"
#: Where the ``saga`` group keeps its ``--server`` option (None: not given; "": given empty, go direct).
SERVER_META = "saga.cli.server"
TIMEOUT_S = 30.0
CONNECT_TIMEOUT_S = 5.0
#: The API's largest page of runs (``/api/v1/runs?limit=``); longer listings take several.
API_PAGE = 500
#: Error codes that say the request itself was wrong or the server is misconfigured: exit 2, as usage.
USAGE_CODES = frozenset(
    {"usage", "invalid_request", "invalid_setting", "not_a_dead_letter_queue"}
    | {error.code for error in CONFIGURATION_ERRORS}
)
_CHECK = "check SAGA_SERVER_URL (or --server)"


def exit_code_of(status: int, code: str) -> int:
    """The CLI's exit code for an API error: 2 for authentication, authorisation, an invalid request and
    a failing server; 1 for refusals and what is not found."""
    if status in (401, 403) or status >= 500 or code in USAGE_CODES:
        return EXIT_USAGE
    return EXIT_REFUSED


def _segment(value: str) -> str:
    return quote(value, safe="")


class Remote:
    """The control-plane API at ``url`` as the CLI uses it, presenting ``token``. Usable with ``async
    with`` (one connection pool for several requests) or without (a pool per request)."""

    def __init__(self, url: str, token: str) -> None:
        self.url = url
        self._token = token
        self._http: httpx.AsyncClient | None = None

    async def __aenter__(self) -> Self:
        self._http = self._new_http()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    def _new_http(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=self.url + API_PREFIX,
            headers={"Authorization": f"Bearer {self._token}", "Accept": "application/json"},
            timeout=httpx.Timeout(TIMEOUT_S, connect=CONNECT_TIMEOUT_S),
        )

    async def request(
        self, method: str, path: str, *, params: Mapping[str, Any] | None = None, body: Any = None
    ) -> Any:
        """The API's JSON answer to ``METHOD /api/v1PATH``; raises the CLI's error for an error answer
        and for a server that cannot be reached."""
        if self._http is not None:
            return await self._send(self._http, method, path, params, body)
        async with self._new_http() as http:
            return await self._send(http, method, path, params, body)

    async def _send(
        self,
        http: httpx.AsyncClient,
        method: str,
        path: str,
        params: Mapping[str, Any] | None,
        body: Any,
    ) -> Any:
        query = {k: v for k, v in (params or {}).items() if v is not None}
        try:
            response = await http.request(method, path, params=query, json=body)
        except httpx.TimeoutException as exc:
            raise CliError(
                "server_unreachable",
                f"the saga server at {self.url} did not answer within {TIMEOUT_S:g} s; {_CHECK}",
                exit_code=EXIT_USAGE,
            ) from exc
        except httpx.HTTPError as exc:
            raise CliError(
                "server_unreachable",
                f"cannot reach the saga server at {self.url}: {exc or type(exc).__name__}; {_CHECK}",
                exit_code=EXIT_USAGE,
            ) from exc
        if response.is_error:
            raise self._error(response)
        try:
            return response.json()
        except ValueError as exc:
            raise self._not_the_api(response) from exc

    def _error(self, response: httpx.Response) -> Exception:
        try:
            error = response.json()["error"]
            code, message = str(error["code"]), str(error["message"])
            ids = dict(error.get("ids") or {})
        except (ValueError, KeyError, TypeError):
            return self._not_the_api(response)
        if code == RunNotFound.code and "run_id" in ids:
            return RunNotFound(str(ids["run_id"]))
        if code == RedriveRefused.code and {"run_id", "state"} <= ids.keys():
            return RedriveRefused(str(ids["run_id"]), str(ids["state"]))
        status = response.status_code
        if status == 401:
            message += f" (the token is SAGA_TOKEN's, sent to {self.url})"
        elif status >= 500:
            message = f"the saga server at {self.url} cannot serve this: {message}"
        return CliError(code, message, ids, exit_code_of(status, code))

    def _not_the_api(self, response: httpx.Response) -> CliError:
        text = " ".join(response.text.split())[:200]
        return CliError(
            "server_error",
            f"{self.url} answered {response.status_code} {response.reason_phrase} without the saga API's "
            f"JSON ({text!r}): is it a saga server? {_CHECK}",
            exit_code=EXIT_USAGE,
        )

    # ---- the Client's run verbs ---------------------------------------------------------------------

    async def start(
        self,
        definition: str,
        context: Mapping[str, Any],
        idempotency_key: str | None = None,
        version: str | None = None,
    ) -> str:
        body = {
            "definition": definition,
            "context": dict(context),
            "idempotency_key": idempotency_key,
            "version": version,
        }
        return str((await self.request("POST", "/runs", body=body))["run_id"])

    async def cancel(self, run_id: str, reason: str, requested_by: str) -> str:
        """Ask for the run's cancellation; the server records the token's name as who asked, not
        ``requested_by``."""
        answer = await self.request("POST", f"/runs/{_segment(run_id)}/cancel", body={"reason": reason})
        return str(answer["request"])

    async def redrive(self, run_id: str, reason: str, requested_by: str, *, undo_lost: bool = False) -> str:
        """Ask for the run's re-drive (raises RedriveRefused for a run that is not failed); the server
        records the token's name as who asked."""
        body = {"reason": reason, "undo_lost": undo_lost}
        answer = await self.request("POST", f"/runs/{_segment(run_id)}/redrive", body=body)
        return str(answer["request"])

    async def status(self, run_id: str, *, inputs: bool = False) -> dict[str, Any]:
        """``saga status --json`` of the run; raises RunNotFound."""
        params = {"inputs": "true"} if inputs else None
        document: dict[str, Any] = await self.request("GET", f"/runs/{_segment(run_id)}", params=params)
        return document

    async def history(self, run_id: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = (await self.request("GET", f"/runs/{_segment(run_id)}/history"))[
            "events"
        ]
        return events

    async def answer(self, run_id: str, request_id: str, timeout_s: float = 30.0) -> RequestAnswer:
        """What the run's shard did with request ``request_id``, from the run's history (as
        :meth:`Client.answer`); raises NoAnswer when nothing is recorded within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        seen, poll_s = 0, 0.05
        while True:
            events = await self.history(run_id)
            for event in events[seen:]:
                found = answer_of({"kind": event["kind"], "detail": json.dumps(event)}, request_id)
                if found is not None:
                    return found
            seen = len(events)
            if time.monotonic() >= deadline:
                break
            await asyncio.sleep(poll_s)
            poll_s = min(poll_s * 1.5, 0.5)
        shard = (await self.status(run_id)).get("shard")
        raise NoAnswer(run_id, request_id, str(shard or "?"), timeout_s)

    async def wait(self, run_id: str, timeout_s: float = 60.0) -> RunResult:
        """Wait until the run has ended (as :meth:`Client.wait`: a run not created yet is waited for);
        raises WaitTimeout."""
        deadline = time.monotonic() + timeout_s
        state, poll_s = "pending", 0.05
        while time.monotonic() < deadline:
            try:
                document: dict[str, Any] | None = await self.status(run_id)
            except RunNotFound:
                document = None  # not created yet: the start is still on its way to the shard
            if document is not None:
                state = document["state"]
                if is_final(state):
                    return RunResult(run_id, state, document.get("output"), document.get("reason"))
            await asyncio.sleep(min(poll_s, max(deadline - time.monotonic(), 0.0)))
            poll_s = min(poll_s * 1.5, 0.5)
        raise WaitTimeout(run_id, state, timeout_s)

    async def list_runs(self, wanted: RunFilter) -> tuple[list[dict[str, Any]], str | None]:
        """The runs ``wanted`` keeps, newest first, a page of the API at a time until ``wanted.limit``
        (None: every one), and the cursor of the page after them (None: there is no more)."""
        rows: list[dict[str, Any]] = []
        cursor = f"{wanted.after[0]}:{wanted.after[1]}" if wanted.after else None
        while True:
            size = API_PAGE if wanted.limit is None else min(API_PAGE, wanted.limit - len(rows))
            params = {
                "state": wanted.state,
                "definition": wanted.definition,
                "version": wanted.version,
                "since_ms": wanted.since_ms,
                "limit": size,
                "cursor": cursor,
            }
            page = await self.request("GET", "/runs", params=params)
            rows += page["runs"]
            cursor = page["next_cursor"]
            if cursor is None or (wanted.limit is not None and len(rows) >= wanted.limit):
                return rows, cursor


# ---- choosing the path ------------------------------------------------------------------------------------


def server_url(*, explicit_only: bool = False) -> str | None:
    """The server the CLI goes through: ``--server`` (given empty: none), else SAGA_SERVER_URL unless
    ``explicit_only``; None: the direct path."""
    given = _given()
    if given is not None:
        return given or None
    if explicit_only:
        return None
    from orchestrator.cli import load_settings  # the one place settings errors become usage errors

    return load_settings().server_url or None


def _given() -> str | None:
    """The ``--server`` option's value (None: not given)."""
    ctx = click.get_current_context(silent=True)
    given = ctx.meta.get(SERVER_META) if ctx is not None else None
    return None if given is None else str(given)


def _base(url: str) -> str:
    """``url`` without a trailing slash or ``/api/v1`` (either form names the server); a URL that is not
    http(s) is a usage error."""
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise _bad_url(url, str(exc)) from exc
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise _bad_url(url, "it needs http:// or https:// and a host")
    base = url.rstrip("/")
    return base.removesuffix(API_PREFIX).rstrip("/")


def _bad_url(url: str, why: str) -> CliError:
    return CliError(
        "invalid_setting",
        f"the saga server URL {url!r} (--server or SAGA_SERVER_URL) is not usable: {why}",
        exit_code=EXIT_USAGE,
    )


def remote_client() -> Remote | None:
    """The API to go through, when a server URL is set (None: the direct path). A server without
    SAGA_TOKEN is a usage error: every request needs a token."""
    url = server_url()
    if url is None:
        return None
    from orchestrator.cli import load_settings

    base = _base(url)
    token = load_settings().token
    if not token:
        raise CliError(
            "token_missing",
            f"SAGA_TOKEN is not set: the saga server at {base} takes a bearer token in it (an admin "
            "creates one with 'saga tokens create --name NAME --role ROLE')",
            exit_code=EXIT_USAGE,
        )
    return Remote(base, token)


def refuse_remote(command: str, *, explicit_only: bool = False) -> None:
    """Refuse a command with no API twin when a server URL is set (``explicit_only``: when --server
    was given, as long-running processes ignore SAGA_SERVER_URL)."""
    if server_url(explicit_only=explicit_only) is None:
        return
    unset = "" if _given() else " (SAGA_SERVER_URL is set: unset it, or give --server '')"
    raise CliError(
        "no_api_twin",
        f"'saga {command}' goes to RabbitMQ/Redis directly; run it without --server{unset} on a machine "
        "that reaches them",
        {"command": command},
        exit_code=EXIT_USAGE,
    )


def refuse_local_registry(modules: tuple[str, ...], registry_file: str | None) -> None:
    """Through the server its own contracts decide (its SAGA_CONTRACTS): local ones are a usage error."""
    if modules or registry_file:
        raise CliError(
            "usage",
            "--contracts and --registry do not apply with --server: the server compiles against its own "
            "contracts",
            exit_code=EXIT_USAGE,
        )

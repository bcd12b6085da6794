"""Errors as the API answers them: the CLI's JSON error document (``{"error": {"code", "message",
"ids"}}``) with an HTTP status that says what kind of failure it is."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from orchestrator.cli_errors import SERVICE_ERRORS, error_of, unreachable
from orchestrator.errors import SagaError

#: Codes that are refusals of a request that was understood (the state does not allow it): 409.
CONFLICTS = frozenset(
    {
        "lifecycle_refused",
        "version_exists",
        "version_not_startable",
        "definition_changed",
        "cancel_refused",
        "redrive_refused",
        "idempotency_conflict",
        "shard_retired",
        "shard_map_changed",
        "shard_refused",
        "token_name_taken",
    }
)
UNAVAILABLE = frozenset({"redis_unreachable", "broker_unreachable", "unreachable"})
MAX_PROBLEM_LINES = 50  # an error quoting a huge definition's problems stays readable and bounded


class ErrorResponse(JSONResponse):
    """JSON in ASCII: an error that repeats what the request sent (a name, a reason) is always sendable,
    whatever characters it holds."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


class ApiError(SagaError):
    """An error of the API itself (authentication, authorisation), with its HTTP status."""

    def __init__(self, status: int, code: str, message: str, ids: dict[str, Any] | None = None) -> None:
        self.status = status
        self.api_code = code
        self.api_ids = ids or {}
        super().__init__(message)


def status_of(code: str) -> int:
    if code.endswith("_not_found"):
        return 404
    if code in CONFLICTS:
        return 409
    if code in UNAVAILABLE:
        return 503
    if code == "definition_invalid":
        return 422
    return 400


def document(code: str, message: str, ids: dict[str, Any]) -> dict[str, Any]:
    lines = message.splitlines()
    if len(lines) > MAX_PROBLEM_LINES + 1:
        more = len(lines) - MAX_PROBLEM_LINES - 1
        message = "\n".join([*lines[: MAX_PROBLEM_LINES + 1], f"... and {more} more"])
    return {"error": {"code": code, "message": message, "ids": ids}}


async def saga_error(_: Request, exc: Exception) -> JSONResponse:
    if isinstance(exc, ApiError):
        return ErrorResponse(document(exc.api_code, str(exc), exc.api_ids), status_code=exc.status)
    assert isinstance(exc, SagaError)
    error = error_of(exc)
    return ErrorResponse(
        document(error.code, error.format_message(), error.ids), status_code=status_of(error.code)
    )


async def service_error(_: Request, exc: Exception) -> JSONResponse:
    error = unreachable(exc)
    return ErrorResponse(document(error.code, error.format_message(), error.ids), status_code=503)


async def http_error(_: Request, exc: Exception) -> JSONResponse:
    """The framework's own refusals (an unknown path, a method not allowed, a body that is not JSON) in
    the same error document."""
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request")
    return ErrorResponse(
        document(code, str(exc.detail), {}), status_code=exc.status_code, headers=exc.headers
    )


async def validation_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
    return ErrorResponse(
        document("invalid_request", f"the request is invalid: {problems}", {}), status_code=422
    )


HANDLERS: list[tuple[type[BaseException], Any]] = [
    (SagaError, saga_error),
    (RequestValidationError, validation_error),
    (HTTPException, http_error),
    *[(error, service_error) for error in SERVICE_ERRORS],
]

"""Errors as the API answers them: the CLI's JSON error document (``{"error": {"code", "message",
"ids"}}``) with an HTTP status that says what kind of failure it is; and the same, declared in the API's
OpenAPI document (:data:`ERROR_RESPONSES`, :func:`declare_errors`) so that it lists every status an
operation can answer, with this document's schema."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
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
        "retire_refused",
        "token_name_taken",
    }
)
UNAVAILABLE = frozenset({"redis_unreachable", "broker_unreachable", "unreachable"})
MAX_PROBLEM_LINES = 50  # an error quoting a huge definition's problems stays readable and bounded


class ErrorDetail(BaseModel):
    """What went wrong, as the CLI's ``--json`` error document says it."""

    model_config = ConfigDict(extra="forbid")
    code: str = Field(description="a stable identifier of the kind of error: run_not_found, forbidden...")
    message: str = Field(description="what is wrong and what to do about it, for people")
    ids: dict[str, Any] = Field(description="the ids involved, by name: run_id, definition, queue...")


class ErrorDocument(BaseModel):
    """Every error the API answers (any status from 400 on), whatever raised it."""

    model_config = ConfigDict(extra="forbid")
    error: ErrorDetail


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


def _codes(codes: frozenset[str]) -> str:
    return ", ".join(sorted(codes))


#: Every status an API operation may answer with the error document, and when (for the OpenAPI document:
#: ``app.include_router(..., responses=ERROR_RESPONSES)``; :func:`declare_errors` then leaves out what an
#: operation cannot answer). What the server answers itself is in the handlers below and in status_of.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorDocument, "description": description}
    for status, description in {
        400: "The request is not one the server can take: a body that is not JSON or holds text that is "
        "not valid Unicode, a value the operation refuses (invalid_request, not_a_dead_letter_queue, "
        "role_unknown...), and any other error that is neither a refusal nor something not found.",
        401: "No bearer token (or console session), or one that is unknown or revoked (unauthenticated).",
        403: "The token's role may not do this (forbidden; ids name the roles that may), or a change "
        "signed in by the console's cookie without the X-Saga-Console header (console_header_missing).",
        404: "Something the request names does not exist (a code ending in _not_found: run, definition, "
        "version, plan, message, queue, token...).",
        409: f"The request was understood, but the state refuses it ({_codes(CONFLICTS)}).",
        422: "Parameters or a body that do not match this document (invalid_request, naming each "
        "problem), or a definition that does not compile (definition_invalid, one problem a line).",
        503: f"Redis or RabbitMQ cannot be reached or failed midway ({_codes(UNAVAILABLE)}).",
    }.items()
}
#: The statuses only an operation that names something (a path id, a parameter, a body) can answer.
ABOUT_INPUT = frozenset({"404", "422"})
#: Refusals of a change: only an operation that changes something can answer one.
ABOUT_CHANGES = frozenset({"409"})


def declare_errors(openapi: dict[str, Any]) -> dict[str, Any]:
    """``openapi`` (FastAPI's document of an app whose API routers were included with
    :data:`ERROR_RESPONSES`) without the error statuses an operation cannot answer: 404 and 422 where it
    takes no parameter and no body, 409 where it only reads."""
    for operations in openapi.get("paths", {}).values():
        for method, operation in operations.items():
            responses = operation.get("responses", {})
            takes_input = bool(operation.get("parameters") or operation.get("requestBody"))
            reads = method == "get"
            for status in list(responses):
                if (status in ABOUT_INPUT and not takes_input) or (status in ABOUT_CHANGES and reads):
                    del responses[status]
    return openapi


HANDLERS: list[tuple[type[BaseException], Any]] = [
    (SagaError, saga_error),
    (RequestValidationError, validation_error),
    (HTTPException, http_error),
    *[(error, service_error) for error in SERVICE_ERRORS],
]

"""The API's OpenAPI document says what the server answers when something is wrong: every error status an
operation can answer, each with the schema of the error document the handlers write, and never FastAPI's
own validation error (which the server never sends). Built and checked without services: the answers
come from the real app (its middleware, dependencies and handlers) before anything reaches Redis or
RabbitMQ, or from its handlers called with the errors the code raises."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import jsonschema
import pytest
import redis.exceptions
from fastapi.exceptions import RequestValidationError
from starlette.requests import Request

from orchestrator.auth.roles import Identity, Role
from orchestrator.client import CancelRefused, RunNotFound
from orchestrator.errors import DefinitionError, Problem
from orchestrator.server.app import create_app
from orchestrator.server.errors import (
    CONFLICTS,
    ERROR_RESPONSES,
    UNAVAILABLE,
    ApiError,
    status_of,
)
from orchestrator.settings import Settings

OPENAPI = "/api/v1/openapi.json"
APP = create_app(Settings())
DOCUMENT = APP.openapi()
ERROR_REF = {"$ref": "#/components/schemas/ErrorDocument"}
OPERATIONS = [
    (method.upper(), path, operation)
    for path, operations in DOCUMENT["paths"].items()
    for method, operation in operations.items()
]
API = [(m, p, o) for m, p, o in OPERATIONS if p.startswith("/api/v1/")]


def schema_of(response: dict[str, Any]) -> Any:
    return response["content"]["application/json"]["schema"]


def validator(schema: dict[str, Any]) -> jsonschema.protocols.Validator:
    """A validator of ``schema``, whose references point into the document's components."""
    root = {**schema, "components": DOCUMENT["components"]}
    return jsonschema.Draft202012Validator(root)


ERROR_SCHEMA = validator(ERROR_REF)


def call(method: str, url: str, **kwargs: Any) -> httpx.Response:
    """``url`` asked of the app in this process (no lifespan: no Redis, no broker)."""

    async def send() -> httpx.Response:
        transport = httpx.ASGITransport(app=APP)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
            return await client.request(method, url, **kwargs)

    return asyncio.run(send())


def test_the_document_is_the_one_the_server_serves() -> None:
    assert call("GET", OPENAPI).json() == DOCUMENT


def test_no_operation_declares_fastapis_validation_error_which_the_server_never_sends() -> None:
    assert "HTTPValidationError" not in json.dumps(DOCUMENT)
    for method, path, operation in OPERATIONS:
        if "422" in operation["responses"]:
            assert schema_of(operation["responses"]["422"]) == ERROR_REF, (method, path)


def test_every_api_operation_declares_401_and_403_and_every_error_status_with_the_error_document() -> None:
    assert len(API) >= 20  # the document is the app's, not an empty one
    for method, path, operation in API:
        responses = operation["responses"]
        assert {"401", "403", "400", "503"} <= set(responses), (method, path)
        for status, response in responses.items():
            if int(status) >= 400:
                assert schema_of(response) == ERROR_REF, (method, path, status)
                assert response["description"], (method, path, status)


def test_what_an_operation_cannot_answer_is_not_declared() -> None:
    for method, path, operation in API:
        statuses = set(operation["responses"])
        takes_input = bool(operation.get("parameters") or operation.get("requestBody"))
        assert ("404" in statuses) == takes_input and ("422" in statuses) == takes_input, (method, path)
        assert ("409" in statuses) == (method != "GET"), (method, path)
    assert "404" in DOCUMENT["paths"]["/api/v1/runs/{run_id}"]["get"]["responses"]
    assert "409" in DOCUMENT["paths"]["/api/v1/runs/{run_id}/cancel"]["post"]["responses"]


def test_health_and_readiness_need_no_token_and_readiness_declares_its_503() -> None:
    health = DOCUMENT["paths"]["/healthz"]["get"]["responses"]
    ready = DOCUMENT["paths"]["/readyz"]["get"]["responses"]
    assert set(health) == {"200"} and set(ready) == {"200", "503"}
    not_ready = {"status": "not ready", "problems": ["Redis: Connection refused"]}
    validator(schema_of(ready["503"])).validate(not_ready)
    assert OPENAPI not in DOCUMENT["paths"]


def test_every_status_the_error_codes_map_to_is_declared() -> None:
    codes = [*CONFLICTS, *UNAVAILABLE, "run_not_found", "definition_invalid", "invalid_request", "other"]
    assert {status_of(code) for code in codes} | {401, 403} == set(ERROR_RESPONSES)


class Tokens:
    """The token store, without Redis: "viewer" is a viewer's token; any other is unknown."""

    async def verify(self, secret: str) -> Identity | None:
        return Identity("viewer", Role.VIEWER) if secret == "viewer" else None


VIEWER = {"Authorization": "Bearer viewer"}
# (method, path as the document has it, URL, headers, body): answers the app gives before any service
ANSWERS = [
    ("GET", "/api/v1/runs", "/api/v1/runs", {}, None, 401),
    ("GET", "/api/v1/whoami", "/api/v1/whoami", {"Authorization": "Bearer unknown"}, None, 401),
    ("POST", "/api/v1/runs", "/api/v1/runs", VIEWER, {"definition": "x"}, 403),
    (
        "POST",
        "/api/v1/runs/{run_id}/cancel",
        "/api/v1/runs/r1/cancel",
        {"Cookie": "saga_session=viewer"},
        {},
        403,
    ),
    ("GET", "/api/v1/runs", "/api/v1/runs?cursor=nonsense", VIEWER, None, 400),
    ("POST", "/api/v1/runs", "/api/v1/runs", VIEWER, '{"definition": "\\ud800"}', 400),
    ("GET", "/api/v1/runs", "/api/v1/runs?limit=0", VIEWER, None, 422),
    ("GET", "/api/v1/definitions/{name}/diff", "/api/v1/definitions/x/diff", VIEWER, None, 422),
]


@pytest.mark.parametrize(("method", "path", "url", "headers", "body", "status"), ANSWERS)
def test_the_apps_error_answers_are_declared_for_their_operation_and_match_the_error_schema(
    method: str, path: str, url: str, headers: dict[str, str], body: Any, status: int
) -> None:
    APP.state.tokens = Tokens()
    content = body if isinstance(body, str) else None
    payload = None if isinstance(body, str) else body
    sent_headers = {**headers, "Content-Type": "application/json"} if body is not None else headers
    answer = call(method, url, headers=sent_headers, json=payload, content=content)
    assert answer.status_code == status, answer.text
    assert answer.headers["content-type"] == "application/json"
    ERROR_SCHEMA.validate(answer.json())
    assert str(status) in DOCUMENT["paths"][path][method.lower()]["responses"]


def test_unknown_paths_and_methods_answer_the_error_document_too() -> None:
    for answer, status in ((call("GET", "/api/v1/nope"), 404), (call("DELETE", "/api/v1/runs"), 405)):
        assert answer.status_code == status
        ERROR_SCHEMA.validate(answer.json())


def _request() -> Request:
    return Request({"type": "http", "method": "GET", "path": "/", "headers": [], "app": APP})


ERRORS: list[tuple[BaseException, int]] = [
    (RunNotFound("r1"), 404),
    (CancelRefused("r1", "completed", None, "done"), 409),
    (DefinitionError([Problem("d.yaml", 3, "stages.a", "unknown task")]), 422),
    (ApiError(403, "forbidden", "no", {"action": "start", "needed": ["operator", "admin"]}), 403),
    (RequestValidationError([{"loc": ("query", "limit"), "msg": "too small", "type": "x"}]), 422),
    (redis.exceptions.ConnectionError("Connection refused"), 503),
    (ConnectionRefusedError(111, "Connection refused"), 503),
]


@pytest.mark.parametrize(("error", "status"), ERRORS, ids=lambda e: type(e).__name__)
def test_every_handler_writes_the_declared_error_document(error: BaseException, status: int) -> None:
    handler = next(APP.exception_handlers[k] for k in type(error).__mro__ if k in APP.exception_handlers)
    answer = asyncio.run(handler(_request(), error))
    assert answer.status_code == status
    ERROR_SCHEMA.validate(json.loads(answer.body))


def test_the_error_schema_is_strict() -> None:
    good = {"error": {"code": "x", "message": "m", "ids": {}}}
    ERROR_SCHEMA.validate(good)
    for bad in (
        {"detail": [{"loc": ["query"], "msg": "m", "type": "t"}]},  # FastAPI's own
        {"error": {"code": "x", "message": "m"}},
        {"error": {"code": "x", "message": "m", "ids": {}, "more": 1}},
        {**good, "more": 1},
    ):
        with pytest.raises(jsonschema.ValidationError):
            ERROR_SCHEMA.validate(bad)

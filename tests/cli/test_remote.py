"""``saga --server`` without a server: which path a command takes, what it refuses, and how the API's
errors become the CLI's (exit codes, codes, ids). The commands through a real server are in
``tests/integration/test_cli_remote.py``."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner, Result

from orchestrator.cli import main
from orchestrator.cli_errors import CliError
from orchestrator.client import RedriveRefused, RunNotFound
from orchestrator.remote import Remote, exit_code_of

ROOT = Path(__file__).resolve().parents[2]
MODEL_INGEST = str(ROOT / "definitions" / "model-ingest.yaml")


def invoke(*args: str, env: dict[str, str | None] | None = None) -> Result:
    clean: dict[str, str | None] = {"SAGA_SERVER_URL": None, "SAGA_TOKEN": None, "SAGA_CONTRACTS": None}
    return CliRunner().invoke(main, list(args), env={**clean, **(env or {})}, catch_exceptions=False)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again when the test connects


def error_of(result: Result) -> dict[str, Any]:
    error: dict[str, Any] = json.loads(result.stdout)["error"]
    return error


def test_a_server_without_a_token_is_a_usage_error_naming_saga_token() -> None:
    result = invoke("--server", "http://127.0.0.1:9", "runs", "--json")
    assert result.exit_code == 2
    error = error_of(result)
    assert error["code"] == "token_missing" and "SAGA_TOKEN" in error["message"]


def test_a_server_that_cannot_be_reached_is_exit_2_naming_saga_server_url() -> None:
    url = f"http://127.0.0.1:{closed_port()}"
    result = invoke("status", "r-1", "--json", env={"SAGA_SERVER_URL": url, "SAGA_TOKEN": "t"})
    assert result.exit_code == 2
    error = error_of(result)
    assert error["code"] == "server_unreachable" and "SAGA_SERVER_URL" in error["message"]
    text = invoke("--server", url, "history", "r-1", env={"SAGA_TOKEN": "t"})
    assert text.exit_code == 2 and text.stderr.startswith("error: cannot reach the saga server at")


def test_a_url_that_is_not_http_is_refused() -> None:
    result = invoke("--server", "redis://127.0.0.1:6379", "runs", env={"SAGA_TOKEN": "t"})
    assert result.exit_code == 2 and "http:// or https://" in result.stderr


@pytest.mark.parametrize(
    ("args", "env"),
    [
        (("--server", "http://127.0.0.1:9", "reconcile"), {}),
        (("--server", "http://127.0.0.1:9", "topology", "export"), {}),
        (("contracts", "list", "--live"), {"SAGA_SERVER_URL": "http://127.0.0.1:9"}),
        (("--server", "http://127.0.0.1:9", "worker", "--app", "workers.demo"), {}),
    ],
)
def test_commands_with_no_api_twin_refuse_a_server(args: tuple[str, ...], env: dict[str, str]) -> None:
    result = invoke(*args, env=env)
    assert result.exit_code == 2
    assert result.stderr.startswith("error: 'saga ") and "goes to RabbitMQ/Redis directly" in result.stderr


def test_processes_ignore_saga_server_url_and_local_commands_ignore_any_server() -> None:
    # a deployment's SAGA_SERVER_URL does not stop a worker (this one fails later, on its app)
    worker = invoke("worker", "--app", "not_installed_anywhere", env={"SAGA_SERVER_URL": "http://x:1"})
    assert worker.exit_code == 2 and "goes to RabbitMQ/Redis directly" not in worker.output
    valid = invoke("--server", "http://127.0.0.1:9", "validate", MODEL_INGEST)
    assert valid.exit_code == 0, valid.output
    # '' goes direct whatever SAGA_SERVER_URL says (here: to a Redis that is not there)
    direct = invoke(
        "--server",
        "",
        "runs",
        "--json",
        env={"SAGA_SERVER_URL": "http://x:1", "SAGA_REDIS_URL": f"redis://127.0.0.1:{closed_port()}/0"},
    )
    assert direct.exit_code == 2 and error_of(direct)["code"] == "redis_unreachable"


def test_local_contracts_do_not_apply_through_a_server() -> None:
    args = ("--server", "http://127.0.0.1:9", "definitions", "publish", "--contracts", "x", MODEL_INGEST)
    result = invoke(*args, env={"SAGA_TOKEN": "t"})
    assert result.exit_code == 2 and "--contracts and --registry do not apply" in result.stderr


def _answer(status: int, body: Any) -> httpx.Response:
    request = httpx.Request("GET", "http://saga.test/api/v1/runs")
    if isinstance(body, str):
        return httpx.Response(status, text=body, request=request)
    return httpx.Response(status, json=body, request=request)


def _error(status: int, code: str, message: str = "m", ids: dict[str, Any] | None = None) -> Exception:
    body = {"error": {"code": code, "message": message, "ids": ids or {}}}
    return Remote("http://saga.test", "t")._error(_answer(status, body))


@pytest.mark.parametrize(
    ("status", "code", "exit_code"),
    [
        (401, "unauthenticated", 2),
        (403, "forbidden", 2),
        (404, "definition_not_found", 1),
        (409, "lifecycle_refused", 1),
        (422, "definition_invalid", 1),
        (422, "invalid_request", 2),
        (400, "start_refused", 1),
        (400, "not_a_dead_letter_queue", 2),
        (503, "redis_unreachable", 2),
    ],
)
def test_api_errors_keep_their_code_and_ids_with_the_cli_exit_codes(
    status: int, code: str, exit_code: int
) -> None:
    assert exit_code_of(status, code) == exit_code
    error = _error(status, code, ids={"definition": "d"})
    assert isinstance(error, CliError)
    assert (error.code, error.ids, error.exit_code) == (code, {"definition": "d"}, exit_code)


def test_errors_the_commands_act_on_come_back_as_the_direct_paths() -> None:
    missing = _error(404, "run_not_found", ids={"run_id": "r-1"})
    assert isinstance(missing, RunNotFound) and missing.run_id == "r-1"
    refused = _error(409, "redrive_refused", ids={"run_id": "r-1", "state": "completed"})
    assert isinstance(refused, RedriveRefused) and "completed" in refused.why
    unavailable = _error(503, "redis_unreachable", "cannot reach Redis")
    assert isinstance(unavailable, CliError) and "saga server at http://saga.test" in unavailable.message


def test_an_answer_that_is_not_the_apis_says_so() -> None:
    error = Remote("http://saga.test", "t")._error(_answer(404, "<html>nginx</html>"))
    assert isinstance(error, CliError) and error.exit_code == 2 and error.code == "server_error"
    assert "is it a saga server?" in error.message

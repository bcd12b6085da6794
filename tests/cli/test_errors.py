"""One error shape for every ``saga`` command, in-process (click's CliRunner): with ``--json`` an error is
``{"error": {"code", "message", "ids"}}`` on stdout; in text it is said on stderr. None of these reach
RabbitMQ or Redis (the unreachable ones point at a port where nothing listens)."""

from __future__ import annotations

import json
import re
import socket
import sys
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner, Result

from orchestrator.cli import main
from orchestrator.cli_errors import SagaGroup, asks_json
from orchestrator.client import RunNotFound
from orchestrator.errors import SagaError
from tests.conftest import ROOT

MODEL_INGEST = "definitions/model-ingest.yaml"
NOBODY = "127.0.0.1:1"  # connection refused at once
BAD_CONTRACT = """\
name: bad
version: "1.0.0"
entry: a
stages:
  - name: a
    type: action
    action: nope.nope@1
    on_success: completed
"""


def invoke(*args: str, env: dict[str, str | None] | None = None, command: click.Command = main) -> Result:
    """``saga ARGS`` in-process, from the repository root, without the caller's SAGA_* settings."""
    clean: dict[str, str | None] = {"SAGA_CONTRACTS": None, "SAGA_NAMESPACE": None, "SAGA_KEY_PREFIX": None}
    clean |= {"SAGA_SERVER_URL": None, "SAGA_TOKEN": None}  # the direct path
    return CliRunner().invoke(command, list(args), env={**clean, **(env or {})}, catch_exceptions=False)


def error_of(result: Result) -> dict[str, Any]:
    """The error document, which must be all that stdout holds."""
    document = json.loads(result.stdout)
    assert set(document) == {"error"}, document
    error: dict[str, Any] = document["error"]
    assert set(error) == {"code", "message", "ids"}, error
    assert re.fullmatch(r"[a-z][a-z0-9_-]*", error["code"]), error["code"]
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["ids"], dict)
    return error


@pytest.fixture(autouse=True)
def _from_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)


# ---- the shape ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "exit_code", "code"),
    [
        (["frobnicate", "--json"], 2, "usage"),
        (["validate", "--json", "--bogus", MODEL_INGEST], 2, "usage"),
        (["compile", "--json", "definitions/no-such.yaml"], 2, "usage"),
        (["start", "model-ingest", "--context", "{not json", "--json"], 2, "usage"),
        (["start", "model-ingest", "--context", "[1]", "--json"], 2, "usage"),
        (["dead-letters", "purge", "--json"], 2, "usage"),
        (["dead-letters", "list", "--queue", "saga.shard.fast.0", "--json"], 2, "not_a_dead_letter_queue"),
        (
            ["dead-letters", "purge", "--yes", "--queue", "saga.task.tasks.parallel:x@1", "--json"],
            2,
            "not_a_dead_letter_queue",
        ),
    ],
    ids=[
        "command",
        "option",
        "file",
        "context-json",
        "context-object",
        "purge-no-yes",
        "live-queue",
        "purge-live-queue",
    ],
)
def test_usage_errors_under_json_are_the_error_document_exit_2(
    args: list[str], exit_code: int, code: str
) -> None:
    result = invoke(*args)
    assert result.exit_code == exit_code, result.output
    assert error_of(result)["code"] == code
    assert result.stderr == ""


def test_a_bad_setting_under_json_names_the_variable() -> None:
    result = invoke("validate", "--json", MODEL_INGEST, env={"SAGA_MAX_STAGES": "many"})
    assert result.exit_code == 2
    error = error_of(result)
    assert error["code"] == "invalid_setting" and "SAGA_MAX_STAGES" in error["message"]


def test_an_invalid_definition_under_json_lists_every_problem(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD_CONTRACT)
    result = invoke("compile", "--json", str(bad))
    assert result.exit_code == 1
    error = error_of(result)
    assert error["code"] == "definition_invalid"
    assert "contract 'nope.nope@1' is not registered" in error["message"]
    # text mode is unchanged: the problems alone, one FILE:LINE: path: message line each, on stderr
    text = invoke("compile", str(bad))
    assert text.exit_code == 1 and text.stdout == ""
    problems = text.stderr.splitlines()
    assert problems and all(line.startswith(f"{bad}:") for line in problems), problems
    assert "nope.nope@1" in text.stderr and "error:" not in text.stderr


def test_an_unreachable_broker_under_json_is_broker_unreachable_exit_2() -> None:
    env = {"SAGA_AMQP_URL": f"amqp://guest:secret@{NOBODY}/"}
    result = invoke("dead-letters", "list", "--json", env=env)
    assert result.exit_code == 2
    error = error_of(result)
    assert error["code"] == "broker_unreachable" and "secret" not in error["message"]
    text = invoke("dead-letters", "purge", "--yes", env=env)
    assert text.exit_code == 2 and text.stdout == ""
    assert text.stderr.startswith("error: cannot connect to RabbitMQ at amqp://guest:***@")


def test_an_unreachable_redis_under_json_is_the_error_document() -> None:
    # status is one of the read-only commands: it gets the shape without saying anything about it
    env = {"SAGA_REDIS_URL": f"redis://{NOBODY}/0", "SAGA_AMQP_URL": f"amqp://guest:guest@{NOBODY}/"}
    result = invoke("status", "0" * 32, "--json", env=env)
    assert result.exit_code == 2  # a configuration error, as for every command
    assert error_of(result)["code"] in ("redis_unreachable", "unreachable")


def test_a_command_added_later_gets_the_shape_by_raising() -> None:
    @click.group(cls=SagaGroup)
    def cli() -> None:
        """A group like saga's."""

    @cli.command()
    @click.argument("run_id")
    @click.option("--json", "as_json", is_flag=True)
    def look(run_id: str, as_json: bool) -> None:
        raise RunNotFound(run_id)

    result = invoke("look", "r-1", "--json", command=cli)
    assert result.exit_code == 1
    assert error_of(result) == {
        "code": "run_not_found",
        "message": "run r-1 not found; it never started or its record has expired",
        "ids": {"run_id": "r-1"},
    }
    text = invoke("look", "r-1", command=cli)
    assert text.exit_code == 1 and text.stdout == ""
    assert text.stderr == "error: run r-1 not found; it never started or its record has expired\n"


def _subclasses(cls: type[SagaError]) -> list[type[SagaError]]:
    return [c for sub in cls.__subclasses__() for c in (sub, *_subclasses(sub))]


def test_every_error_class_has_a_stable_code_of_its_own_and_names_real_ids() -> None:
    # the modules that declare errors, loaded (orchestrator.cli loads most of them)
    import orchestrator.bus.envelope
    import orchestrator.store.redis_store  # noqa: F401

    own = {c: c.__dict__["code"] for c in _subclasses(SagaError) if "code" in c.__dict__}
    assert all(re.fullmatch(r"[a-z][a-z0-9_]*", code) for code in own.values()), own
    shared = {code for code in own.values() if list(own.values()).count(code) > 1}
    assert shared <= {"plan_not_found"}, shared  # the store's and the client's: the same thing, said twice
    for cls in (c for c in _subclasses(SagaError) if c.id_fields):
        init = next(k.__dict__["__init__"] for k in cls.__mro__ if "__init__" in k.__dict__)
        assigned = init.__code__.co_names  # self.<name> = ... in the __init__ that runs
        assert all(name in assigned for name in cls.id_fields), (cls, cls.id_fields)


def test_only_json_before_a_double_dash_counts() -> None:
    assert asks_json(["status", "r", "--json"])
    assert not asks_json(["start", "x", "--", "--json"])
    assert not asks_json(["status", "r"])


# ---- contracts modules: an option that exists, and what to do when one cannot be imported ----------------


def test_definitions_publish_takes_contracts_modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "own_contracts.py").write_text(
        "from workers.demo.models import CacheLookupOutput, ModelRef\n"
        "from workers.sdk import action\n\n\n"
        '@action("own.thing", version=7, input=ModelRef, output=CacheLookupOutput, queue="own")\n'
        "def own_thing(payload: ModelRef) -> CacheLookupOutput:\n"
        "    return CacheLookupOutput(modelId=payload.modelId, hit=True)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))  # in-process, PYTHONPATH=. would do this
    # model-ingest needs contracts this module lacks: refused by the compiler (exit 1, before Redis), and
    # the problem names --contracts, which publish has (the real publish: tests/integration/test_refusals.py)
    env = {"SAGA_REDIS_URL": f"redis://{NOBODY}/0"}
    result = invoke("definitions", "publish", "--contracts", "own_contracts", MODEL_INGEST, env=env)
    assert result.exit_code == 1, result.output
    assert "in a module passed with --contracts" in result.stderr
    assert "--contracts MODULE" in invoke("definitions", "publish", "--help").stdout


@pytest.mark.parametrize("how", ["option", "env"])
def test_a_contracts_module_that_cannot_be_imported_says_it_must_be_importable(how: str) -> None:
    args = ["--contracts", "not_installed_anywhere"] if how == "option" else []
    env = {"SAGA_CONTRACTS": "not_installed_anywhere"} if how == "env" else {}
    result = invoke("definitions", "publish", *args, MODEL_INGEST, "--json", env=env)
    assert result.exit_code == 2
    error = error_of(result)
    assert error["code"] == "contracts_not_loaded" and error["ids"] == {"module": "not_installed_anywhere"}
    assert "must be importable" in error["message"]
    assert "PYTHONPATH=. from the directory holding it" in error["message"]


def test_a_worker_app_that_cannot_be_imported_says_it_must_be_importable() -> None:
    result = invoke("worker", "--app", "not_installed_anywhere", "--json")
    # the worker has no --json: that is a usage error too, shown as the document
    assert result.exit_code == 2 and error_of(result)["code"] == "usage"
    text = invoke("worker", "--app", "not_installed_anywhere")
    assert text.exit_code == 2
    assert "must be importable" in text.stderr and "PYTHONPATH=. from the directory holding it" in text.stderr


# ---- help ------------------------------------------------------------------------------------------------


def test_the_help_says_what_the_tool_does_now() -> None:
    text = invoke("--help").stdout
    assert "(soon)" not in text
    assert "run orchestrators and worker pools; start, inspect, cancel" in " ".join(text.split())
    for name in ("start", "cancel", "redrive", "dead-letters", "definitions", "worker", "orchestrator"):
        assert re.search(rf"^  {name}\s", text, re.MULTILINE), name
    purge = invoke("dead-letters", "purge", "--help").stdout
    assert "--yes" in purge and "--queue QUEUE" in purge


def test_a_redis_that_accepts_and_never_answers_is_an_error_document_not_a_traceback() -> None:
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # accepts connections (the kernel does), never reads or answers
    try:
        host, port = silent.getsockname()
        env = {"SAGA_REDIS_URL": f"redis://{host}:{port}/0", "SAGA_REDIS_TIMEOUT_S": "0.5"}
        result = invoke("runs", "--json", env=env)
        assert result.exit_code == 2, result.output
        error = error_of(result)
        assert error["code"] == "redis_unreachable" and "SAGA_REDIS_URL" in error["message"]
        text = invoke("runs", env=env)
        assert text.exit_code == 2 and text.stderr.startswith("error: cannot reach Redis")
    finally:
        silent.close()


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("SAGA_AMQP_URL", "amqp://u:hunter2@h1:1,amqp://u:hunter2@h2/v,h3"),
        ("SAGA_AMQP_URL", "amqp://u:hunter2@h1:1,,h2:2/v"),
    ],
)
def test_a_refused_setting_is_named_without_its_secret(name: str, value: str) -> None:
    result = invoke("shards", "list", "--json", env={name: value})
    assert result.exit_code == 2
    error = error_of(result)
    assert error["code"] == "invalid_setting" and name in error["message"], error
    assert "hunter2" not in result.output


@pytest.mark.parametrize("command", ["orchestrator", "worker", "server"])
def test_uvloop_asked_for_where_it_cannot_be_imported_stops_the_process_at_once_exit_2(
    command: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop raises ImportError
    env = {"SAGA_EVENT_LOOP": "uvloop", "SAGA_REDIS_URL": f"redis://{NOBODY}/0"}
    env["SAGA_AMQP_URL"] = f"amqp://guest:guest@{NOBODY}/"
    result = invoke(command, env=env)
    assert result.exit_code == 2, result.output
    assert "SAGA_EVENT_LOOP=uvloop, but uvloop cannot be imported" in result.stderr
    assert "set SAGA_EVENT_LOOP=auto or asyncio" in result.stderr
    assert "cannot connect" not in result.stderr  # said before it tried to reach anything

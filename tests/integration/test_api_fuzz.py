"""The HTTP API fuzzed from its own OpenAPI document: schemathesis generates requests for every operation
(valid ones and ones that break the schema), sends them to ``saga server`` running as a process on a
throwaway stack, and checks that no answer is a 5xx, that every answer's status is one the document
declares for the operation, with a media type it declares, and that every answer the document declares a
schema for conforms to it. An admin token drives every operation; a viewer token drives the reads again.

Left out: the operations that create broker objects or take tokens away from the test (adding shards,
draining or retiring one, revoking a token) and dead-letter replay and purge (they would take away the
dead letters the reads are to find). The server-sent-event streams are opened, checked by their status
(one the document declares) and first bytes, and closed. Before the fuzzing, the stack gets runs in
every state and dead letters, and the generated values are mixed with real ones (definition names,
versions, run ids, queue names) and hostile ones, so requests get past "not found". A bounded,
derandomized number of examples per operation keeps the run short and the same from one run to the next.
A failure prints the server's traceback for it (from its log).

``schemathesis.pytest.from_fixture``, which would load the document from the server's URL, fails on
pytest 9.2 (it sets ``Function._nodeid``, which is gone), so the cases come from the app's own document,
built at collection without services, and the fixture checks the running server serves exactly that."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from functools import partial
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    is_unexpected_http_status_case,
    response_schema_conformance,
    status_code_conformance,
)

from orchestrator.auth.roles import Role
from orchestrator.bus.connect import connect_once
from orchestrator.bus.names import Names
from orchestrator.bus.publisher import Publisher
from orchestrator.client import run_id_for
from orchestrator.engine.model import RunStatus
from orchestrator.server.app import create_app
from orchestrator.settings import Settings
from tests.integration.served import Served, serving
from tests.integration.stack import ROOT, Stack, poll

pytestmark = pytest.mark.services

OPENAPI = "/api/v1/openapi.json"
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
MODEL_INGEST = (ROOT / "definitions" / "model-ingest.yaml").read_text()


def _run_id(key: str) -> str:
    return run_id_for("model-ingest", key)


# What the fixture puts on the stack before the fuzzing starts (runs in every state, dead letters), so
# that generated requests reach past "not found" into the code that reads real records.
DONE, FAILED, RUNNING = _run_id("fuzz-done"), _run_id("fuzz-failed"), _run_id("fuzz-running")
GARBAGE, REFUSED = "fuzz-garbage", "fuzz-refused"
NAMES = Names()
# Values schemathesis mixes into what it generates for the parameters bound to them below: the real and
# the nearly real (superscript and Arabic-Indic digits pass str.isdigit; big numbers; live queues; queue
# names of the dead-letter form the broker refuses). Its own strings are never lone UTF-16 surrogates
# (Hypothesis leaves out category Cs), but a JSON body may carry one as an escape (\ud800), which Python
# decodes to a str that cannot be encoded again. Schemathesis cannot hold one in a dictionary either
# (its validator refuses it), so the bodies get SURROGATE's marker, which call_and_check swaps for it.
SURROGATE = ("<lone-surrogate>", "\ud800")
HOSTILE = [SURROGATE[0], f"x{SURROGATE[0]}", "\x00", "é" * 150, "x" * 300, ""]
DEFINITIONS = ["model-ingest", "ingest-triage", "catalogue-reindex", "thumbnail-batch", "nope"]
VERSIONS = ["2.3.0", "1.0.0", "2.9.9", "9.9.9", "2.3", ""]
DICTIONARIES: dict[str, list[str]] = {
    "definitions": DEFINITIONS,
    "versions": VERSIONS,
    "body-definitions": DEFINITIONS + HOSTILE,
    "body-versions": VERSIONS + HOSTILE,
    "texts": ["fuzz", *HOSTILE],
    "runs": [DONE, FAILED, RUNNING, DONE.upper(), f"{DONE}/history", "nope"],
    "states": [*RunStatus, "refused", ""],
    "cursors": [f"1:{DONE}", "\u00b2:x", "\u0663:x", "9" * 30 + ":x", "-1:x", "1:", ":x", "1:2:3"],
    "queues": [
        NAMES.rejected_queue,
        "saga.shard.fast.0.dlq",
        NAMES.task_dead_letters("rendering"),
        "saga.shard.fast.0",  # a live queue: refused
        "saga.nope.dlq",
        "other.dlq",
        "saga." + "q" * 300 + ".dlq",  # longer than the broker's 255 bytes
        "saga.\x00.dlq",
        "saga.é.dlq",
    ],
    "messages": [GARBAGE, REFUSED, "nope"],
    "roles": [*Role, "root"],
    "sources": [
        MODEL_INGEST,  # as stored: no change
        MODEL_INGEST.replace('version: "2.3.0"', 'version: "2.9.9"'),  # a new version
        MODEL_INGEST.replace("300000", "290000"),  # another source under 2.3.0
        MODEL_INGEST.replace('version: "2.3.0"', "version: 2.3"),  # a number, not a string
        MODEL_INGEST.replace("execution_deadline_ms: 300000", "execution_deadline_ms: 1e400"),
        "- a\n- b\n",
        "name: model-ingest\n",
        "&a [*a]",
        "{",
        "\ufeff" + MODEL_INGEST,
        *HOSTILE,
    ],
}
BINDINGS = {
    "path.name": "definitions",
    "query.definition": "definitions",
    "body.definition": "body-definitions",
    "path.version": "versions",
    "query.version": "versions",
    "query.v1": "versions",
    "query.v2": "versions",
    "body.version": "body-versions",
    "path.run_id": "runs",
    "query.state": "states",
    "query.cursor": "cursors",
    "query.queue": "queues",
    "path.message_id": "messages",
    "body.role": "roles",
    "body.source": "sources",
    **{f"body.{name}": "texts" for name in ("file", "reason", "idempotency_key", "name", "tenant")},
}
# The same cases every run; SAGA_FUZZ_EXAMPLES and SAGA_FUZZ_SEED fuzz deeper or elsewhere, by hand.
EXAMPLES = int(os.environ.get("SAGA_FUZZ_EXAMPLES", "25"))
SEED = int(os.environ.get("SAGA_FUZZ_SEED", "20240611"))
CONFIG = schemathesis.Config.from_dict(
    {
        "seed": SEED,
        "generation": {"max-examples": EXAMPLES, "deterministic": True, "database": "none"},
        "phases": {"stateful": {"enabled": False}},
        "request-timeout": 30,
        # reproductions hide the token only (by default "idempotency_key" would read "[Filtered]" too)
        "output": {
            "sanitization": {"keys-to-sanitize": ["authorization"], "sensitive-markers": ["authorization"]}
        },
        "dictionaries": {name: {"values": values} for name, values in DICTIONARIES.items()},
        "parameters": {key: {"dictionary": name, "probability": 0.5} for key, name in BINDINGS.items()},
    }
)


DOCUMENT = create_app(Settings()).openapi()  # the app's own (see above)
schema = schemathesis.openapi.from_dict(DOCUMENT, config=CONFIG)


class Server(Served):
    """The served stack, and its server's log to read a 5xx's traceback from."""

    def log_size(self) -> int:
        path = self.stack.logs / "server.log"
        return path.stat().st_size if path.exists() else 0

    def wait_log(self, offset: int, timeout_s: float = 3.0) -> str:
        """What the server logged from byte ``offset`` on: once its access line for a 5xx is there (or after
        ``timeout_s``), and then the traceback after it, until the log stops growing."""
        deadline = time.monotonic() + timeout_s
        seen = ""
        while time.monotonic() < deadline:
            logged = self.stack.log("server").encode()[offset:].decode(errors="replace")
            if '" 5' in logged and logged == seen:
                break
            seen = logged
            time.sleep(0.2)
        return seen


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    # its own vhost and key prefix; an orchestrator and a worker
    with serving("api-fuzz", (Role.ADMIN, Role.VIEWER), token_name="fuzz-{role}") as served:
        server = Server(served.stack, served.base, served.tokens)
        document = httpx.get(server.base + OPENAPI, timeout=10)
        assert document.status_code == 200 and document.json() == DOCUMENT, "the server serves another one"
        seed(server)
        yield server


def seed(server: Server) -> None:
    """A completed, a failed and a running run, and two dead letters on the rejected queue."""
    stack = server.stack
    stack.world.set_fault("fuzz-failed", "thumbnail.render", fail=True)
    stack.world.set_fault("fuzz-running", "thumbnail.render", delay_ms=600_000)
    for key in ("fuzz-done", "fuzz-failed", "fuzz-running"):
        start = {"definition": "model-ingest", "context": {"modelId": key}, "idempotency_key": key}
        started = httpx.post(
            server.base + "/api/v1/runs", json=start, headers=server.headers(Role.ADMIN), timeout=30
        )
        assert started.status_code == 202 and started.json()["run_id"] == _run_id(key), started.text

    async def park() -> None:
        connection = await connect_once(stack.settings.amqp_url)
        try:
            channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
            publisher = Publisher(channel, stack.signer, NAMES)
            await publisher.reject(b"\xff\x00 not json", "malformed", "fuzz", "tests", message_id=GARBAGE)
            body = b'{"kind": "start", "run_id": "x", "payload": [1, {"a": null}]}'
            await publisher.reject(body, "bad_signature", "fuzz", "tests", message_id=REFUSED)
        finally:
            await connection.close()

    asyncio.run(park())
    for run_id, state in ((DONE, "completed"), (FAILED, "failed"), (RUNNING, "running")):
        poll(partial(has_status, stack, run_id, state), 60, what=f"run {run_id} {state}")


def has_status(stack: Stack, run_id: str, state: str) -> bool:
    return stack.record(run_id).get("status") == state


def call_and_check(case: schemathesis.Case[Any], server: Server, role: Role) -> None:
    """Send ``case`` as ``role`` and run the checks; a failure prints what the server logged of it."""
    headers = server.headers(role)
    offset = server.log_size()
    try:
        if case.path.endswith("/events"):
            check_stream(case, server, headers)
        else:
            case.body = unmark(case.body)
            response = case.call(base_url=server.base, headers=headers)
            case.validate_response(response, checks=CHECKS, headers=headers)
    except BaseException:  # schemathesis.core.failures.FailureGroup is one, not an Exception
        trace = condensed(server.wait_log(offset))
        seen = (case.operation.label, role, trace)
        if trace and seen not in SHOWN:  # once per test and traceback; pytest shows it with the failure
            SHOWN.add(seen)
            print(f"{case.operation.label} as {role.value}: the server's traceback\n{trace}")
        raise


SHOWN: set[tuple[str, Role, str]] = set()


def condensed(log: str) -> str:
    """A server traceback in ``log``: its frames in the project's code and the exceptions it ends with
    (uvicorn's and Starlette's frames left out); empty without one."""
    if "Traceback" not in log:
        return ""
    lines = log.splitlines()
    kept = []
    for i, line in enumerate(lines):
        if str(ROOT / "orchestrator") in line:
            kept += [line, *lines[i + 1 : i + 2]]
        elif line and not line[0].isspace() and not line.startswith("INFO:") and "Error" in line:
            kept.append(line)
    return "\n".join(kept)


def unmark(value: Any) -> Any:
    """``value`` with SURROGATE's marker swapped for the lone surrogate, in every string in it."""
    if isinstance(value, str):
        return value.replace(*SURROGATE)
    if isinstance(value, list):
        return [unmark(v) for v in value]
    if isinstance(value, dict):
        return {unmark(k): unmark(v) for k, v in value.items()}
    return value


def check_stream(case: schemathesis.Case[Any], server: Server, headers: dict[str, str]) -> None:
    """A server-sent-events stream runs for minutes: its status and first bytes only, then hang up (the
    document declares no media type for it, so there is no schema to check it against)."""
    kwargs = case.as_transport_kwargs(base_url=server.base, headers=headers)
    with requests.request(**kwargs, stream=True, timeout=10) as response:
        first = next(response.iter_content(64), b"") if response.status_code == 200 else b""
        status, media_type = response.status_code, response.headers.get("content-type", "")
    curl = case.as_curl_command(headers, base_url=server.base)
    assert status < 500, f"{status} from {curl}"
    # the status must be declared, as status_code_conformance checks, which skips the same probes (an
    # undeclared method, TRACE say, answered 405 by the framework)
    declared = case.operation.responses.status_codes
    if not is_unexpected_http_status_case(case):
        assert str(status) in declared, f"{status} (declared: {', '.join(declared)}) from {curl}"
    if status == 200:
        assert media_type.startswith("text/event-stream") and first.startswith(b"retry:"), (media_type, first)


# Neither creates broker objects nor revokes a token nor takes dead letters away: not shards
# add/drain/retire, token revocation, dead-letter replay or purge.
admin_operations = schema.exclude(method="POST", path_regex=r"^/api/v1/shards").exclude(
    method="POST", path_regex=r"^/api/v1/(tokens/[^/]+/revoke|dead-letters/(replay|purge))$"
)


@admin_operations.parametrize()
def test_no_operation_answers_an_admin_with_a_server_error_or_off_its_schema(
    case: schemathesis.Case[Any], server: Server
) -> None:
    call_and_check(case, server, Role.ADMIN)


@schema.include(method="GET").parametrize()
def test_no_read_answers_a_viewer_with_a_server_error_or_off_its_schema(
    case: schemathesis.Case[Any], server: Server
) -> None:
    call_and_check(case, server, Role.VIEWER)

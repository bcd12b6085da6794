"""Process logging (``orchestrator/logs.py``): binding ids to a context, the filter that copies them onto
records, and the text and JSON formats."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any, cast

import pytest

from orchestrator import logs
from orchestrator.bus.envelope import Envelope
from orchestrator.settings import Settings
from orchestrator.wire.kinds import Kind
from workers.runtime import _in_thread
from workers.sdk import Handler

ISO_UTC = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


def capture(formatter: logging.Formatter) -> tuple[logging.Logger, io.StringIO]:
    """A logger of its own writing through ``formatter`` and the context filter into a buffer."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(formatter)
    handler.addFilter(logs.ContextFilter())
    logger = logging.getLogger(f"saga.test.{id(out)}")
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    return logger, out


def json_lines(out: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


@pytest.fixture
def root_logging() -> Iterator[None]:
    """configure() replaces the root logger's handlers: put pytest's back after."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    for handler in root.handlers:
        if handler not in handlers:
            handler.close()
    root.handlers[:] = handlers
    root.setLevel(level)
    logging.captureWarnings(False)


# ---- binding -------------------------------------------------------------------------------------------


def test_log_context_binds_merges_and_restores() -> None:
    assert dict(logs.bound()) == {}
    with logs.log_context(shard="fast.0"):
        with logs.log_context(run_id="run-1", stage="publish", attempt=2, shard=""):
            # "" and None leave an id as it was: a start message names no shard
            assert dict(logs.bound()) == {
                "shard": "fast.0",
                "run_id": "run-1",
                "stage": "publish",
                "attempt": 2,
            }
        assert dict(logs.bound()) == {"shard": "fast.0"}
    assert dict(logs.bound()) == {}


def test_log_context_refuses_unknown_ids() -> None:
    with pytest.raises(TypeError, match="run"), logs.log_context(run="run-1"):
        pass


def test_bind_in_a_task_ends_with_the_task() -> None:
    seen: dict[str, Any] = {}

    async def handle() -> None:
        logs.bind(run_id="run-9", message_id="m-1")
        await asyncio.sleep(0)
        seen.update(logs.bound())

    async def main() -> None:
        with logs.log_context(shard="slow.3"):
            await asyncio.create_task(handle())
            assert dict(logs.bound()) == {"shard": "slow.3"}  # the task's binding stayed in the task

    asyncio.run(main())
    assert seen == {"shard": "slow.3", "run_id": "run-9", "message_id": "m-1"}


def test_envelope_ids() -> None:
    envelope = Envelope(
        kind=Kind.RESULT, message_id="result-1", run_id="run-1", shard="fast.1", stage="publish", attempt=3
    )
    assert logs.envelope_ids(envelope) == {
        "run_id": "run-1",
        "stage": "publish",
        "attempt": 3,
        "shard": "fast.1",
        "message_id": "result-1",
    }
    assert logs.envelope_ids(None) == {}


def test_a_thread_pool_handler_runs_in_its_tasks_context() -> None:
    def plain(payload: Any) -> dict[str, Any]:  # a plain handler: the worker runs it in a thread
        return dict(logs.bound())

    handler = cast(Handler, SimpleNamespace(is_async=False, wants_context=False, function=plain))

    async def task() -> Any:
        logs.bind(run_id="run-1", stage="render")
        return await _in_thread(handler, (None,), pool, lambda: None)

    with ThreadPoolExecutor(1) as pool:
        assert asyncio.run(task()) == {"run_id": "run-1", "stage": "render"}


# ---- JSON ---------------------------------------------------------------------------------------------


def test_json_record_has_time_level_logger_message_and_only_the_known_ids() -> None:
    logger, out = capture(logs.JsonFormatter())
    logger.warning("no ids here")
    with logs.log_context(run_id="run-1", shard="fast.0"):
        logger.info("task %s of run %s failed", "publish", "run-1")
    plain, bound = json_lines(out)
    assert set(plain) == {"time", "level", "logger", "message"}
    assert plain["level"] == "WARNING" and plain["logger"] == logger.name
    assert ISO_UTC.match(plain["time"]), plain["time"]
    assert bound == {
        "time": bound["time"],
        "level": "INFO",
        "logger": logger.name,
        "message": "task publish of run run-1 failed",
        "run_id": "run-1",
        "shard": "fast.0",
    }
    assert next(iter(bound)) == "time"


def test_json_record_formats_exc_info_and_keeps_extra() -> None:
    logger, out = capture(logs.JsonFormatter())
    with logs.log_context(run_id="run-1"):
        try:
            raise ValueError("boom é")
        except ValueError:
            logger.exception("transition failed", extra={"run_id": "given", "batch": 3})
    [record] = json_lines(out)
    assert record["level"] == "ERROR"
    assert record["run_id"] == "given"  # what the call passed wins over the bound id
    assert record["batch"] == 3
    assert "Traceback" in record["exc_info"] and "ValueError: boom é" in record["exc_info"]
    assert "\n" not in out.getvalue().rstrip("\n")  # one line per record, the traceback included


# ---- text ---------------------------------------------------------------------------------------------


def test_text_keeps_todays_line_and_appends_the_known_ids() -> None:
    logger, out = capture(logs.TextFormatter())
    logger.warning("plain")
    with logs.log_context(run_id="run-1", stage="publish", attempt=1, shard="fast.0", message_id="m-1"):
        logger.info("bound")
    plain, bound = out.getvalue().splitlines()
    assert re.match(rf"^\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d,\d{{3}} WARNING {logger.name}: plain$", plain)
    assert bound.endswith(
        f"INFO {logger.name}: bound [run=run-1 stage=publish attempt=1 shard=fast.0 message=m-1]"
    )


def test_text_puts_the_ids_before_the_traceback() -> None:
    logger, out = capture(logs.TextFormatter())
    with logs.log_context(run_id="run-1"):
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            logger.exception("failed")
    first, *rest = out.getvalue().splitlines()
    assert first.endswith("failed [run=run-1]")
    assert rest[0].startswith("Traceback") and rest[-1] == "RuntimeError: boom"


# ---- configure and announce ---------------------------------------------------------------------------


def test_configure_json_logs_every_record_as_json(
    root_logging: None, capsys: pytest.CaptureFixture[str]
) -> None:
    logs.configure(Settings(log_format="json"), verbose=False)
    with logs.log_context(shard="fast.2"):
        logging.getLogger("orchestrator.test").info("dropped: below WARNING without -v")
        logging.getLogger("orchestrator.test").warning("kept")
        logs.announce(Settings(log_format="json"), logging.getLogger("orchestrator.cli"), "worker serving x")
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert [(r["level"], r["message"], r["shard"]) for r in lines] == [
        ("WARNING", "kept", "fast.2"),
        ("INFO", "worker serving x", "fast.2"),  # shown whatever the level, as it was
    ]


def test_configure_unset_is_text(root_logging: None, capsys: pytest.CaptureFixture[str]) -> None:
    settings = Settings(log_format=None)
    logs.configure(settings, verbose=True)
    logging.getLogger("orchestrator.test").info("hello")
    logs.announce(settings, logging.getLogger("orchestrator.cli"), "orchestrator serving x")
    err = capsys.readouterr().err.splitlines()
    assert err[0].endswith(" INFO orchestrator.test: hello")
    assert err[1] == "orchestrator serving x"  # the plain start-up line of today

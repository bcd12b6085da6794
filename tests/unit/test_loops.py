"""The services' event loop: uvloop where it is installed, asyncio's own on request or without it."""

from __future__ import annotations

import asyncio
import sys

import pytest
from pydantic import ValidationError

from orchestrator import loops
from orchestrator.settings import Settings


def _ran_on(choice: loops.EventLoopChoice) -> str:
    """The module of the loop a coroutine run for ``choice`` ran on."""
    seen: list[str] = []

    async def main() -> None:
        seen.append(type(asyncio.get_running_loop()).__module__)

    loops.run(main(), loops.loop_factory(choice))
    return seen[0]


def test_auto_and_uvloop_run_on_uvloop_where_it_is_installed() -> None:
    pytest.importorskip("uvloop")
    assert _ran_on("auto").startswith("uvloop")
    assert _ran_on("uvloop").startswith("uvloop")
    assert loops.uvicorn_loop(loops.loop_factory("auto")) == "uvloop"


def test_asyncio_runs_on_the_standard_library_loop() -> None:
    assert loops.loop_factory("asyncio") is None
    assert _ran_on("asyncio").startswith("asyncio")
    assert loops.uvicorn_loop(None) == "asyncio"


def test_without_uvloop_auto_falls_back_and_uvloop_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop raises ImportError
    assert loops.loop_factory("auto") is None
    assert _ran_on("auto").startswith("asyncio")
    with pytest.raises(loops.EventLoopUnavailable, match=r"SAGA_EVENT_LOOP=uvloop.*SAGA_EVENT_LOOP=auto"):
        loops.loop_factory("uvloop")


def test_the_setting_takes_only_known_loops(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SAGA_EVENT_LOOP", raising=False)
    assert Settings().event_loop == "auto"
    monkeypatch.setenv("SAGA_EVENT_LOOP", "asyncio")
    assert Settings().event_loop == "asyncio"
    monkeypatch.setenv("SAGA_EVENT_LOOP", "trio")
    with pytest.raises(ValidationError, match="event_loop"):
        Settings()

"""The services' event loop: uvloop where it is installed, asyncio's own on request or without it."""

from __future__ import annotations

import asyncio
import sys
import warnings

import pytest
from pydantic import ValidationError

from orchestrator import loops
from orchestrator.settings import Settings


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def _ran_on(choice: loops.EventLoopChoice) -> str:
    seen: list[str] = []

    async def main() -> None:
        seen.append(await _loop_module())

    loops.run(main(), choice)
    return seen[0]


def test_auto_and_uvloop_run_on_uvloop_where_it_is_installed() -> None:
    pytest.importorskip("uvloop")
    assert _ran_on("auto").startswith("uvloop")
    assert _ran_on("uvloop").startswith("uvloop")


def test_asyncio_runs_on_the_standard_library_loop() -> None:
    assert loops.loop_factory("asyncio") is None
    assert _ran_on("asyncio").startswith("asyncio")


def test_without_uvloop_auto_falls_back_and_uvloop_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop raises ImportError
    assert loops.loop_factory("auto") is None
    assert _ran_on("auto").startswith("asyncio")

    async def never() -> None:
        raise AssertionError("a refused loop must not run its coroutine")

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "coroutine was never awaited" would be a RuntimeWarning
        with pytest.raises(loops.EventLoopUnavailable, match=r"SAGA_EVENT_LOOP=uvloop.*SAGA_EVENT_LOOP=auto"):
            loops.run(never(), "uvloop")


def test_the_setting_takes_only_known_loops(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings().event_loop == "auto"
    monkeypatch.setenv("SAGA_EVENT_LOOP", "asyncio")
    assert Settings().event_loop == "asyncio"
    monkeypatch.setenv("SAGA_EVENT_LOOP", "trio")
    with pytest.raises(ValidationError, match="event_loop"):
        Settings()

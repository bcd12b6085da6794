"""The web console in a real browser: ``saga server`` as a process beside an orchestrator and a worker on
the real services, a token of every role, and Debian's chromium driven by Playwright. Screenshots of each
page are kept under ``.artifacts/console/``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from playwright.sync_api import Browser, BrowserContext, ConsoleMessage, Page, sync_playwright

from orchestrator.auth.roles import Role
from tests.integration.served import serving
from tests.integration.stack import ROOT, Stack

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = ROOT / ".artifacts" / "console"
T = TypeVar("T")


@dataclass
class Console:
    """The stack, the server's address, a token per role and the browser."""

    stack: Stack
    base: str
    browser: Browser
    tokens: dict[Role, str] = field(default_factory=dict)
    contexts: list[BrowserContext] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # script errors and policy violations in any page

    def api(self, method: str, path: str, role: Role = Role.OPERATOR, **kwargs: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.tokens[role]}"}
        return httpx.request(method, self.base + path, headers=headers, timeout=30, **kwargs)

    def start(self, model_id: str, faults: dict[str, dict[str, Any]] | None = None) -> str:
        """Start a model-ingest run for ``model_id``, after setting ``faults`` (contract -> set_fault's
        options) for it."""
        for contract, options in (faults or {}).items():
            self.stack.world.set_fault(model_id, contract, **options)
        started = self.api(
            "POST", "/api/v1/runs", json={"definition": "model-ingest", "context": {"modelId": model_id}}
        )
        assert started.status_code == 202, started.text
        return str(started.json()["run_id"])

    def state(self, run_id: str) -> dict[str, Any]:
        return self.api("GET", f"/api/v1/runs/{run_id}", Role.VIEWER).json()  # type: ignore[no-any-return]

    def context(self) -> BrowserContext:
        context = self.browser.new_context(base_url=self.base, viewport={"width": 1400, "height": 1000})
        context.on("weberror", lambda e: self.errors.append(f"uncaught: {e.error}"))
        context.on("console", self._console_message)
        self.contexts.append(context)
        return context

    def _console_message(self, message: ConsoleMessage) -> None:
        # an answer of 4xx is logged as "Failed to load resource" too: the tests look at those themselves
        if message.type == "error" and "Failed to load resource" not in message.text:
            self.errors.append(message.text)

    def sign_in(self, role: Role) -> Page:
        """A new browser context signed in through the sign-in page with the token of ``role``."""
        page = self.context().new_page()
        page.goto("/console/runs")
        page.wait_for_url("**/console/sign-in?next=*")
        page.fill("#token", self.tokens[role])
        page.click("#sign-in-form button[type=submit]")
        page.wait_for_url("**/console/runs")
        return page


def snapshot(page: Page, name: str) -> Path:
    """Keep a screenshot of the page as a test artefact."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path


@pytest.fixture(scope="package")
def console() -> Iterator[Console]:
    # the tokens are made before Playwright starts: its sync API keeps an event loop running in this thread
    with serving("console", token_name="{role}-console") as served, sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            yield Console(served.stack, served.base, browser, served.tokens)
        finally:
            browser.close()


def off_loop(call: Callable[[], T]) -> T:
    """Run ``call`` (which may use asyncio.run) on a thread of its own: Playwright's sync API keeps an
    event loop running in the test's thread."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(call).result()


@pytest.fixture(autouse=True)
def _close_contexts(console: Console) -> Iterator[None]:
    """Each test's browser contexts are closed after it (their event streams with them), and no page had
    a script error or refused something the content security policy forbids."""
    yield
    while console.contexts:
        console.contexts.pop().close()
    errors, console.errors[:] = list(console.errors), []
    assert errors == []

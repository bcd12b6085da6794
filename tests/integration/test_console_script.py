"""``make console`` (scripts/console.py): from a prepared environment to a served console with runs to
look at, an admin token printed once, and every process it started stopped by Ctrl-C."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from tests.integration.own_redis import free_port
from tests.integration.stack import ROOT, Stack, poll

pytestmark = pytest.mark.services

RUNS = 3


@pytest.fixture
def stack() -> Iterator[Stack]:
    stack = Stack("console-script")
    stack.setup()
    try:
        yield stack
    finally:
        stack.teardown()


def test_make_console_serves_runs_to_look_at_and_stops_everything_on_ctrl_c(stack: Stack) -> None:
    port = free_port()
    env = {**stack.env, "SAGA_DEMO_LOGS": str(stack.logs)}
    script = subprocess.Popen(
        [sys.executable, "scripts/console.py", "--port", str(port), "--runs", str(RUNS)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        # It prints where to sign in and a token, once everything is up
        lines: list[str] = []
        assert script.stdout is not None
        for line in script.stdout:
            lines.append(line)
            if "Ctrl-C" in line:
                break
        printed = "".join(lines)
        assert f"console:  http://127.0.0.1:{port}/" in printed, printed
        token = re.search(r"token:\s+(saga_\S+)", printed)
        assert token is not None, printed
        headers = {"Authorization": f"Bearer {token.group(1)}"}
        base = f"http://127.0.0.1:{port}"

        # The token is an admin's, and the console's first page is served
        me = httpx.get(f"{base}/api/v1/whoami", headers=headers, timeout=10).json()
        assert me["role"] == "admin", me
        assert httpx.get(f"{base}/console/sign-in", timeout=10).status_code == 200

        # And the runs it started are there: the last one fails, the one before it still runs
        def runs() -> list[dict[str, object]]:
            answer = httpx.get(f"{base}/api/v1/runs", headers=headers, timeout=10).json()
            return list(answer["runs"])

        poll(lambda: len(runs()) == RUNS, 30, what=f"{RUNS} runs listed")
        poll(
            lambda: sorted(str(r["state"]) for r in runs()) == ["completed", "failed", "running"],
            60,
            what="one run completed, one failed, one still running",
        )
    finally:
        # Ctrl-C stops the script and every process it started
        script.send_signal(signal.SIGINT)
        script.wait(timeout=60)
    assert script.returncode == 0
    # with nothing left of what it started: no server answering, no consumer on any queue
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
    poll(lambda: not any(stack.list_queues("consumers").values()), 15, what="no consumer left")

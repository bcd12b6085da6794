"""The README's "Your first workflow" works as written: its files and its commands are taken from the README
itself and run, in a directory laid out like a fresh clone, against a vhost and key prefix of their own."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.stack import ROOT, Stack

pytestmark = pytest.mark.services

README = ROOT / "README.md"
MARKER = "<!-- first-workflow -->"


def section() -> str:
    text = README.read_text()
    start = text.index("## Your first workflow")
    return text[start : text.index("\n## ", start + 1)]


def files_of(text: str) -> dict[str, str]:
    """`path`: followed by a fenced block, as the section introduces each file."""
    found = re.findall(r"^`([\w/.]+)`:\n\n```\w+\n(.*?)```", text, flags=re.M | re.S)
    return dict(found)


def commands_of(text: str) -> list[str]:
    block = text[text.index(MARKER) :]
    body = block[block.index("```console\n") + len("```console\n") :]
    lines = body[: body.index("```")].splitlines()
    return [line.removeprefix("$ ") for line in lines if line.startswith("$ ")]


@pytest.fixture
def stack() -> Iterator[Stack]:
    s = Stack("first-workflow")
    s.setup()
    try:
        yield s
    finally:
        s.teardown()


def test_the_readme_walk_through_runs_as_written(stack: Stack, tmp_path: Path) -> None:
    text = section()
    files = files_of(text)
    assert set(files) == {"myflow/tasks.py", "myflow/greeting.yaml"}, files
    (tmp_path / "myflow").mkdir()
    (tmp_path / "myflow" / "__init__.py").write_text("")
    for name, content in files.items():
        (tmp_path / name).write_text(content)
    for shared in (".venv", "definitions"):  # what a clone has beside the user's own package
        (tmp_path / shared).symlink_to(ROOT / shared)
    commands = commands_of(text)
    assert commands[-2].startswith("saga start greeting")

    script = "\n".join(
        [
            "set -euo pipefail",
            "trap 'kill $(jobs -p) 2>/dev/null; wait' EXIT",
            *commands,
        ]
    )
    env = {k: v for k, v in stack.env.items() if not k.startswith("PYTHON") or k == "PYTHONUNBUFFERED"}
    done = subprocess.run(  # the exit code is asserted below, with what was said
        ["bash", "-c", script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    said = f"{done.stdout}\n{done.stderr}"
    assert done.returncode == 0, said
    assert "1 of 1 definitions valid" in said
    assert "HELLO, ADA!" in done.stdout
    assert done.stdout.count("state=completed") == 2, said

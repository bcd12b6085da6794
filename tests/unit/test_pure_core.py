"""Invariant 9: the engine and the compiler read no clock, random or uuid and do no I/O.

Checked on the source: neither package may import a module that reads time, randomness or the
environment, or talks to the network or the file system. (Their determinism is checked by replaying
the same events: tests/unit/test_engine_properties.py.)
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PURE_PACKAGES = ("orchestrator/engine", "orchestrator/compiler", "orchestrator/dsl")
FORBIDDEN = {
    "time", "datetime", "random", "secrets", "uuid", "os", "socket", "asyncio", "subprocess", "pathlib",
    "redis", "aio_pika", "aiormq", "pika", "requests", "httpx", "urllib", "shutil", "tempfile",
    "orchestrator.store.redis_store", "orchestrator.shard", "orchestrator.bus", "orchestrator.client",
}  # fmt: skip


def pure_sources() -> list[Path]:
    return sorted(p for package in PURE_PACKAGES for p in (ROOT / package).rglob("*.py"))


def imported_modules(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def test_there_are_pure_sources_to_check() -> None:
    assert len(pure_sources()) >= 15


@pytest.mark.parametrize("path", pure_sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_pure_module_imports_nothing_that_reads_the_world(path: Path) -> None:
    bad = {
        module
        for module in imported_modules(path)
        if any(module == f or module.startswith(f + ".") for f in FORBIDDEN)
    }
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}: pass time, ids and I/O in instead"

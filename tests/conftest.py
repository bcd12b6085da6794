"""Shared helpers for compiler tests: the demo registry and one-call compile helpers."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from orchestrator.compiler import AdmissionLimits, CompiledPlan, compile_text
from orchestrator.contracts import Registry
from orchestrator.errors import DefinitionError, Problem

ROOT = Path(__file__).resolve().parent.parent
DEFINITIONS = ROOT / "definitions"
DEMO_REGISTRY = Registry.from_modules(["workers.demo"])


@pytest.fixture(scope="session")
def registry() -> Registry:
    return DEMO_REGISTRY


def compile_yaml(text: str, limits: AdmissionLimits | None = None, file: str = "test.yaml") -> CompiledPlan:
    """Compile YAML written inline in a test (dedented)."""
    return compile_text(textwrap.dedent(text), file, DEMO_REGISTRY, limits)


def problems_of(text: str, limits: AdmissionLimits | None = None) -> list[Problem]:
    """The problems a definition is rejected with; fails the test if it compiles."""
    try:
        compile_yaml(text, limits)
    except DefinitionError as exc:
        return exc.problems
    pytest.fail("definition compiled, but it should have been rejected")

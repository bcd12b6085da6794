"""Collects problems during compilation, each located by its path in the definition."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from orchestrator.dsl.paths import Path, render_path
from orchestrator.dsl.yaml_source import SourceMap
from orchestrator.errors import DefinitionError, Problem


@dataclass
class Reporter:
    """Gathers every problem so the compiler can raise once with all of them (collect, then raise)."""

    source: SourceMap
    raw: Any = None  # the loaded data, used to name the stage a path points into
    problems: list[Problem] = field(default_factory=list)

    def add(self, path: Path, message: str) -> None:
        stage = self._stage_name(path)
        text = f"stage {stage!r}: {message}" if stage else message
        self.problems.append(Problem(self.source.file, self.source.line_for(path), render_path(path), text))

    def raise_if_any(self) -> None:
        if self.problems:
            raise DefinitionError(self.problems)

    def _stage_name(self, path: Path) -> str | None:
        if len(path) < 2 or path[0] != "stages" or not isinstance(path[1], int):
            return None
        stages = self.raw.get("stages") if isinstance(self.raw, dict) else None
        if not isinstance(stages, list) or path[1] >= len(stages) or not isinstance(stages[path[1]], dict):
            return None
        name = stages[path[1]].get("name")
        return name if isinstance(name, str) else None

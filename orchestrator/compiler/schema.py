"""Layer 1, shape: validate loaded data into :class:`Definition`, translating pydantic's errors into
problems that name the field, what was expected and what to do."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from orchestrator.compiler.report import Reporter
from orchestrator.dsl.models import (
    STAGE_MODELS,
    STAGE_TYPES,
    DecisionBranch,
    DecisionStage,
    Definition,
    RetryPolicy,
    TerminalPolicy,
)
from orchestrator.dsl.paths import Path


def validate_shape(data: Any, report: Reporter) -> Definition | None:
    if not isinstance(data, dict):
        report.add(
            (),
            f"a definition is a mapping of fields (name, version, entry, stages, ...), "
            f"not a {type(data).__name__}",
        )
        return None
    try:
        return Definition.model_validate(data)
    except ValidationError as exc:
        for error in exc.errors(include_url=False):
            path, message = _translate(error, data)
            report.add(path, message)
        return None


def _strip_union_tags(loc: tuple[int | str, ...]) -> Path:
    """pydantic puts the discriminator value in the location (stages.0.worker.queue); readers never
    wrote it, so drop it."""
    out: list[int | str] = []
    for i, part in enumerate(loc):
        if part in STAGE_TYPES and i >= 2 and loc[i - 2] == "stages" and isinstance(loc[i - 1], int):
            continue
        out.append(part)
    return tuple(out)


def _model_at(path: Path, data: Any) -> type[BaseModel] | None:
    """The model that validates the mapping at ``path``, for listing its fields."""
    if path == ():
        return Definition
    if path == ("terminal_policy",):
        return TerminalPolicy
    if len(path) < 2 or path[0] != "stages" or not isinstance(path[1], int):
        return None
    stages = data.get("stages")
    stage = stages[path[1]] if isinstance(stages, list) and path[1] < len(stages) else None
    kind = stage.get("type") if isinstance(stage, dict) else None
    model = STAGE_MODELS.get(kind) if isinstance(kind, str) else None
    rest = path[2:]
    if rest == ():
        return model
    if rest == ("retry",):
        return RetryPolicy
    if len(rest) == 2 and rest[0] == "branches" and model is DecisionStage:
        return DecisionBranch
    return None


def _allowed_fields(path: Path, data: Any) -> list[str]:
    model = _model_at(path, data)
    return sorted(f.alias or n for n, f in model.model_fields.items()) if model else []


def _translate(error: ErrorDetails, data: Any) -> tuple[Path, str]:
    path = _strip_union_tags(error["loc"])
    kind = error["type"]
    if kind == "missing":
        return path[:-1], f"missing required field {path[-1]!r}"
    if kind == "extra_forbidden":
        allowed = _allowed_fields(path[:-1], data)
        hint = f" (allowed: {', '.join(allowed)})" if allowed else ""
        return path, f"unknown field {path[-1]!r}{hint}"
    if kind == "union_tag_invalid":
        tag = error.get("ctx", {}).get("tag")
        return (*path, "type"), f"unknown stage type {tag!r}; expected one of {', '.join(STAGE_TYPES)}"
    if kind == "union_tag_not_found":
        return path, f"stage has no 'type'; expected one of {', '.join(STAGE_TYPES)}"
    if kind == "string_type" and isinstance(error.get("input"), int | float):
        return path, f"must be a string, got {error['input']!r}; quote it in YAML"
    if kind == "string_pattern_mismatch":
        return path, f"{error['input']!r} is not valid here: {_pattern_hint(path)}"
    return path, f"{error['msg']} (got {_short(error.get('input'))})"


def _pattern_hint(path: Path) -> str:
    last = next((p for p in reversed(path) if isinstance(p, str)), "")
    if last in {"action", "worker", "compensate", "finalisers"}:
        return "a contract reference is written name@version, e.g. cache.lookup@1"
    if last == "class":
        return "a shard class is lowercase letters, digits, '-' or '_', e.g. fast"
    return "names are lowercase letters, digits, '-' or '_', starting with a letter, at most 64 characters"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."

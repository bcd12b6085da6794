"""Admission limits: the bounds a definition must stay within. Every one is configurable (see
``orchestrator.settings``); the defaults are safe for a shared control plane."""

from __future__ import annotations

from dataclasses import dataclass, field

from orchestrator.dsl.expressions import ExpressionLimits
from orchestrator.dsl.yaml_source import YamlLimits

DAY_MS = 86_400_000


@dataclass(frozen=True)
class AdmissionLimits:
    max_stages: int = 200
    max_fork_branches: int = 32
    max_map_items: int = 10_000
    max_attempts: int = 10
    max_backoff_ms: int = DAY_MS
    max_stage_deadline_ms: int = DAY_MS
    max_run_deadline_ms: int = 30 * DAY_MS
    max_input_bytes: int = 65_536
    max_finalisers: int = 16
    shard_classes: tuple[str, ...] = ("fast", "slow")
    expressions: ExpressionLimits = field(default_factory=ExpressionLimits)
    yaml: YamlLimits = field(default_factory=YamlLimits)

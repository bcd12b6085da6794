"""Admission bounds (part of layer 1): fan-out, map size, retries, deadlines, payload size, finalisers,
and the shard class. Expression bounds are applied where expressions are compiled (contract layer)."""

from __future__ import annotations

import json

from orchestrator.compiler.limits import AdmissionLimits
from orchestrator.compiler.report import Reporter
from orchestrator.dsl.models import Definition, ForkStage, MapStage, WorkStage
from orchestrator.dsl.paths import Path


def check_admission(defn: Definition, limits: AdmissionLimits, report: Reporter) -> None:
    _at_most(report, ("stages",), len(defn.stages), limits.max_stages, "stages")
    _at_most(report, ("finalisers",), len(defn.finalisers), limits.max_finalisers, "finalisers")
    _at_most(
        report, ("run_deadline_ms",), defn.run_deadline_ms, limits.max_run_deadline_ms, "run_deadline_ms"
    )
    if defn.shard_class not in limits.shard_classes:
        report.add(
            ("class",),
            f"shard class {defn.shard_class!r} is not configured "
            f"(configured: {', '.join(limits.shard_classes)}); set SAGA_SHARD_CLASSES to add it",
        )
    for i, stage in enumerate(defn.stages):
        base: Path = ("stages", i)
        if isinstance(stage, ForkStage):
            _at_most(
                report, (*base, "branches"), len(stage.branches), limits.max_fork_branches, "fork branches"
            )
        if isinstance(stage, MapStage):
            _at_most(report, (*base, "max_items"), stage.max_items, limits.max_map_items, "max_items")
        if isinstance(stage, WorkStage):
            _check_work_stage(stage, base, limits, report)


def _check_work_stage(stage: WorkStage, base: Path, limits: AdmissionLimits, report: Reporter) -> None:
    retry = stage.retry
    _at_most(
        report, (*base, "retry", "max_attempts"), retry.max_attempts, limits.max_attempts, "max_attempts"
    )
    _at_most(
        report,
        (*base, "retry", "max_backoff_ms"),
        retry.max_backoff_ms,
        limits.max_backoff_ms,
        "max_backoff_ms",
    )
    if retry.initial_backoff_ms > retry.max_backoff_ms:
        report.add(
            (*base, "retry", "initial_backoff_ms"),
            f"initial_backoff_ms ({retry.initial_backoff_ms}) exceeds "
            f"max_backoff_ms ({retry.max_backoff_ms})",
        )
    for name in ("queue_deadline_ms", "execution_deadline_ms", "heartbeat_timeout_ms"):
        _at_most(report, (*base, name), getattr(stage, name), limits.max_stage_deadline_ms, name)
    if (
        stage.heartbeat_timeout_ms
        and stage.execution_deadline_ms
        and stage.heartbeat_timeout_ms > stage.execution_deadline_ms
    ):
        report.add(
            (*base, "heartbeat_timeout_ms"),
            "heartbeat_timeout_ms exceeds execution_deadline_ms, so it could never fire",
        )
    size = len(json.dumps(stage.input, separators=(",", ":")).encode())
    _at_most(report, (*base, "input"), size, limits.max_input_bytes, "input bytes")


def _at_most(report: Reporter, path: Path, value: int | None, limit: int, what: str) -> None:
    if value is not None and value > limit:
        report.add(path, f"{value} {what} is over the admission limit of {limit}")

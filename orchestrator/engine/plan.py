"""The compiled plan as the engine reads it: frozen, typed stage objects. Pure.

A plan is stored as canonical JSON (its digest is taken over those bytes) and read back as a mapping;
``typed_plan`` turns that mapping into these objects once per digest (the store caches them), so a
transition reads ``stage.retry.max_attempts`` rather than walking dictionaries, and what is derived from
the plan (a fork's join, a stage's attempt clocks, the contract a stage calls) is worked out once.

The templates, CEL expressions and JSON Schemas inside stay as the JSON they were compiled to: they are
handed to the binding and schema code as they are. A plan of an earlier format lacks fields the compiler
now fills in: they take the defaults the compiler gives.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from orchestrator.engine.model import Clock

# The stage fields that start each attempt clock (unset: the stage has no such clock).
ATTEMPT_CLOCK_FIELDS = {
    Clock.QUEUE: "queue_deadline_ms",
    Clock.EXECUTION: "execution_deadline_ms",
    Clock.HEARTBEAT: "heartbeat_timeout_ms",
}


class PlanShapeError(ValueError):
    """A stored plan that is not one the engine can run (a stage of an unknown type, a field missing)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Retry:
    max_attempts: int = 1
    initial_backoff_ms: int = 1_000
    backoff_multiplier: float = 2.0
    max_backoff_ms: int = 60_000
    jitter: float = 0.1


@dataclass(frozen=True, slots=True, kw_only=True)
class BranchEnd:
    """Where a fork branch's last stage arrives: its join, and the branch it ends."""

    join: str
    branch: str


@dataclass(frozen=True, slots=True, kw_only=True)
class StagePlan:
    name: str
    type: str  # action, worker, map, decision, fork, join
    arrives_at: BranchEnd | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Work(StagePlan):
    """An action or worker stage: a task on ``queue`` for the contract ``contract`` (``name@version``)."""

    contract: str
    queue: str
    input: Any
    retry: Retry
    on_success: str
    on_failure: str
    queue_deadline_ms: int | None = None
    execution_deadline_ms: int | None = None
    heartbeat_timeout_ms: int | None = None
    compensate: str | None = None
    clocks: tuple[Clock, ...] = ()  # the attempt clocks its deadlines start
    needs_acceptance: bool = False  # its worker reports acceptance and heartbeats (reports_acceptance)

    def deadline_ms(self, clock: Clock) -> int | None:
        """The limit an attempt clock of this stage counts down (None: the stage has no such clock)."""
        limit: int | None = getattr(self, ATTEMPT_CLOCK_FIELDS[clock])
        return limit


@dataclass(frozen=True, slots=True, kw_only=True)
class Bag(Work):
    """A map stage: one task per item of the list ``items`` binds to, joined by one barrier."""

    items: str
    max_items: int
    items_per_message: int = 1  # item tasks per broker message (a container of several when above 1)


@dataclass(frozen=True, slots=True, kw_only=True)
class Branch:
    when: str
    next: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Route(StagePlan):
    """A decision stage: the first branch whose ``when`` holds is taken."""

    branches: tuple[Branch, ...]
    on_evaluation_error: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Fork(StagePlan):
    branches: tuple[str, ...]
    join: str  # the join its branches arrive at


@dataclass(frozen=True, slots=True, kw_only=True)
class Join(StagePlan):
    fork: str
    required: tuple[str, ...]
    acceptable_terminal_states: frozenset[str]
    on_success: str
    on_failure: str


Stage = Work | Route | Fork | Join


@dataclass(frozen=True, slots=True, kw_only=True)
class ContractPlan:
    queue: str
    input_schema: Any = None
    output_schema: Any = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    name: str
    version: str
    entry: str
    stages: Mapping[str, Stage]
    contracts: Mapping[str, ContractPlan]
    finalisers: tuple[str, ...] = ()
    run_deadline_ms: int | None = None
    output: Any = None
    context: Any = None  # the context's JSON Schema, if the definition declares one
    barriers: tuple[str, ...] = ()  # joins and maps, sorted: the stages with a barrier counter
    bags: tuple[str, ...] = ()  # the maps, in barrier order (as their keys follow the barriers' in KEYS)
    compensable: Mapping[str, str] = field(default_factory=dict)  # stage -> its compensation, plan order
    # the joins whose last branch may release them in its own transition (released_inline)
    released_inline: frozenset[str] = frozenset()

    def work(self, name: str) -> Work | None:
        """The work stage ``name`` (None if the plan has no work stage of that name)."""
        stage = self.stages.get(name)
        return stage if isinstance(stage, Work) else None


def reports_acceptance(spec: Mapping[str, Any]) -> bool:
    """Whether a work stage's worker reports acceptance (and heartbeats), read off its stage in a stored
    plan: only where a clock depends on it, so stages without deadlines cost no extra messages. A bag's
    items never do: the bag has one clock."""
    return spec.get("type") != "map" and any(spec.get(f) for f in ATTEMPT_CLOCK_FIELDS.values())


def typed_plan(raw: Mapping[str, Any]) -> Plan:
    """The typed plan of a compiled plan's mapping. Raises PlanShapeError for one the engine cannot run."""
    try:
        stages = _stages(raw["stages"])
        barriers = tuple(sorted(n for n, s in stages.items() if isinstance(s, (Join, Bag))))
        contracts = {
            str(ref): ContractPlan(
                queue=str(c.get("queue", "")),
                input_schema=c.get("input_schema"),
                output_schema=c.get("output_schema"),
            )
            for ref, c in (raw.get("contracts") or {}).items()
        }
        return Plan(
            name=str(raw["name"]),
            version=str(raw["version"]),
            entry=str(raw["entry"]),
            stages=MappingProxyType(stages),
            contracts=MappingProxyType(contracts),
            finalisers=tuple(str(f) for f in raw.get("finalisers") or ()),
            run_deadline_ms=raw.get("run_deadline_ms") or None,
            output=raw.get("output"),
            context=raw.get("context"),
            barriers=barriers,
            bags=tuple(n for n in barriers if isinstance(stages[n], Bag)),
            compensable=MappingProxyType(
                {n: s.compensate for n, s in stages.items() if isinstance(s, Work) and s.compensate}
            ),
            released_inline=released_inline(stages),
        )
    except (KeyError, TypeError, AttributeError) as exc:
        raise PlanShapeError(f"plan {raw.get('name')!r} has a field missing or malformed: {exc!r}") from exc


def released_inline(stages: Mapping[str, Stage]) -> frozenset[str]:
    """The joins whose last branch's transition may release them itself: those from whose successor no
    route reaches a join. A transition carries one arrival, and the route a release enters runs in the
    same transition: reaching another join there (a nested fork's join leading to the outer one), it
    would arrive twice. Every route counts, failure routes and those past work stages included (a stage
    reused after a re-drive, a task that cannot be sent or an empty bag route on at once); a join that
    could reach another join is released by a message of its own, in a transition of its own."""
    return frozenset(
        name for name, stage in stages.items() if isinstance(stage, Join) and not _reaches_join(stages, stage)
    )


def _reaches_join(stages: Mapping[str, Stage], join: Join) -> bool:
    todo, seen = [join.on_success], set()
    while todo:
        name = todo.pop()
        stage = stages.get(name)
        if stage is None or name in seen:
            continue  # a terminal, or met before
        seen.add(name)
        if isinstance(stage, Join):
            return True
        if isinstance(stage, Work):
            todo += [stage.on_success, stage.on_failure]
        elif isinstance(stage, Route):
            todo += [*(b.next for b in stage.branches), stage.on_evaluation_error]
        else:
            todo += list(stage.branches)
    return False


def _stages(raw: Mapping[str, Mapping[str, Any]]) -> dict[str, Stage]:
    joins = {str(s["fork"]): str(n) for n, s in raw.items() if s.get("type") == "join"}
    return {str(name): _stage(str(name), spec, joins) for name, spec in raw.items()}


def _stage(name: str, spec: Mapping[str, Any], joins: Mapping[str, str]) -> Stage:
    kind = spec.get("type")
    end = spec.get("arrives_at")
    arrives_at = BranchEnd(join=str(end["join"]), branch=str(end["branch"])) if end else None
    if kind in ("action", "worker", "map"):
        return _work(name, kind, spec, arrives_at)
    if kind == "decision":
        branches = tuple(Branch(when=str(b["when"]), next=str(b["next"])) for b in spec["branches"])
        on_error = str(spec.get("on_evaluation_error") or "failed")
        return Route(
            name=name, type=kind, arrives_at=arrives_at, branches=branches, on_evaluation_error=on_error
        )
    if kind == "fork":
        ends = tuple(str(b) for b in spec["branches"])
        return Fork(name=name, type=kind, arrives_at=arrives_at, branches=ends, join=joins[name])
    if kind == "join":
        return Join(
            name=name,
            type=kind,
            arrives_at=arrives_at,
            fork=str(spec["fork"]),
            required=tuple(str(b) for b in spec["required"]),
            acceptable_terminal_states=frozenset(str(s) for s in spec["acceptable_terminal_states"]),
            on_success=str(spec["on_success"]),
            on_failure=str(spec.get("on_failure") or "failed"),
        )
    raise PlanShapeError(f"stage {name!r} is of type {kind!r}, which this engine does not know")


def _work(name: str, kind: str, spec: Mapping[str, Any], arrives_at: BranchEnd | None) -> Work:
    retry = spec.get("retry") or {}
    common: dict[str, Any] = {
        "name": name,
        "type": kind,
        "arrives_at": arrives_at,
        "contract": str(spec.get("action") or spec["worker"]),
        "queue": str(spec["queue"]),
        "input": spec.get("input") or {},
        "retry": Retry(**{k: retry[k] for k in Retry.__dataclass_fields__ if k in retry}),
        "on_success": str(spec["on_success"]),
        "on_failure": str(spec.get("on_failure") or "failed"),
        "compensate": spec.get("compensate") or None,
        "clocks": tuple(c for c, f in ATTEMPT_CLOCK_FIELDS.items() if spec.get(f)),
        "needs_acceptance": reports_acceptance(spec),
        **{f: spec.get(f) or None for f in ATTEMPT_CLOCK_FIELDS.values()},
    }
    if kind == "map":
        return Bag(
            **common,
            items=str(spec["items"]),
            max_items=int(spec["max_items"]),
            items_per_message=int(spec.get("items_per_message", 1)),
        )
    return Work(**common)

"""Layer output: the canonical plan and its digest.

The plan is the definition's meaning with every default filled in and every contract it calls resolved
(schemas and queue): stages keyed by name (declaration order carries no meaning), finalisers in declared
order, fork/join structure and branch arrivals made explicit for the engine. It is serialised canonically
(sorted keys, no insignificant white space, UTF-8) and the digest is the sha256 of those bytes. Tool
versions sit beside the plan, not in it, so a new release does not change every digest.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

from orchestrator.compiler.graph import GraphFacts
from orchestrator.contracts import Contract
from orchestrator.dsl.models import Definition, JoinStage, WorkStage
from orchestrator.versions import COMPILER_VERSION, DSL_VERSION, ENGINE_VERSION, PLAN_FORMAT

if TYPE_CHECKING:
    from orchestrator.engine.plan import Plan


@dataclass(frozen=True)
class CompiledPlan:
    """An immutable compiled plan: what a run pins for life."""

    plan: dict[str, Any]
    digest: str
    versions: dict[str, str]

    @property
    def name(self) -> str:
        return str(self.plan["name"])

    @property
    def version(self) -> str:
        return str(self.plan["version"])

    @cached_property
    def typed(self) -> Plan:
        """The plan as the engine reads it (frozen, typed stages)."""
        # imported here: workers load the compiler (the registry checks plans) and nothing of the engine
        from orchestrator.engine.plan import typed_plan

        return typed_plan(self.plan)

    def canonical_bytes(self) -> bytes:
        return canonical_json(self.plan)

    def to_json_dict(self) -> dict[str, Any]:
        """The plan with its ``digest`` and ``versions`` (the shape ``saga compile --json`` prints)."""
        return {**self.plan, "digest": self.digest, "versions": self.versions}


def canonical_json(value: Any) -> bytes:
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def digest_of(plan: dict[str, Any]) -> str:
    return "sha256:" + hashlib.sha256(canonical_json(plan)).hexdigest()


def build_plan(defn: Definition, facts: GraphFacts, contracts: dict[str, Contract]) -> CompiledPlan:
    data = defn.model_dump(mode="json", by_alias=True, exclude={"stages", "description"})
    data["terminals"] = sorted(set(data["terminals"]))  # a set of intents, like acceptable_terminal_states
    stages = {stage.name: _stage(stage, facts, contracts) for stage in defn.stages}
    plan = {
        **data,
        "plan_format": PLAN_FORMAT,
        "stages": stages,
        "contracts": {
            ref: c.model_dump(mode="json", exclude={"description"}) for ref, c in contracts.items()
        },
    }
    versions = {"dsl": DSL_VERSION, "compiler": COMPILER_VERSION, "engine": ENGINE_VERSION}
    return CompiledPlan(plan=plan, digest=digest_of(plan), versions=versions)


def _stage(stage: Any, facts: GraphFacts, contracts: dict[str, Contract]) -> dict[str, Any]:
    # descriptions are documentation, not meaning: they stay out of the digest
    out: dict[str, Any] = stage.model_dump(mode="json", exclude={"name", "description"})
    if isinstance(stage, WorkStage):
        out["queue"] = stage.queue or contracts[stage.contract_ref].queue
    if out.get("items_per_message") == 1:
        del out["items_per_message"]  # the default: plans compiled before it existed keep their digest
    if isinstance(stage, JoinStage):
        info = facts.joins[stage.name]
        out["fork"] = info.fork
        out["required"] = list(info.branches)  # normalised to the fork's order
        out["acceptable_terminal_states"] = sorted(set(out["acceptable_terminal_states"]))
    arrival = facts.arrivals.get(stage.name)
    if arrival is not None:
        out["arrives_at"] = {"join": arrival.join, "branch": arrival.branch}
    return out

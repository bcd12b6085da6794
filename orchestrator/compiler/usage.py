"""What a definition uses: every contract it names and every task queue its tasks are sent to, each with
the path where the definition says so. The queue rule (``queues``) and the allowlist (``allowlist``) check
these lists; neither walks the definition itself."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from orchestrator.contracts import Registry
from orchestrator.dsl.models import ActionStage, Definition, WorkStage
from orchestrator.dsl.paths import Path


class Role(StrEnum):
    """Why a definition calls a contract."""

    STAGE = "stage"
    COMPENSATION = "compensation"
    FINALISER = "finaliser"


@dataclass(frozen=True)
class ContractUse:
    """A contract reference (``name@version``) as written at ``path``."""

    path: Path
    ref: str
    role: Role


@dataclass(frozen=True)
class QueueUse:
    """A task queue that tasks are sent to. ``contract`` is None when the stage names the queue itself
    (``path`` is its ``queue:`` field); otherwise the queue is ``contract``'s default and ``path`` is
    where that contract is named."""

    path: Path
    queue: str
    role: Role
    contract: str | None = None

    @property
    def written(self) -> bool:
        """Whether the definition names this queue (so it can name another one instead)."""
        return self.contract is None

    def describe(self) -> str:
        """``'rendering'`` or ``'rendering' (the default queue of thumbnail.render@3)``."""
        if self.contract is None:
            return repr(self.queue)
        whose = "default queue of" if self.role is Role.STAGE else f"queue of {self.role.value}"
        return f"{self.queue!r} (the {whose} {self.contract})"


@dataclass(frozen=True)
class Usage:
    contracts: tuple[ContractUse, ...]
    queues: tuple[QueueUse, ...]


def usage_of(defn: Definition, registry: Registry) -> Usage:
    """Every contract ``defn`` names and every queue its tasks go to (a contract that is not registered
    has no known queue; the contract layer reports it)."""
    contracts: list[ContractUse] = []
    queues: list[QueueUse] = []
    for i, stage in enumerate(defn.stages):
        if not isinstance(stage, WorkStage):
            continue
        field = "action" if isinstance(stage, ActionStage) else "worker"
        stage_use = ContractUse(("stages", i, field), stage.contract_ref, Role.STAGE)
        contracts.append(stage_use)
        if stage.queue is not None:
            queues.append(QueueUse(("stages", i, "queue"), stage.queue, Role.STAGE))
        else:
            queues.extend(_default_queue(stage_use, registry))
        if stage.compensate:
            undo = ContractUse(("stages", i, "compensate"), stage.compensate, Role.COMPENSATION)
            contracts.append(undo)
            queues.extend(_default_queue(undo, registry))
    for i, ref in enumerate(defn.finalisers):
        finaliser = ContractUse(("finalisers", i), ref, Role.FINALISER)
        contracts.append(finaliser)
        queues.extend(_default_queue(finaliser, registry))
    return Usage(tuple(contracts), tuple(queues))


def _default_queue(use: ContractUse, registry: Registry) -> list[QueueUse]:
    contract = registry.get(use.ref)
    return [] if contract is None else [QueueUse(use.path, contract.queue, use.role, use.ref)]

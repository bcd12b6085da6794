"""Action and worker contracts, and the registry the compiler checks definitions against.

A contract is declared once, by the worker SDK's ``@action`` / ``@worker`` decorators (``workers.sdk``),
which attach a :class:`Contract` to the handler as ``__saga_contract__``. The registry collects them from
modules and can be serialised, so a compiler without the worker code can still check definitions.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterable
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from orchestrator.dsl.models import CONTRACT_REF_PATTERN, QUEUE_PATTERN
from orchestrator.errors import ContractError, ContractLoadError, ContractNotFound

CONTRACT_ATTRIBUTE = "__saga_contract__"
#: Every contract one handler serves (several versions, or an adapter's): a tuple, the first one being
#: ``CONTRACT_ATTRIBUTE``'s.
CONTRACTS_ATTRIBUTE = "__saga_contracts__"
ACTIONS_QUEUE = "tasks.actions"
PARALLEL_QUEUE = "tasks.parallel"
SERIAL_QUEUE = "tasks.serial"


class ContractKind(StrEnum):
    ACTION = "action"
    WORKER = "worker"


class Contract(BaseModel):
    """What a stage may call: a versioned name, its input and output JSON Schemas and its default queue."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(pattern=r"^[a-z][a-z0-9_.-]{0,127}$")
    version: int = Field(ge=1, le=999_999)
    kind: ContractKind
    queue: str = Field(pattern=QUEUE_PATTERN)
    input_schema: dict[str, Any]
    output_schema: dict[str, Any]
    description: str | None = None

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"


class RunTerminalInput(BaseModel):
    """What the engine passes to every finaliser: which run ended and with which intent."""

    run_id: str
    definition: str
    definition_version: str
    digest: str
    intent: str
    reason: str | None = None


class CompensationInput(BaseModel):
    """What the engine passes to a stage's compensation action: the stage's input and accepted result."""

    run_id: str
    stage: str
    input: dict[str, Any]
    result: Any = None


class Registry:
    """An immutable set of contracts keyed by ``name@version``."""

    def __init__(self, contracts: Iterable[Contract] = ()) -> None:
        by_ref: dict[str, Contract] = {}
        for declared in contracts:
            existing = by_ref.get(declared.ref)
            if existing is not None and existing != declared:
                declared = _same_contract(existing, declared)  # noqa: PLW2901 (the one kept)
            by_ref[declared.ref] = declared
        self._by_ref = dict(sorted(by_ref.items()))

    def __contains__(self, ref: object) -> bool:
        return ref in self._by_ref

    def __len__(self) -> int:
        return len(self._by_ref)

    def get(self, ref: str) -> Contract | None:
        return self._by_ref.get(ref)

    def require(self, ref: str) -> Contract:
        contract = self._by_ref.get(ref)
        if contract is None:
            raise ContractNotFound(ref, self.refs())
        return contract

    def refs(self) -> list[str]:
        return list(self._by_ref)

    def contracts(self) -> list[Contract]:
        return list(self._by_ref.values())

    def to_json(self) -> str:
        return json.dumps(
            {"contracts": [c.model_dump(mode="json") for c in self.contracts()]}, indent=2, sort_keys=True
        )

    @classmethod
    def from_json(cls, text: str) -> Registry:
        data = json.loads(text)
        return cls(Contract.model_validate(item) for item in data["contracts"])

    @classmethod
    def from_modules(cls, modules: Iterable[str]) -> Registry:
        """Import each module and collect every handler the SDK decorated in it."""
        found: list[Contract] = []
        for name in modules:
            try:
                module = importlib.import_module(name)
            except Exception as exc:  # any import-time failure is the user's module, reported as such
                raise ContractLoadError(name, f"{type(exc).__name__}: {exc}") from exc
            declared = [contract for obj in vars(module).values() for contract in _declared_by(obj)]
            if not declared:
                raise ContractLoadError(name, "it declares no @action or @worker handlers", imported=True)
            found.extend(declared)
        return cls(found)


def _declared_by(obj: object) -> list[Contract]:
    """The contracts a module attribute declares: every version a handler serves (an adapter's too)."""
    many = getattr(obj, CONTRACTS_ATTRIBUTE, None)
    if isinstance(many, tuple) and many and all(isinstance(c, Contract) for c in many):
        return list(many)
    one = getattr(obj, CONTRACT_ATTRIBUTE, None)
    return [one] if isinstance(one, Contract) else []


_MEANING = ("kind", "queue", "input_schema", "output_schema")


def _same_contract(existing: Contract, other: Contract) -> Contract:
    """One contract out of two declarations of its ref (a handler and an adapter of an older version,
    two apps): refused unless they mean the same; a description one of them lacks is not a difference
    (it is documentation, not part of a plan)."""
    differs = [field for field in _MEANING if getattr(existing, field) != getattr(other, field)]
    if not differs and None in (existing.description, other.description):
        return existing if existing.description is not None else other
    differs = differs or ["description"]
    raise ContractError(
        f"contract {other.ref} is declared twice with different schemas or queues (its "
        f"{', '.join(differs)} {'differs' if len(differs) == 1 else 'differ'}); a published version is "
        "immutable: give the changed one a new version, or make an adapter declare the old version's models"
    )


_ANNOTATIONS = frozenset({"title", "description", "examples"})
_SCHEMA_MAPS = frozenset({"properties", "$defs", "definitions", "patternProperties"})


def strip_annotations(schema: Any) -> Any:
    """Drop documentation keywords (title, description, examples) from a JSON Schema, keeping property
    names: rewording a model's docstring must not change a contract, nor the digest of plans using it."""
    if isinstance(schema, list):
        return [strip_annotations(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _ANNOTATIONS:
            continue
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: strip_annotations(sub) for name, sub in value.items()}
        elif key in ("const", "enum", "default"):
            out[key] = value
        else:
            out[key] = strip_annotations(value)
    return out


def split_ref(ref: str) -> tuple[str, int]:
    """``"cache.lookup@1"`` -> ``("cache.lookup", 1)``; the DSL has already checked the pattern."""
    name, _, version = ref.rpartition("@")
    return name, int(version)


__all__ = [
    "ACTIONS_QUEUE",
    "CONTRACTS_ATTRIBUTE",
    "CONTRACT_REF_PATTERN",
    "PARALLEL_QUEUE",
    "SERIAL_QUEUE",
    "CompensationInput",
    "Contract",
    "ContractKind",
    "Registry",
    "RunTerminalInput",
    "split_ref",
    "strip_annotations",
]

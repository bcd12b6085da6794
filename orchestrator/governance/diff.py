"""What changed between two compiled plans, by stage. Pure."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

#: Plan fields compared on their own: the rest of a plan's top level is the definition's own fields.
_APART = frozenset({"stages", "contracts", "name", "version"})


@dataclass(frozen=True)
class FieldChange:
    path: str
    before: Any
    after: Any

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "before": self.before, "after": self.after}


@dataclass(frozen=True)
class PlanDiff:
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    changed: dict[str, list[FieldChange]] = field(default_factory=dict)
    definition: list[FieldChange] = field(default_factory=list)
    contracts_added: list[str] = field(default_factory=list)
    contracts_removed: list[str] = field(default_factory=list)
    contracts_changed: dict[str, list[FieldChange]] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not (
            self.added
            or self.removed
            or self.changed
            or self.definition
            or self.contracts_added
            or self.contracts_removed
            or self.contracts_changed
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "stages_added": self.added,
            "stages_removed": self.removed,
            "stages_changed": {s: [c.to_json() for c in cs] for s, cs in self.changed.items()},
            "definition_changed": [c.to_json() for c in self.definition],
            "contracts_added": self.contracts_added,
            "contracts_removed": self.contracts_removed,
            "contracts_changed": {r: [c.to_json() for c in cs] for r, cs in self.contracts_changed.items()},
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PlanDiff:
        """A diff from :meth:`to_json` (``saga definitions diff`` through the API)."""

        def changes(items: list[Mapping[str, Any]]) -> list[FieldChange]:
            return [FieldChange(c["path"], c.get("before"), c.get("after")) for c in items]

        return cls(
            added=list(data.get("stages_added", [])),
            removed=list(data.get("stages_removed", [])),
            changed={s: changes(cs) for s, cs in data.get("stages_changed", {}).items()},
            definition=changes(data.get("definition_changed", [])),
            contracts_added=list(data.get("contracts_added", [])),
            contracts_removed=list(data.get("contracts_removed", [])),
            contracts_changed={r: changes(cs) for r, cs in data.get("contracts_changed", {}).items()},
        )

    def lines(self) -> list[str]:
        out = [f"+ stage {s}" for s in self.added] + [f"- stage {s}" for s in self.removed]
        for stage, changes in self.changed.items():
            out.append(f"~ stage {stage}")
            out += [f"    {c.path}: {_short(c.before)} -> {_short(c.after)}" for c in changes]
        out += [f"~ {c.path}: {_short(c.before)} -> {_short(c.after)}" for c in self.definition]
        out += [f"+ contract {c}" for c in self.contracts_added]
        out += [f"- contract {c}" for c in self.contracts_removed]
        for ref, changes in self.contracts_changed.items():
            out.append(f"~ contract {ref} (the same version, another declaration)")
            out += [f"    {c.path}: {_short(c.before)} -> {_short(c.after)}" for c in changes]
        return out or ["no change in meaning"]


def diff_plans(before: Mapping[str, Any], after: Mapping[str, Any]) -> PlanDiff:
    old, new = before.get("stages", {}), after.get("stages", {})
    changed = {
        name: _fields(old[name], new[name], "")
        for name in sorted(set(old) & set(new))
        if old[name] != new[name]
    }
    old_contracts, new_contracts = before.get("contracts", {}), after.get("contracts", {})
    top = sorted((set(before) | set(after)) - _APART)
    return PlanDiff(
        added=sorted(set(new) - set(old)),
        removed=sorted(set(old) - set(new)),
        changed=changed,
        definition=[
            FieldChange(k, before.get(k), after.get(k)) for k in top if before.get(k) != after.get(k)
        ],
        contracts_added=sorted(set(new_contracts) - set(old_contracts)),
        contracts_removed=sorted(set(old_contracts) - set(new_contracts)),
        contracts_changed={
            ref: _fields(old_contracts[ref], new_contracts[ref], "")
            for ref in sorted(set(old_contracts) & set(new_contracts))
            if old_contracts[ref] != new_contracts[ref]
        },
    )


def _fields(old: Any, new: Any, path: str) -> list[FieldChange]:
    """The leaves that differ (dicts walked key by key; lists and scalars compared whole)."""
    if isinstance(old, Mapping) and isinstance(new, Mapping):
        found: list[FieldChange] = []
        for key in sorted(set(old) | set(new)):
            if old.get(key) != new.get(key):
                found += _fields(old.get(key), new.get(key), f"{path}.{key}" if path else str(key))
        return found
    return [FieldChange(path, old, new)]


def _short(value: Any, limit: int = 80) -> str:
    text = json.dumps(value, sort_keys=True, ensure_ascii=False)
    return text if len(text) <= limit else text[: limit - 3] + "..."

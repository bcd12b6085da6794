"""Layer 3, contracts and types: every contract reference resolves to a registered contract of the right
kind; inputs fit input schemas; every ``${...}`` expression is valid and bounded, reads only variables in
scope, and every path it reads exists in the context schema or in an output schema of a stage whose result
is available at that point; finalisers and compensations accept what the engine gives them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jsonschema

from orchestrator.compiler import schemas
from orchestrator.compiler.graph import GraphFacts
from orchestrator.compiler.limits import AdmissionLimits
from orchestrator.compiler.report import Reporter
from orchestrator.contracts import (
    SERIAL_QUEUE,
    CompensationInput,
    Contract,
    ContractKind,
    Registry,
    RunTerminalInput,
)
from orchestrator.dsl.expressions import (
    Binding,
    BindingSyntaxError,
    Reference,
    check_expression,
    parse_template,
    walk_strings,
)
from orchestrator.dsl.models import (
    ActionStage,
    DecisionStage,
    Definition,
    MapStage,
    Terminal,
    WorkStage,
)
from orchestrator.dsl.paths import Path

STAGE_VARIABLES = frozenset({"context", "stages"})
MAP_VARIABLES = STAGE_VARIABLES | {"item", "index"}
STAGE_FIELDS = ("result", "state", "attempt")


@dataclass(frozen=True)
class Typed:
    """A schema node together with the document its ``$ref``s resolve against."""

    root: schemas.Schema
    node: schemas.Schema

    def field(self, key: str | int) -> Typed | None:
        found = schemas.field(self.root, self.node, key)
        return None if found is None else Typed(self.root, found)

    def types(self) -> set[str] | None:
        return schemas.types(self.root, self.node)


OPEN = Typed(schemas.ANY, schemas.ANY)


@dataclass
class Scope:
    """Where a binding is evaluated: which variables exist and which stage results are available."""

    variables: frozenset[str]
    at: str  # graph node whose available results apply
    item: Typed | None = None


class ContractLayer:
    def __init__(
        self,
        defn: Definition,
        registry: Registry,
        facts: GraphFacts,
        limits: AdmissionLimits,
        report: Reporter,
    ) -> None:
        self.defn = defn
        self.registry = registry
        self.facts = facts
        self.limits = limits
        self.report = report
        self.stages = {s.name: s for s in defn.stages}
        self.used: dict[str, Contract] = {}
        self.context = self._context_schema()

    def run(self) -> dict[str, Contract]:
        for i, stage in enumerate(self.defn.stages):
            base: Path = ("stages", i)
            if isinstance(stage, WorkStage):
                self._work_stage(stage, base)
            elif isinstance(stage, DecisionStage):
                for j, branch in enumerate(stage.branches):
                    self._expression(
                        branch.when,
                        (*base, "branches", j, "when"),
                        Scope(STAGE_VARIABLES, stage.name),
                        want={"boolean"},
                    )
        if self.defn.output is not None:
            self._bindings(
                self.defn.output, ("output",), Scope(STAGE_VARIABLES, Terminal.COMPLETED.value), None
            )
        for i, ref in enumerate(self.defn.finalisers):
            self._side_contract(ref, ("finalisers", i), "finaliser", RunTerminalInput.model_fields)
        return dict(sorted(self.used.items()))

    # ---- contracts ---------------------------------------------------------------------------------

    def _contract(self, ref: str, path: Path, kind: ContractKind) -> Contract | None:
        contract = self.registry.get(ref)
        if contract is None:
            known = [r for r in self.registry.refs() if r.split("@")[0] == ref.split("@", maxsplit=1)[0]]
            hint = f" (registered versions: {', '.join(known)})" if known else ""
            self.report.add(
                path,
                f"contract {ref!r} is not registered{hint}; declare it with @{kind.value} "
                "in a module passed with --contracts",
            )
            return None
        if contract.kind is not kind:
            self.report.add(
                path,
                f"{ref} is {_article(contract.kind)} contract; "
                f"this field needs {_article(kind)} (type: {contract.kind.value} calls it)",
            )
            return None
        self.used[ref] = contract
        return contract

    def _side_contract(self, ref: str, path: Path, role: str, given: dict[str, Any]) -> None:
        contract = self._contract(ref, path, ContractKind.ACTION)
        if contract is None:
            return
        required = contract.input_schema.get("required", [])
        for name in required:
            if name not in given:
                self.report.add(
                    path,
                    f"{role} {ref} requires input {name!r}, which a {role} is not given "
                    f"(it receives {', '.join(given)})",
                )

    def _work_stage(self, stage: WorkStage, base: Path) -> None:
        kind = ContractKind.ACTION if isinstance(stage, ActionStage) else ContractKind.WORKER
        contract = self._contract(stage.contract_ref, (*base, kind.value), kind)
        if stage.compensate:
            self._side_contract(
                stage.compensate, (*base, "compensate"), "compensation", CompensationInput.model_fields
            )
        scope = Scope(STAGE_VARIABLES, stage.name)
        if isinstance(stage, MapStage):
            scope = Scope(MAP_VARIABLES, stage.name, self._map_items(stage, base))
            queue = stage.queue or (contract.queue if contract is not None else None)
            if stage.items_per_message > 1 and queue == SERIAL_QUEUE:
                self.report.add(
                    (*base, "items_per_message"),
                    f"items_per_message {stage.items_per_message} on {SERIAL_QUEUE}: serial tasks run one "
                    "at a time and travel one per message; remove items_per_message or use another queue",
                )
        if contract is not None:
            self._inputs(stage, contract, base, scope)

    def _map_items(self, stage: MapStage, base: Path) -> Typed:
        parsed = self._parse(stage.items, (*base, "items"))
        whole = parsed.whole if isinstance(parsed, Binding) else None
        if whole is None:
            self.report.add(
                (*base, "items"), 'items must be one binding that yields a list, e.g. "${context.ids}"'
            )
            return OPEN
        typed = self._expression(
            whole.source, (*base, "items"), Scope(STAGE_VARIABLES, stage.name), want={"array"}
        )
        element = typed.field(0) if typed else None
        return element or OPEN

    def _inputs(self, stage: WorkStage, contract: Contract, base: Path, scope: Scope) -> None:
        target = Typed(contract.input_schema, contract.input_schema)
        properties = contract.input_schema.get("properties", {})
        for name in contract.input_schema.get("required", []):
            if name not in stage.input:
                self.report.add((*base, "input"), f"missing input {name!r} required by {contract.ref}")
        for key, value in stage.input.items():
            field_target = target.field(key)
            if field_target is None or (properties and key not in properties):
                self.report.add(
                    (*base, "input", key),
                    f"input {key!r} is not a field of {contract.ref} "
                    f"(fields: {', '.join(properties) or 'none'})",
                )
                continue
            if not any(True for _ in _bindings_in(value)):
                self._literal(value, field_target, (*base, "input", key), contract)
            self._bindings(value, (*base, "input", key), scope, field_target)

    def _literal(self, value: Any, target: Typed, path: Path, contract: Contract) -> None:
        schema = {**target.node, "$defs": target.root.get("$defs", {})}
        try:
            jsonschema.validate(value, schema)
        except jsonschema.ValidationError as exc:
            self.report.add(path, f"value {value!r} does not fit {contract.ref}: {exc.message}")
        except jsonschema.SchemaError:
            pass  # the contract's own schema is at fault; registry loading reports it

    # ---- bindings and expressions ------------------------------------------------------------------

    def _parse(self, text: str, path: Path) -> Binding | str | None:
        try:
            return parse_template(text)
        except BindingSyntaxError as exc:
            self.report.add(path, f"{exc}: {text!r}")
            return None

    def _bindings(self, value: Any, path: Path, scope: Scope, target: Typed | None) -> None:
        for sub, text in walk_strings(value, path):
            parsed = self._parse(text, sub)
            if not isinstance(parsed, Binding):
                continue
            here = _navigate(target, sub[len(path) :])
            if parsed.whole:
                want = here.types() if here else None
                self._expression(parsed.whole.source, sub, scope, want=want)
                continue
            for expr in parsed.expressions():
                self._expression(expr.source, sub, scope, want=None)
            if here is not None and not schemas.fits({"string"}, here.types()):
                self.report.add(
                    sub,
                    f"a template with text around ${{...}} makes a string, but the target "
                    f"expects {schemas.describe(here.types())}",
                )

    def _expression(self, src: str, path: Path, scope: Scope, want: set[str] | None) -> Typed | None:
        checked, problems = check_expression(src, scope.variables, self.limits.expressions)
        for message in problems:
            self.report.add(path, message)
        if checked is None:
            return None
        typed = [self._reference(ref, path, scope) for ref in checked.references]
        if not checked.is_plain_path or typed[0] is None:
            return None
        result = typed[0]
        if not schemas.fits(result.types(), want):
            self.report.add(
                path,
                f"${{{src}}} is {schemas.describe(result.types())}, but "
                f"{schemas.describe(want)} is expected here",
            )
        return result

    def _reference(self, ref: Reference, path: Path, scope: Scope) -> Typed | None:
        if ref.root == "context":
            return self._walk(self.context, ref.path, ref, path, "the context schema")
        if ref.root == "item":
            return self._walk(scope.item or OPEN, ref.path, ref, path, "the map's item")
        if ref.root == "index":
            if ref.path:
                self.report.add(path, "index is the item's position (an integer); it has no fields")
                return None
            return Typed({}, {"type": "integer"})
        return self._stage_reference(ref, path, scope)

    def _referenced_stage(self, ref: Reference, path: Path) -> WorkStage | None:
        if not ref.path or not isinstance(ref.path[0], str):
            self.report.add(path, 'read a stage as stages["name"].result (or .state, .attempt)')
            return None
        stage = self.stages.get(ref.path[0])
        if stage is None:
            self.report.add(path, f"{ref.render()} names no stage; stages: {', '.join(self.stages)}")
            return None
        if not isinstance(stage, WorkStage):
            self.report.add(path, f"stage {stage.name!r} is a {stage.type} and produces no result")
            return None
        return stage

    def _stage_reference(self, ref: Reference, path: Path, scope: Scope) -> Typed | None:
        stage = self._referenced_stage(ref, path)
        if stage is None:
            return None
        name = stage.name
        if len(ref.path) == 1:
            return OPEN
        attribute = ref.path[1]
        if attribute not in STAGE_FIELDS:
            self.report.add(
                path, f"{ref.render()}: a stage exposes {', '.join(STAGE_FIELDS)}, not {attribute!r}"
            )
            return None
        if attribute != "result":
            return Typed({}, {"type": "integer" if attribute == "attempt" else "string"})
        self._require_available(name, ref, path, scope)
        contract = self.registry.get(stage.contract_ref)  # not self.used: stage order carries no meaning
        kind = ContractKind.ACTION if isinstance(stage, ActionStage) else ContractKind.WORKER
        if contract is None or contract.kind is not kind:
            return OPEN
        result = Typed(contract.output_schema, contract.output_schema)
        rest = ref.path[2:]
        if isinstance(stage, MapStage):
            if not rest:
                return Typed({}, {"type": "array"})
            if not isinstance(rest[0], int):
                self.report.add(path, f"{ref.render()}: a map's result is a list of item results; index it")
                return None
            rest = rest[1:]
        return self._walk(result, rest, ref, path, f"the output of {contract.ref}")

    def _require_available(self, name: str, ref: Reference, path: Path, scope: Scope) -> None:
        if not self.facts.valid or ref.guarded:
            return
        if name not in self.facts.available.get(scope.at, frozenset()):
            where = "the run completes" if scope.at == Terminal.COMPLETED.value else f"{scope.at!r} runs"
            self.report.add(
                path,
                f"reads the result of stage {name!r}, which has not succeeded on every path "
                f"by the time {where}; guard it with has(...) or read it after it",
            )

    def _walk(
        self, start: Typed, keys: tuple[str | int, ...], ref: Reference, path: Path, what: str
    ) -> Typed | None:
        current = start
        for i, key in enumerate(keys):
            found = current.field(key)
            if found is None:
                fields = list(current.node.get("properties", {}))
                hint = f" (fields: {', '.join(fields)})" if fields else ""
                shown = ".".join(str(k) for k in keys[: i + 1])
                self.report.add(path, f"{ref.render()}: {what} has no field {shown!r}{hint}")
                return None
            current = found
        return current

    def _context_schema(self) -> Typed:
        schema = self.defn.context
        if schema is None:
            return OPEN
        try:
            jsonschema.Draft202012Validator.check_schema(schema)
        except jsonschema.SchemaError as exc:
            self.report.add(("context",), f"context is not a valid JSON Schema: {exc.message}")
            return OPEN
        if schema.get("type") != "object":
            self.report.add(("context",), "the context schema must describe an object (type: object)")
        return Typed(schema, schema)


def _bindings_in(value: Any) -> list[str]:
    return [text for _, text in walk_strings(value, ()) if "${" in text]


def _navigate(target: Typed | None, keys: tuple[str | int, ...]) -> Typed | None:
    for key in keys:
        if target is None:
            return None
        target = target.field(key)
    return target


def _article(kind: ContractKind) -> str:
    return f"an {kind.value}" if kind is ContractKind.ACTION else f"a {kind.value}"

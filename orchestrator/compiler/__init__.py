"""The definition compiler: YAML text in, an immutable :class:`CompiledPlan` (or every problem) out.

Layers, in order (a layer runs only when the definition has the shape the next one needs):

1. shape and admission: ``schema.validate_shape`` and ``admission.check_admission``;
2. graph semantics: ``graph.analyse_graph``;
3. contracts and types: ``contract_layer.ContractLayer``;
4. what it uses (``usage.usage_of``): only task queues (``queues.check_task_queues``) and, with an
   allowlist, only the contracts and queues allowed for its name (``allowlist.check_allowlist``);
5. runtime binding: ``orchestrator.dsl.binding`` (used by the engine when a run is under way).

Pure: no I/O, no clock; the registry, limits and allowlist are passed in.
"""

from __future__ import annotations

from orchestrator.compiler.admission import check_admission
from orchestrator.compiler.allowlist import Allowlist, check_allowlist
from orchestrator.compiler.contract_layer import ContractLayer
from orchestrator.compiler.graph import analyse_graph
from orchestrator.compiler.limits import AdmissionLimits
from orchestrator.compiler.plan import CompiledPlan, build_plan, canonical_json, digest_of
from orchestrator.compiler.queues import check_task_queues
from orchestrator.compiler.report import Reporter
from orchestrator.compiler.schema import validate_shape
from orchestrator.compiler.usage import usage_of
from orchestrator.contracts import Registry
from orchestrator.dsl.yaml_source import load_yaml

__all__ = ["AdmissionLimits", "Allowlist", "CompiledPlan", "canonical_json", "compile_text", "digest_of"]


def compile_text(
    text: str | bytes,
    file: str,
    registry: Registry,
    limits: AdmissionLimits | None = None,
    allowlist: Allowlist | None = None,
) -> CompiledPlan:
    """Compile one definition. Raises :class:`~orchestrator.errors.DefinitionError` with every problem.

    ``allowlist`` (None: none) restricts the contracts and queues the definition may use by its name; it
    gates compilation and leaves the plan and its digest as they are."""
    limits = limits or AdmissionLimits()
    document = load_yaml(text, file, limits.yaml)
    report = Reporter(document.source, document.data)
    definition = validate_shape(document.data, report)
    report.raise_if_any()
    assert definition is not None  # validate_shape reports whenever it returns None
    check_admission(definition, limits, report)
    facts = analyse_graph(definition, report)
    contracts = ContractLayer(definition, registry, facts, limits, report).run()
    usage = usage_of(definition, registry)
    check_task_queues(usage.queues, registry, report)
    if allowlist is not None:
        check_allowlist(definition.name, usage, allowlist, report)
    report.raise_if_any()
    return build_plan(definition, facts, contracts)

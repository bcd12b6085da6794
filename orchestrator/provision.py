"""Provisioning: what a fresh environment needs before runs can start.

Declare the broker topology, then compile definitions and publish their plans (each approved and made
the version new runs of its definition use, where separate approval is off). The CLI, the demo, the
integration tests and the benchmark all do it through these functions.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from orchestrator.allowlists import load_allowlist
from orchestrator.bus.connect import connect_once
from orchestrator.bus.topology import Topology, apply_topology, topology_for
from orchestrator.compiler import CompiledPlan, compile_text
from orchestrator.contracts import Registry
from orchestrator.governance import service as governance
from orchestrator.settings import Settings
from orchestrator.store.shardmap_store import current_map


async def declare_topology(settings: Settings, registry: Registry) -> Topology:
    """Declare the topology of the namespace's shard map (stored first if there is none yet)."""
    topology = topology_for(settings, registry, await current_map(settings, seed=True))
    connection = await connect_once(settings.amqp_url)
    try:
        await apply_topology(await connection.channel(), topology)
    finally:
        await connection.close()
    return topology


def compile_files(paths: Iterable[Path], registry: Registry, settings: Settings) -> list[CompiledPlan]:
    """Compile every file against the allowlist of SAGA_ALLOWLIST_FILE (read once); raises DefinitionError
    (with every problem) at the first invalid one, AllowlistError for an allowlist that cannot be used."""
    allowlist = load_allowlist(settings.allowlist_file)
    limits = settings.admission_limits()
    return [compile_text(p.read_bytes(), str(p), registry, limits, allowlist) for p in paths]


async def publish_plans(
    settings: Settings, plans: Iterable[CompiledPlan], reason: str = "provisioned"
) -> None:
    """Publish, approve and activate each plan in one change (``saga definitions publish --activate``):
    for environments without separate approval (development, the demo, tests, the benchmark)."""
    await governance.publish(settings, list(plans), settings.actor, reason, activate=True)


async def provision(settings: Settings, registry: Registry, paths: Iterable[Path]) -> list[CompiledPlan]:
    plans = compile_files(paths, registry, settings)
    await declare_topology(settings, registry)
    await publish_plans(settings, plans)
    return plans

"""Provisioning: what a fresh environment needs before runs can start.

Declare the broker topology, then compile definitions and publish their plans (each becomes the version
new runs of its definition use). The CLI, the demo, the integration tests and the benchmark all do it
through these functions.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from orchestrator.bus.connect import connect_once
from orchestrator.bus.topology import Topology, apply_topology, topology_for
from orchestrator.compiler import CompiledPlan, compile_text
from orchestrator.contracts import Registry
from orchestrator.settings import Settings
from orchestrator.store.connect import async_client
from orchestrator.store.redis_store import RedisStore
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
    """Compile every file; raises DefinitionError (with every problem) at the first invalid one."""
    return [compile_text(p.read_bytes(), str(p), registry, settings.admission_limits()) for p in paths]


async def publish_plans(settings: Settings, plans: Iterable[CompiledPlan]) -> None:
    """Store each plan by digest (immutable) and make it the active version of its definition."""
    client = async_client(settings.redis_url)
    try:
        store = RedisStore(client, settings.key_prefix)
        for plan in plans:
            await store.save_plan(plan.digest, plan.plan, plan.versions)
            await store.activate(plan.name, plan.digest)
    finally:
        await client.aclose()


async def provision(settings: Settings, registry: Registry, paths: Iterable[Path]) -> list[CompiledPlan]:
    plans = compile_files(paths, registry, settings)
    await declare_topology(settings, registry)
    await publish_plans(settings, plans)
    return plans

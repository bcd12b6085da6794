"""Demo handlers: every action and worker the example definitions in ``definitions/`` use.

They are the CLI's default contract registry (``saga --contracts workers.demo``). The bodies are small and
deterministic; the runtime issue gives them fault knobs and an effect store for tests.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from orchestrator.contracts import SERIAL_QUEUE, CompensationInput, RunTerminalInput
from workers.demo import effects
from workers.demo.models import (
    AuditOutput,
    CacheLookupOutput,
    CompensationOutput,
    IndexStepInput,
    IndexStepOutput,
    MetadataOutput,
    ModelRef,
    PublishOutput,
    RenderOutput,
    SemanticOutput,
)
from workers.sdk import action, worker

if TYPE_CHECKING:
    from orchestrator.settings import Settings
    from workers.runtime import TaskContext


def saga_startup(settings: Settings) -> None:
    """Called by the worker runtime at start: the demo keeps its effects and faults in Redis.

    SAGA_DEMO_EFFECTS=0 turns the ledger and fault knobs off, so the handlers do no I/O at all (the
    benchmark's no-op workload, like the Celery and Dramatiq peers')."""
    if os.environ.get("SAGA_DEMO_EFFECTS", "1") != "0":
        effects.configure(settings.redis_url, settings.key_prefix)


async def _act(contract: str, model_id: str, context: TaskContext | None) -> None:
    """Apply injected faults, then record the side effect once per idempotency key."""
    world = effects.world()
    if world is None or context is None:
        return
    await world.act(contract, model_id, context.idempotency_key)


@action("cache.lookup", version=1, input=ModelRef, output=CacheLookupOutput)
async def cache_lookup(payload: ModelRef, context: TaskContext | None = None) -> CacheLookupOutput:
    """Look the model up in the derived-data cache; the demo cache holds models whose id starts 'cached-'."""
    await _act("cache.lookup", payload.modelId, context)
    if payload.modelId.startswith("cached-"):
        return CacheLookupOutput(modelId=payload.modelId, hit=True)
    return CacheLookupOutput(modelId=payload.modelId, hit=False)


@worker("thumbnail.render", version=3, input=ModelRef, output=RenderOutput, queue="rendering")
async def render_thumbnail(payload: ModelRef, context: TaskContext | None = None) -> RenderOutput:
    await _act("thumbnail.render", payload.modelId, context)
    return RenderOutput(thumbnailUri=f"thumbs/{payload.modelId}.png")


@worker("semantic.analyse", version=4, input=ModelRef, output=SemanticOutput, queue="analysis")
async def semantic_analyse(payload: ModelRef, context: TaskContext | None = None) -> SemanticOutput:
    await _act("semantic.analyse", payload.modelId, context)
    return SemanticOutput(tags=["mesh", payload.modelId.split("-")[0]])


@worker("metadata.extract", version=2, input=ModelRef, output=MetadataOutput, queue="metadata")
async def metadata_extract(payload: ModelRef, context: TaskContext | None = None) -> MetadataOutput:
    await _act("metadata.extract", payload.modelId, context)
    return MetadataOutput(faces=12, vertices=8)


@action("catalogue.publish", version=2, input=ModelRef, output=PublishOutput)
async def catalogue_publish(payload: ModelRef, context: TaskContext | None = None) -> PublishOutput:
    await _act("catalogue.publish", payload.modelId, context)
    return PublishOutput(published=True, catalogueId=f"cat-{payload.modelId}")


@action("catalogue.unpublish", version=1, input=CompensationInput, output=CompensationOutput)
async def catalogue_unpublish(
    payload: CompensationInput, context: TaskContext | None = None
) -> CompensationOutput:
    """Compensation for catalogue.publish: withdraw the entry again."""
    await _act("catalogue.unpublish", str(payload.input.get("modelId", payload.run_id)), context)
    return CompensationOutput(undone=True)


@action("thumbnail.discard", version=1, input=CompensationInput, output=CompensationOutput)
async def thumbnail_discard(
    payload: CompensationInput, context: TaskContext | None = None
) -> CompensationOutput:
    """Compensation for thumbnail.render: delete the thumbnail of a model whose ingest failed."""
    await _act("thumbnail.discard", str(payload.input.get("modelId", payload.run_id)), context)
    return CompensationOutput(undone=True)


@action("audit.run-terminal", version=1, input=RunTerminalInput, output=AuditOutput)
async def audit_run_terminal(payload: RunTerminalInput, context: TaskContext | None = None) -> AuditOutput:
    """Finaliser: record that a run reached its terminal intent."""
    await _act("audit.run-terminal", payload.run_id, context)
    return AuditOutput(recorded=True)


@action("index.snapshot", version=1, input=IndexStepInput, output=IndexStepOutput, queue=SERIAL_QUEUE)
def index_snapshot(payload: IndexStepInput) -> IndexStepOutput:
    return IndexStepOutput(index=payload.index, step="snapshot")


@action("index.rebuild", version=1, input=IndexStepInput, output=IndexStepOutput, queue=SERIAL_QUEUE)
def index_rebuild(payload: IndexStepInput) -> IndexStepOutput:
    return IndexStepOutput(index=payload.index, step="rebuild")


@action("index.swap", version=1, input=IndexStepInput, output=IndexStepOutput, queue=SERIAL_QUEUE)
def index_swap(payload: IndexStepInput) -> IndexStepOutput:
    return IndexStepOutput(index=payload.index, step="swap")

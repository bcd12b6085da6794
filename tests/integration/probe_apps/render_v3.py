"""The old worker: serves ``probe.render@3`` only."""

from __future__ import annotations

from tests.integration.probe_apps.render_models import RenderInputV3, RenderOutputV3, record
from workers.runtime import TaskContext
from workers.sdk import worker


@worker("probe.render", version=3, input=RenderInputV3, output=RenderOutputV3, queue="probe-rendering")
def render_v3(payload: RenderInputV3, context: TaskContext) -> RenderOutputV3:
    record("v3", context, payload.hold_s)
    return RenderOutputV3(uri=f"thumbs/{payload.modelId}-{payload.size}.png", size=payload.size)

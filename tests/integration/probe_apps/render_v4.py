"""The new worker during the upgrade: serves ``probe.render@4``, and ``@3`` through an adapter."""

from __future__ import annotations

from tests.integration.probe_apps.render_models import (
    RenderInputV3,
    RenderInputV4,
    RenderOutputV3,
    RenderOutputV4,
    record,
)
from workers.runtime import TaskContext
from workers.sdk import adapter, worker


@worker("probe.render", version=4, input=RenderInputV4, output=RenderOutputV4, queue="probe-rendering")
def render_v4(payload: RenderInputV4, context: TaskContext) -> RenderOutputV4:
    record("v4", context, payload.hold_s)
    uri = f"thumbs/{payload.modelId}-{payload.width}x{payload.height}.webp"
    return RenderOutputV4(uri=uri, width=payload.width, height=payload.height, format="webp")


def square(old: RenderInputV3) -> RenderInputV4:
    return RenderInputV4(modelId=old.modelId, width=old.size, height=old.size, hold_s=old.hold_s)


def one_size(new: RenderOutputV4) -> RenderOutputV3:
    return RenderOutputV3(uri=new.uri, size=max(new.width, new.height))


render_v3 = adapter(
    "probe.render",
    from_version=3,
    to=render_v4,
    input=RenderInputV3,
    output=RenderOutputV3,
    upgrade_input=square,
    downgrade_output=one_size,
)

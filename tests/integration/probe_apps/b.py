"""Probe app B: a serial and a parallel contract of its own, on the same queues as app A's."""

from __future__ import annotations

from tests.integration.probe_apps import Done, Step, record
from workers.sdk import action, worker


@action("probe.serial-b", version=1, input=Step, output=Done, queue="tasks.serial")
def serial_b(payload: Step) -> Done:
    return record("serial", "probe.serial-b@1", payload)


@worker("probe.parallel-b", version=1, input=Step, output=Done)
def parallel_b(payload: Step) -> Done:
    return record("parallel", "probe.parallel-b@1", payload)

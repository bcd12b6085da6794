"""Probe app A: a serial and a parallel contract of its own."""

from __future__ import annotations

from tests.integration.probe_apps import Done, Step, record
from workers.sdk import action, worker


@action("probe.serial-a", version=1, input=Step, output=Done, queue="tasks.serial")
def serial_a(payload: Step) -> Done:
    return record("serial", "probe.serial-a@1", payload)


@worker("probe.parallel-a", version=1, input=Step, output=Done)
def parallel_a(payload: Step) -> Done:
    return record("parallel", "probe.parallel-a@1", payload)

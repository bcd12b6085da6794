"""Workers speak the wire protocol (orchestrator/wire) and load nothing of the engine: a worker pool
upgraded on its own must not depend on how the orchestrator decides."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import sys
import workers.results, workers.runtime, workers.sdk
packages = ("orchestrator.engine", "orchestrator.shard")
loaded = sorted(m for m in sys.modules if m in packages or m.startswith(tuple(p + "." for p in packages)))
print(",".join(loaded))
"""


def test_the_worker_modules_load_nothing_of_the_engine_or_the_shard() -> None:
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "", done.stdout

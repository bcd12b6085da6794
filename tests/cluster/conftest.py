"""One Redis Cluster (three primaries, no replicas) per test module of this folder; the fault suite's seed
fixture (``SAGA_FAULT_SEED`` reproduces a scenario, and a failing test's report says which seed it had)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.cluster.cluster import LocalCluster, running_cluster
from tests.faults.conftest import fault_seed, pytest_runtest_makereport

__all__ = ["cluster", "fault_seed", "pytest_runtest_makereport"]


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with running_cluster() as found:
        yield found

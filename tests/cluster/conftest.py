"""One Redis Cluster (three primaries, no replicas) per test module of this folder."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.cluster.cluster import LocalCluster


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    found = LocalCluster()
    try:
        found.start()
        yield found
    finally:
        found.stop()

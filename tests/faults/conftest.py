"""Fault scenarios: the ``slow`` marker, a reproducible seed per test, and bags sent in chunks.

Every scenario draws its random choices (which runs, which timings) from ``fault_seed``. The seed is
``SAGA_FAULT_SEED`` when set, else fresh per test; a failing test's report says how to reproduce it.

Every process a scenario starts (and its own clients) sends a bag's items ``BAG_WINDOW`` at a time, so
the scenarios' bags of a few hundred items go out in several chunks, each refill exposed to the fault.
"""

from __future__ import annotations

import os
import random
from collections.abc import Generator

import pytest

from tests.faults.harness import FaultSeed

SEED_VARIABLE = "SAGA_FAULT_SEED"
SEED_KEY = pytest.StashKey[int]()
BAG_WINDOW = 64


@pytest.fixture(autouse=True)
def chunked_bags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SAGA_BAG_WINDOW", str(BAG_WINDOW))  # the stacks pass the environment on


def pytest_configure(config: pytest.Config) -> None:
    # Registered here so that --strict-markers accepts it without touching pyproject.toml.
    config.addinivalue_line(
        "markers", "slow: long fault scenarios (30 s outages); deselect with -m 'not slow'"
    )


@pytest.fixture
def fault_seed(request: pytest.FixtureRequest) -> FaultSeed:
    given = os.environ.get(SEED_VARIABLE)
    seed = int(given) if given else random.SystemRandom().randrange(2**32)
    request.node.stash[SEED_KEY] = seed
    print(f"fault seed {seed} (reproduce: {SEED_VARIABLE}={seed})")
    return FaultSeed(seed, random.Random(seed))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    seed = item.stash.get(SEED_KEY, None)
    if seed is not None and report.failed:
        report.sections.append(
            ("fault seed", f"reproduce with: {SEED_VARIABLE}={seed} .venv/bin/pytest '{item.nodeid}'")
        )
    return report

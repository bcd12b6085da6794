"""The long-lived processes' collector pace (``orchestrator/gc_tuning.py``)."""

from __future__ import annotations

import gc

from orchestrator import gc_tuning


def test_tune_freezes_what_start_up_holds_and_spaces_the_young_passes() -> None:
    before = gc.get_threshold()
    try:
        gc_tuning.tune()
        assert gc.get_threshold() == (gc_tuning.YOUNG_THRESHOLD, before[1], before[2])
        assert gc.get_freeze_count() > 0
        assert gc.isenabled()  # cyclic garbage is still collected
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)

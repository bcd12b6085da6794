"""The listing indexes of a shard (``ShardKeys.facet``): which run ids to read for a filtered listing,
so that a page costs in proportion to the page, not to every run kept. Pure.

Each run is in the index of its definition, of its definition version, and, while it has a status, of
that status alone, of its definition in that status and of its version in that status. The transitions
keep them (``lua/helpers.lua``, ``index_status``): a run enters the static ones when it is created and
moves between the status ones when its status changes, in the same atomic call.
"""

from __future__ import annotations

import functools
from typing import Any

from orchestrator.engine.model import Decision, RunStatus
from orchestrator.store.keys import ShardKeys

STATUSES = tuple(s.value for s in RunStatus)


def static_facets(keys: ShardKeys, definition: str, version: str) -> list[str]:
    return [keys.facet("def", definition), keys.facet("ver", definition, version)]


def status_facets(keys: ShardKeys, definition: str, version: str, status: str) -> list[str]:
    return [
        keys.facet("state", status),
        keys.facet("def", definition, "state", status),
        keys.facet("ver", definition, version, "state", status),
    ]


def index_spec(
    keys: ShardKeys, run_id: str, definition: str, version: str, first_key: int
) -> tuple[dict[str, Any], list[str]]:
    """The spec's ``index`` block of a transition that creates its run or changes its status, and the
    KEYS it names, numbered from ``first_key`` (1-based, as Lua sees them)."""
    static, by_state, extra = _index_layout(keys, definition, version, first_key)
    return {"run": run_id, "first": first_key, "static": static, "by_state": by_state}, list(extra)


@functools.lru_cache(maxsize=1024)
def _index_layout(
    keys: ShardKeys, definition: str, version: str, first_key: int
) -> tuple[list[int], dict[str, list[int]], tuple[str, ...]]:
    """The part of :func:`index_spec` that is the same for every run of a version on a shard (twenty
    keys, built for every run's start and end otherwise). Its lists are only ever encoded, never
    changed, so the calls share them."""
    extra: list[str] = []

    def positions(names: list[str]) -> list[int]:
        start = first_key + len(extra)
        extra.extend(names)
        return list(range(start, start + len(names)))

    static = positions(static_facets(keys, definition, version))
    by_state = {s: positions(status_facets(keys, definition, version, s)) for s in STATUSES}
    return static, by_state, tuple(extra)


def changes_status(decision: Decision) -> bool:
    """Whether a transition may move its run between listing indexes: it creates the run or writes its
    status."""
    return decision.create or any(w.key.kind == "run" and "status" in w.fields for w in decision.writes)


def listing_facet(
    keys: ShardKeys, state: str | None, definition: str | None, version: str | None
) -> str | None:
    """The index that holds exactly the runs a filter keeps (None: the shard's index of every run)."""
    if definition is not None and version is not None:
        return keys.facet("ver", definition, version, *(("state", state) if state else ()))
    if definition is not None:
        return keys.facet("def", definition, *(("state", state) if state else ()))
    if state is not None:
        return keys.facet("state", state)
    return None

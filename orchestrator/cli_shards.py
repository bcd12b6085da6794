"""``saga shards``: the shard map, read and changed online."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

import click

from orchestrator import shard_ops
from orchestrator.cli_runtime import _run, _settings
from orchestrator.remote import remote_client


def _emit(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False))


def _count(value: int | None) -> str:
    return "-" if value is None else str(value)


@click.group()
def shards() -> None:
    """The shard map: which shards exist per class, and whether each takes new starts (active), only
    serves its runs (draining) or is gone (retired). Orchestrators started without --shards follow it."""


@shards.command(name="list")
@click.option("--json", "as_json", is_flag=True, help='Print JSON: {"version", "shards": [...]}.')
def shards_list(as_json: bool) -> None:
    """Every shard with its state, its queue's ready messages and consumers, its unfinished runs, unsent
    outbox entries, timers, dead letters, and the orchestrator process whose share it is ('-': none
    follows the map; a process pinned with --shards shows only as a consumer)."""
    if remote := remote_client():
        answer = _run(remote.request("GET", "/shards"))
        version, loads = answer["version"], [shard_ops.ShardLoad(**load) for load in answer["shards"]]
    else:
        shard_map, loads = _run(shard_ops.shard_loads(_settings()))
        version = shard_map.version
    if as_json:
        _emit({"version": version, "shards": [load.document() for load in loads]})
        return
    click.echo(f"shard map version {version}")
    header = ("SHARD", "STATE", "QUEUED", "CONSUMERS", "UNFINISHED", "OUTBOX", "TIMERS", "DEAD", "SERVED BY")
    click.echo("  ".join(f"{h:<10}" for h in header).rstrip())
    for load in loads:
        row = (
            load.shard,
            load.state,
            _count(load.queued),
            _count(load.consumers),
            str(load.unfinished_runs),
            str(load.outbox),
            str(load.timers),
            _count(load.dead_letters),
            load.serving or "-",
        )
        click.echo("  ".join(f"{c:<10}" for c in row).rstrip())


@shards.command(name="add")
@click.option("--class", "shard_class", required=True, help="The shard class to grow.")
@click.option("--count", type=click.IntRange(min=1), required=True, help="How many shards to add.")
@click.option("--json", "as_json", is_flag=True, help='Print JSON: {"added": [...]}.')
def shards_add(shard_class: str, count: int, as_json: bool) -> None:
    """Add COUNT active shards to a class (numbers continue after the highest ever used): their queues
    are declared and bound, new starts begin to land on them at once, running runs never move, and
    orchestrators that follow the map serve them within a few seconds."""
    if remote := remote_client():
        body = {"class": shard_class, "count": count}
        added = _run(remote.request("POST", "/shards", body=body))["added"]
    else:
        added = _run(shard_ops.add(_settings(), shard_class, count))
    if as_json:
        _emit({"added": added})
    else:
        click.echo(f"added {', '.join(added)}: active, taking new starts")


@shards.command(name="drain")
@click.argument("shard")
@click.option("--json", "as_json", is_flag=True, help='Print JSON: {"shard", "state"}.')
def shards_drain(shard: str, as_json: bool) -> None:
    """Stop new starts landing on SHARD (e.g. fast.3); it is served until its runs are finished. A start
    sent again for a run it owns still reaches it (the run-id index)."""
    if remote := remote_client():
        _run(remote.request("POST", f"/shards/{quote(shard, safe='')}/drain"))
    else:
        _run(shard_ops.drain(_settings(), shard))
    if as_json:
        _emit({"shard": shard, "state": "draining"})
    else:
        click.echo(f"{shard} is draining: no new starts; 'saga shards retire {shard}' once it holds nothing")


@shards.command(name="retire")
@click.argument("shard")
@click.option("--json", "as_json", is_flag=True, help='Print JSON: {"shard", "state"}.')
def shards_retire(shard: str, as_json: bool) -> None:
    """Retire a draining SHARD that holds nothing (no unfinished run, outbox entry, timer, queued message
    or dead letter; refused with what it holds otherwise): marked retired, left by the orchestrators, its
    queues deleted. Its finished runs stay readable until their retention ends."""
    if remote := remote_client():
        _run(remote.request("POST", f"/shards/{quote(shard, safe='')}/retire"))
    else:
        _run(shard_ops.retire(_settings(), shard))
    if as_json:
        _emit({"shard": shard, "state": "retired"})
    else:
        click.echo(f"{shard} is retired: its queues are deleted")

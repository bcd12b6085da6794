"""What a run is doing, for people: pure functions from documents to text. No I/O.

``orchestrator.observe`` reads the run record, its pinned plan, the broker and the serial lane, and builds
the status document with :func:`enrich` and :func:`waiting_reason`; the ``saga status``, ``watch``,
``history`` and ``runs`` commands and ``scripts/demo.py`` print it with the renderers here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from orchestrator.dsl.binding import bind
from orchestrator.engine.model import RunSnapshot, StageStatus
from orchestrator.engine.plan import reports_acceptance
from orchestrator.errors import BindingError
from orchestrator.store.spec import pinned_versions, snapshot_from_record

RESULT_WIDTH = 72
REASON_WIDTH = 60
WORK_TYPES = frozenset({"action", "worker", "map"})
TERMINAL_TERMS = frozenset({"completed", "failed"})
ARRIVED_STATES = frozenset(
    {StageStatus.COMPLETED, StageStatus.FAILED, StageStatus.CANCELLED, StageStatus.TIMED_OUT}
)
ICONS = {
    "dispatched": "…",
    "waiting": "…",
    "running": "▶",
    "retry-scheduled": "↻",
    "completed": "✔",
    "failed": "✘",
    "timed-out": "✘",
    "cancelled": "⊘",
    "compensated": "↺",
    "skipped": "·",
    "-": " ",
}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_UNIT_MS = {"s": 1_000, "m": 60_000, "h": 3_600_000, "d": 86_400_000, "w": 7 * 86_400_000}


# ---- small text helpers -------------------------------------------------------------------------------


def iso_utc(at_ms: int | None) -> str:
    """``1796173323456`` -> ``2026-12-02T01:02:03.456Z``; ``-`` for none."""
    if at_ms is None:
        return "-"
    moment = datetime.fromtimestamp(at_ms / 1000, UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def truncate(text: str, width: int) -> str:
    """One line of at most ``width`` characters (newlines flattened); ``…`` marks a cut."""
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: max(width - 1, 0)] + "…"


def compact(value: Any, width: int = RESULT_WIDTH) -> str:
    """A JSON value on one line, cut to ``width``."""
    return truncate(json.dumps(value, ensure_ascii=False, sort_keys=True, separators=(", ", ": ")), width)


def parse_since(text: str, now_ms: int) -> int:
    """``--since``: an ISO 8601 datetime (no zone: UTC) or a duration back from now (``90s``, ``15m``,
    ``2h``, ``1d``, ``1w``), as epoch milliseconds. Raises ValueError saying what is accepted."""
    match = _DURATION.match(text)
    if match:
        return now_ms - int(float(match.group(1)) * _UNIT_MS[match.group(2)])
    try:
        moment = datetime.fromisoformat(text.strip().replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise ValueError(
            f"{text!r} is neither an ISO 8601 datetime (2026-12-02T01:02:03Z) nor a duration "
            "(90s, 15m, 2h, 1d, 1w)"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return int(moment.timestamp() * 1000)


# ---- plan order ---------------------------------------------------------------------------------------


def _targets(stage: Mapping[str, Any]) -> list[str]:
    if stage["type"] == "decision":
        return [b["next"] for b in stage["branches"]] + [stage.get("on_evaluation_error", "failed")]
    if stage["type"] == "fork":
        return list(stage["branches"])
    return [stage.get("on_success", "completed"), stage.get("on_failure", "failed")]


def plan_order(plan: Mapping[str, Any]) -> list[str]:
    """The plan's stages in the order a run meets them: a topological order from the entry that follows a
    branch to its end before the next one, so a join comes after every branch it waits for and a stage
    two routes reach comes after both. (The stored plan keys stages by name: its order means nothing.)"""
    stages: Mapping[str, Mapping[str, Any]] = plan["stages"]
    edges = {name: [t for t in dict.fromkeys(_targets(s)) if t in stages] for name, s in stages.items()}
    waiting_on = dict.fromkeys(stages, 0)
    for targets in edges.values():
        for target in targets:
            waiting_on[target] += 1
    order: list[str] = []
    ready = [plan["entry"]] if plan["entry"] in stages else []
    while ready:
        name = ready.pop()
        order.append(name)
        freed = []
        for target in edges[name]:
            waiting_on[target] -= 1
            if waiting_on[target] == 0:
                freed.append(target)
        ready.extend(reversed(freed))  # the first route is walked first
    placed = set(order)
    return order + sorted(n for n in stages if n not in placed)  # unreachable (the compiler refuses it)


# ---- the status document ------------------------------------------------------------------------------


def enrich(
    document: Mapping[str, Any], record: Mapping[str, str], plan: Mapping[str, Any], *, inputs: bool = False
) -> dict[str, Any]:
    """``client.status_document(record)`` plus ``order`` (every stage of the pinned plan, in plan order)
    and, per recorded stage, what a person asks next: its ``result`` or ``error``, a map's ``items``
    (``done``/``total``), a join's ``arrived`` branches, a decision's ``branch`` and ``next``, and with
    ``inputs`` its ``input`` (bound again from the context and the results it read)."""
    snapshot = snapshot_from_record(record, {})
    stages: dict[str, dict[str, Any]] = {}
    for name, base in document["stages"].items():
        spec = plan["stages"].get(name, {})
        stage = {**base, "type": spec.get("type")}
        rec = snapshot.stages[name]
        if rec.result is not None:
            stage["result"] = rec.result
        if rec.error is not None:
            stage["error"] = rec.error
        stage.update(_progress(name, spec, snapshot, plan))
        if inputs and spec.get("type") in WORK_TYPES:
            stage.update(_input_of(name, spec, snapshot, plan))
        stages[name] = stage
    return {**document, "order": plan_order(plan), "stages": stages, "versions": run_versions(record, plan)}


def run_versions(record: Mapping[str, str], plan: Mapping[str, Any]) -> dict[str, Any]:
    """What the run pinned at creation: the tool versions stored beside its plan (``plan``), the engine
    that created it (``engine``) and, read off the pinned plan, its contract versions (``contracts``)."""
    return {**pinned_versions(record), "contracts": sorted(plan.get("contracts", {}))}


def _progress(
    name: str, spec: Mapping[str, Any], snapshot: RunSnapshot, plan: Mapping[str, Any]
) -> dict[str, Any]:
    rec = snapshot.stages[name]
    kind = spec.get("type")
    if kind == "map":
        total = rec.items if rec.items is not None else len(rec.result or [])
        remaining = snapshot.barriers.get(name)
        done = total if rec.status is StageStatus.COMPLETED or remaining is None else total - remaining
        return {"items": {"done": max(done, 0), "total": total}}
    if kind == "join":
        return {"arrived": _arrivals(name, spec, snapshot, plan)}
    if kind == "decision" and isinstance(rec.result, dict) and isinstance(rec.result.get("branch"), int):
        index = rec.result["branch"]
        branches = spec.get("branches", [])
        return {"branch": index, "next": branches[index]["next"] if index < len(branches) else None}
    return {}


def _arrivals(
    join: str, spec: Mapping[str, Any], snapshot: RunSnapshot, plan: Mapping[str, Any]
) -> dict[str, int]:
    """How many of the join's branches arrived: its barrier counter says how many it still awaits (the
    join is marked running from the moment its fork released the branches); without one, the branches'
    last stages say."""
    fork = plan["stages"].get(spec.get("fork", ""), {})
    total = len(fork.get("branches", spec.get("required", [])))
    rec = snapshot.stages[join]
    remaining = snapshot.barriers.get(join)
    if rec.status is StageStatus.COMPLETED:
        return {"done": total, "total": total}
    if remaining is not None:
        return {"done": max(total - remaining, 0), "total": total}
    ends = [n for n, s in plan["stages"].items() if s.get("arrives_at", {}).get("join") == join]
    done = sum(1 for n in ends if n in snapshot.stages and snapshot.stages[n].status in ARRIVED_STATES)
    return {"done": done, "total": total}


def _input_of(
    name: str, spec: Mapping[str, Any], snapshot: RunSnapshot, plan: Mapping[str, Any]
) -> dict[str, Any]:
    variables: dict[str, Any] = {
        "context": dict(snapshot.context),
        "stages": {
            n: {"state": r.status.value, "attempt": r.attempt, "result": r.result}
            for n, r in snapshot.stages.items()
        },
    }
    ref = spec.get("action") or spec.get("worker") or ""
    schema = plan.get("contracts", {}).get(ref, {}).get("input_schema")
    try:
        if spec["type"] != "map":
            return {"input": bind(spec.get("input", {}), variables, schema, f"{name}.input")}
        items = bind(spec["items"], variables, None, f"{name}.items")
        return {
            "input": [
                bind(spec.get("input", {}), {**variables, "item": item, "index": i}, schema, f"{name}.input")
                for i, item in enumerate(items)
            ]
        }
    except (BindingError, TypeError) as exc:
        return {"input_error": str(exc)}


def waiting_reason(
    *,
    run_id: str,
    stage: str,
    contract: str,
    queue: str,
    broker_queue: str,
    consumers: int | None,
    holder: Mapping[str, Any] | None,
    serial: bool,
) -> dict[str, Any] | None:
    """Why a dispatched stage that no worker accepted waits, when that can be known: nobody consumes its
    queue, or (a serial task) another task holds the serial lane. ``consumers`` None: not known."""
    if consumers == 0:
        return {
            "reason": "no-worker",
            "queue": broker_queue,
            "contract": contract,
            "message": f"waiting for a worker of {contract} (nobody consumes {broker_queue})",
        }
    if not serial or holder is None:
        return None
    if holder.get("run_id") == run_id and holder.get("stage") == stage:
        return None  # it holds the lane: a worker is running it
    since = holder.get("since_ms")
    held = f"{holder.get('run_id', '?')}/{holder.get('stage', '?')}"
    return {
        "reason": "serial-lane",
        "queue": broker_queue,
        "contract": contract,
        "holder": dict(holder),
        "message": f"waiting for the serial lane (held by {held} on {holder.get('worker', '?')} "
        f"since {iso_utc(since if isinstance(since, int) else None)})",
    }


# ---- rendering ----------------------------------------------------------------------------------------


def shown_state(stage: Mapping[str, Any] | None) -> str:
    """The state a person should read: a join is ``waiting`` until a branch has arrived (its record says
    running from the moment its fork released the branches); ``-`` for a stage not reached."""
    if not stage:
        return "-"
    state = str(stage["state"])
    arrived = stage.get("arrived")
    if state == StageStatus.RUNNING and arrived is not None and arrived["done"] == 0:
        return "waiting"
    return state


def progress(stage: Mapping[str, Any] | None) -> str:
    """``3/10`` for a map's items, ``1/2 arrived`` for a join; empty otherwise."""
    if not stage:
        return ""
    if "items" in stage:
        return f"{stage['items']['done']}/{stage['items']['total']}"
    if "arrived" in stage:
        return f"{stage['arrived']['done']}/{stage['arrived']['total']} arrived"
    return ""


def stage_detail(stage: Mapping[str, Any], width: int = RESULT_WIDTH) -> str:
    """What a stage came to, or why it waits, on one line."""
    parts = [progress(stage)] if progress(stage) else []
    if "waiting" in stage:
        parts.append(stage["waiting"]["message"])
    elif "lane" in stage:
        parts.append(stage["lane"])
    if "next" in stage:
        parts.append(f"→ {stage['next']} (branch {stage['branch']})")
    elif "error" in stage:
        parts.append("error: " + stage["error"])
    elif "result" in stage:
        parts.append(compact(stage["result"], width))
    return truncate("  ".join(parts), width + 100) if parts else ""  # room for a waiting reason


def status_lines(document: Mapping[str, Any], *, inputs: bool = False) -> list[str]:
    """``saga status`` as text: the run, then every stage of its plan in plan order."""
    lines = [
        f"{document['run_id']}  {document['definition']} {document['version']}  {document['state']}"
        + (f"  ({document['reason']})" if document.get("reason") else ""),
        f"created {iso_utc(document.get('created_at'))}"
        + (f"  finished {iso_utc(document['finished_at'])}" if document.get("finished_at") else ""),
    ]
    if document.get("output") is not None:
        lines.append(f"output {compact(document['output'])}")
    order = document.get("order") or sorted(document["stages"])
    width = max([len(n) for n in order] + [5])
    lines.append(f"  {'STAGE':<{width}}  {'STATE':<15} {'ATTEMPT':<7}  DETAIL")
    for name in order:
        stage = document["stages"].get(name)
        attempt = str(stage["attempt"]) if stage else ""
        detail = stage_detail(stage) if stage else ""
        lines.append(f"  {name:<{width}}  {shown_state(stage):<15} {attempt:<7}  {detail}".rstrip())
        if inputs and stage and ("input" in stage or "input_error" in stage):
            shown = compact(stage["input"]) if "input" in stage else "unknown: " + stage["input_error"]
            lines.append(f"  {'':<{width}}  input {shown}")
    return lines


def table_rows(document: Mapping[str, Any] | None, width: int = 20) -> list[str]:
    """The live table's rows (``saga watch``, the demo): an icon, each stage in plan order, its state,
    a map's ``done/total`` or a join's arrivals, and why a stage waits."""
    if not document:
        return []
    stages = document.get("stages", {})
    order = document.get("order") or sorted(stages)
    rows = []
    for name in order:
        stage = stages.get(name)
        state = shown_state(stage)
        extra = [progress(stage)] if progress(stage) else []
        if stage and "waiting" in stage:
            extra.append(stage["waiting"]["message"])
        shown = state if state != "-" else ""
        rows.append(f"   {ICONS.get(state, '?')} {name:<{width}} {shown:<15} {'  '.join(extra)}".rstrip())
    return rows


class LiveTable:
    """The live stage table: on a terminal, each frame redraws the last one in place; otherwise a frame is
    printed only when a row changed. Pure: :meth:`frame` returns the text to write (None: nothing)."""

    def __init__(self, tty: bool) -> None:
        self.tty = tty
        self.drawn = 0
        self.last: list[str] | None = None

    def frame(self, document: Mapping[str, Any] | None, elapsed_s: float) -> str | None:
        rows = table_rows(document)
        run_id = (document or {}).get("run_id", "…")
        header = f"  run {run_id}   state: {(document or {}).get('state', 'pending')}"
        if not self.tty:
            if [header, *rows] == self.last:  # the run's state is a change too
                return None
            self.last = [header, *rows]
            return "\n".join([f"{header}  (+{elapsed_s:.1f} s)", *rows]) + "\n"
        lines = [f"{header:<60} {elapsed_s:5.1f} s", *rows]
        up = f"\x1b[{self.drawn}F" if self.drawn else ""
        self.drawn = len(lines)
        return up + "\n".join(f"{line}\x1b[K" for line in lines) + "\n"


def history_line(event: Mapping[str, Any]) -> str:
    """One history event: sequence, ISO 8601 UTC time, kind, stage, then its other fields as JSON."""
    extra = {k: v for k, v in event.items() if k not in ("seq", "id", "at", "kind", "stage", "attempt")}
    where = event.get("stage") or ""
    detail = json.dumps(extra, ensure_ascii=False, sort_keys=True) if extra else ""
    attempt = f"#{event['attempt']}" if event.get("attempt") is not None else ""
    line = f"{event['seq']:>4} {iso_utc(event['at'])} {event['kind']:<26} {where:<22} {attempt:<4} {detail}"
    return line.rstrip()


RUN_COLUMNS = ("RUN", "DEFINITION", "VERSION", "STATE", "CREATED", "UPDATED", "REASON")


def runs_lines(rows: list[Mapping[str, Any]]) -> list[str]:
    """``saga runs`` as a table with a header; UPDATED is when the run finished, else its last event."""
    cells = [
        (
            str(r["run_id"]),
            str(r.get("definition") or "?"),
            str(r.get("version") or "?"),
            str(r["state"]),
            iso_utc(r.get("created_at")),
            iso_utc(r.get("finished_at") or r.get("updated_at")),
            truncate(str(r.get("reason") or ""), REASON_WIDTH),
        )
        for r in rows
    ]
    widths = [max([len(c[i]) for c in cells] + [len(RUN_COLUMNS[i])]) for i in range(len(RUN_COLUMNS))]
    return [
        "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(line)).rstrip()
        for line in [RUN_COLUMNS, *cells]
    ]


# ---- the live worker registry (rolling upgrades) ------------------------------------------------------


def with_live_workers(
    view: Mapping[str, Any],
    plan: Mapping[str, Any],
    serving: Mapping[str, Sequence[Mapping[str, Any]]],
    broker_queue: Callable[[str, str], str],
    *,
    broker_known: bool = True,
) -> dict[str, Any]:
    """The status document with, on each dispatched work stage, the live workers that serve its pinned
    contract version (``live_workers``; ``serving`` maps a contract ref to them), and its ``waiting``
    reason saying so: a ``no-worker`` one (nobody consumes its queue) says whether any live worker is
    registered for the version; without one, the stage waits for a version no live worker serves
    (``no-live-worker``, said only when the broker could not tell: a consumer it counted serves it) or,
    for a stage whose worker reports acceptance, for one of the live workers to take it
    (``not-accepted``). ``broker_queue(task queue, ref)`` names the contract queue."""
    stages: dict[str, Any] = {}
    for name, stage in view["stages"].items():
        spec = plan["stages"].get(name, {})
        if stage["state"] != StageStatus.DISPATCHED or spec.get("type") not in WORK_TYPES:
            stages[name] = stage
            continue
        ref = str(spec.get("action") or spec.get("worker"))
        workers = [dict(w) for w in serving.get(ref, [])]
        queue = broker_queue(str(spec.get("queue")), ref)
        accepts = reports_acceptance(spec)
        waiting = _live_wait(stage.get("waiting"), ref, queue, workers, accepts, broker_known)
        stages[name] = {**stage, "live_workers": workers, **({"waiting": waiting} if waiting else {})}
    return {**view, "stages": stages}


def _live_wait(
    waiting: Mapping[str, Any] | None,
    ref: str,
    queue: str,
    workers: list[dict[str, Any]],
    accepts: bool,
    broker_known: bool,
) -> dict[str, Any] | None:
    if waiting is not None:
        if waiting.get("reason") != "no-worker":
            return dict(waiting)
        live = f"{_workers(len(workers))} registered for it: {_who(workers)}" if workers else ""
        return {**waiting, "message": f"{waiting['message']}; {live or 'no live worker serves it'}"}
    if not workers and not broker_known:
        message = f"waiting for a worker of {ref} (no live worker serves it)"
        return {"reason": "no-live-worker", "queue": queue, "contract": ref, "message": message}
    if workers and accepts:
        serve = "serves" if len(workers) == 1 else "serve"
        message = f"waiting for a worker of {ref} to take it ({_workers(len(workers))} {serve} it)"
        return {"reason": "not-accepted", "queue": queue, "contract": ref, "message": message}
    return None


def _workers(n: int) -> str:
    return f"{n} live worker" if n == 1 else f"{n} live workers"


def _who(workers: Sequence[Mapping[str, Any]]) -> str:
    """``host:pid`` of each worker, ``(adapter to x@4)`` after one serving through an adapter."""
    return ", ".join(
        f"{w.get('host', '?')}:{w.get('pid', '?')}"
        + (f" (adapter to {w['adapter_to']})" if w.get("adapter_to") else "")
        for w in workers
    )


CONTRACT_COLUMNS = ("CONTRACT", "KIND", "QUEUE", "RUNS", "LIVE WORKERS")


def live_contract_lines(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """``saga contracts list --live`` as a table: each contract version, its kind and queue, the unfinished
    runs pinned to it and the live workers serving it, then one line per plan that pins it."""
    cells = []
    for row in rows:
        workers = row["workers"]
        if workers:
            served = _who(workers)
        elif row["pinned_runs"]:
            served = "none: its runs wait for a worker"
        else:
            served = "none: new runs of a version using it would wait" if row.get("startable") else "none"
        kind, queue = str(row.get("kind") or "?"), str(row.get("queue") or "?")
        cells.append((row["ref"], kind, queue, str(row["pinned_runs"]), served))
    widths = [max([len(c[i]) for c in cells] + [len(CONTRACT_COLUMNS[i])]) for i in range(4)]
    lines = []
    for row, line in zip([{}, *rows], [CONTRACT_COLUMNS, *cells], strict=True):
        padded = [cell.ljust(widths[i]) for i, cell in enumerate(line[:4])]
        lines.append("  ".join([*padded, line[4]]).rstrip())
        for pinned in row.get("plans", []):
            if pinned["runs"] or pinned.get("startable"):
                runs = f"{pinned['runs']} unfinished run{'s' if pinned['runs'] != 1 else ''}"
                may = "; new runs may start on it" if pinned.get("startable") else ""
                lines.append(
                    f"    pinned by {pinned['definition']} {pinned['version']} ({pinned['digest'][:19]}…): "
                    f"{runs}{may}"
                )
    return lines

"""Render a compiled plan as a Mermaid flowchart, in the style of the seed's model-ingest diagram.

Solid arrows are success and decision routes; dotted arrows are failure and evaluation-error routes. Both
terminal intents lead to the finalisers, which expose the final state.
"""

from __future__ import annotations

from collections import deque
from typing import Any

_SHAPES = {
    "action": ('["', '"]'),
    "worker": ('[["', '"]]'),
    "map": ('[/"', '"/]'),
    "decision": ('{"', '"}'),
    "fork": ('{{"', '"}}'),
    "join": ('{{"', '"}}'),
}


def render_mermaid(plan: dict[str, Any]) -> str:
    stages: dict[str, dict[str, Any]] = plan["stages"]
    lines = ["flowchart LR", f'  start(("entry")) --> {_id(plan["entry"])}']
    for name in _order(plan):
        lines.append(f"  {_id(name)}{_node(name, stages[name])}")
    for name in _order(plan):
        lines.extend(_edges(name, stages[name]))
    lines.extend(_terminals(plan))
    return "\n".join(lines) + "\n"


def _order(plan: dict[str, Any]) -> list[str]:
    """Stages breadth-first from the entry, so the text reads in the order a run would."""
    stages = plan["stages"]
    seen, queue, order = {plan["entry"]}, deque([plan["entry"]]), []
    while queue:
        name = queue.popleft()
        order.append(name)
        for nxt in _targets(stages[name]):
            if nxt in stages and nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)
    return order + sorted(set(stages) - seen)


def _targets(stage: dict[str, Any]) -> list[str]:
    if stage["type"] == "decision":
        return [b["next"] for b in stage["branches"]] + [stage["on_evaluation_error"]]
    if stage["type"] == "fork":
        return list(stage["branches"])
    return [stage["on_success"], stage["on_failure"]]


def _node(name: str, stage: dict[str, Any]) -> str:
    kind = stage["type"]
    detail = {
        "action": stage.get("action"),
        "worker": f"{stage.get('worker')} on {stage.get('queue')}",
        "map": f"{stage.get('worker')} per item, max {stage.get('max_items')}",
        "fork": "fork",
        "join": f"join: all {'/'.join(stage.get('acceptable_terminal_states', []))}",
    }.get(kind)
    label = f"{name}<br/>{detail}" if detail else name
    left, right = _SHAPES[kind]
    return f"{left}{_escape(label)}{right}"


def _edges(name: str, stage: dict[str, Any]) -> list[str]:
    src = _id(name)
    kind = stage["type"]
    if kind == "fork":
        return [f"  {src} --> {_id(b)}" for b in stage["branches"]]
    if kind == "decision":
        out = []
        for branch in stage["branches"]:
            label = "fallback" if branch["when"].strip() == "true" else _short(branch["when"])
            out.append(f'  {src} -->|"{_escape(label)}"| {_id(branch["next"])}')
        out.append(f'  {src} -. "evaluation error" .-> {_id(stage["on_evaluation_error"])}')
        return out
    return [
        f'  {src} -->|"success"| {_id(stage["on_success"])}',
        f'  {src} -. "failure" .-> {_id(stage["on_failure"])}',
    ]


def _terminals(plan: dict[str, Any]) -> list[str]:
    finalisers = plan.get("finalisers") or []
    label = "finalise in declared order: " + ", ".join(finalisers) if finalisers else "no finalisers"
    lines = [f'  Z["{_escape(label)}"]']
    for terminal in plan["terminals"]:
        lines.append(f'  {_id(terminal)}(["{terminal} intent"]) --> Z')
    lines.append('  Z -->|"completed intent and every finaliser succeeded"| C(["completed"])')
    lines.append('  Z -->|"failed intent or a finaliser failed"| X(["failed"])')
    return lines


def _id(name: str) -> str:
    if name in ("completed", "failed"):
        return f"T_{name}"
    # stage names are [a-z0-9_-]: map '_' to 'U' so that a-b and a_b stay distinct nodes
    return "S_" + name.replace("_", "U").replace("-", "_")


def _short(text: str, limit: int = 48) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _escape(text: str) -> str:
    return text.replace('"', "#quot;")

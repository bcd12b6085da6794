"""Layer 2, graph semantics: names, references in every edge namespace, reachability, cycles, decision
fallbacks, and fork/join structure.

Besides reporting problems it derives what the engine needs and the contract layer checks against:

* ``joins``: each join's fork and branches (in the fork's order);
* ``arrivals``: which stage ends which branch (a branch arrives when the stage that ends it routes to the
  join);
* ``available``: for each node, the stages whose *result* exists on every path that reaches it. A join is
  an AND node: what any of its branches guaranteed is available after it.
"""

from __future__ import annotations

import difflib
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from orchestrator.compiler.report import Reporter
from orchestrator.dsl.models import (
    DecisionStage,
    Definition,
    ForkStage,
    JoinStage,
    MapStage,
    Terminal,
    WorkStage,
)
from orchestrator.dsl.paths import Path

FALLBACK = "true"


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    kind: str  # success | failure | decision | evaluation_error | fork
    path: Path  # where the reference is written


@dataclass(frozen=True)
class JoinInfo:
    fork: str
    branches: tuple[str, ...]


@dataclass(frozen=True)
class Arrival:
    join: str
    branch: str


@dataclass
class GraphFacts:
    index: dict[str, int] = field(default_factory=dict)
    edges: list[Edge] = field(default_factory=list)
    joins: dict[str, JoinInfo] = field(default_factory=dict)
    arrivals: dict[str, Arrival] = field(default_factory=dict)
    available: dict[str, frozenset[str]] = field(default_factory=dict)
    valid: bool = False


def stage_edges(defn: Definition, index: dict[str, int]) -> list[Edge]:
    edges: list[Edge] = []
    for position, stage in enumerate(defn.stages):
        base: Path = ("stages", position)
        if isinstance(stage, DecisionStage):
            for i, branch in enumerate(stage.branches):
                edges.append(Edge(stage.name, branch.next, "decision", (*base, "branches", i, "next")))
            edges.append(
                Edge(
                    stage.name, stage.on_evaluation_error, "evaluation_error", (*base, "on_evaluation_error")
                )
            )
        elif isinstance(stage, ForkStage):
            for i, name in enumerate(stage.branches):
                edges.append(Edge(stage.name, name, "fork", (*base, "branches", i)))
        else:
            edges.append(Edge(stage.name, stage.on_success, "success", (*base, "on_success")))
            edges.append(Edge(stage.name, stage.on_failure, "failure", (*base, "on_failure")))
    return edges


def analyse_graph(defn: Definition, report: Reporter) -> GraphFacts:
    facts = GraphFacts()
    before = len(report.problems)
    _index_names(defn, facts, report)
    facts.edges = stage_edges(defn, facts.index)
    terminals = {t.value for t in defn.terminals}
    _check_targets(defn, facts, terminals, report)
    dangling = len(report.problems) > before
    _check_decisions(defn, facts, report)
    resolved = [e for e in facts.edges if e.target in facts.index]
    acyclic = _check_acyclic(facts, resolved, report)
    # A misspelt target makes everything behind it look unreachable and every branch through it look
    # unjoined: report the misspelling alone, and these checks once the references resolve.
    if not dangling:
        _check_reachable(defn, facts, resolved, report)
        if acyclic:
            _check_forks_and_joins(defn, facts, resolved, report)
    facts.valid = len(report.problems) == before
    if facts.valid:
        facts.available = _available_results(defn, facts)
    return facts


def _index_names(defn: Definition, facts: GraphFacts, report: Reporter) -> None:
    for i, stage in enumerate(defn.stages):
        if stage.name in facts.index:
            first = facts.index[stage.name]
            report.add(
                ("stages", i, "name"),
                f"duplicate stage name {stage.name!r} (first declared as "
                f"stages[{first}]); stage names must be unique",
            )
            continue
        if stage.name in {t.value for t in Terminal}:
            report.add(("stages", i, "name"), f"{stage.name!r} is a terminal intent and cannot name a stage")
            continue
        facts.index[stage.name] = i
    if defn.entry not in facts.index:
        report.add(("entry",), f"entry {defn.entry!r} is not a stage{_suggest(defn.entry, facts.index)}")


def _check_targets(defn: Definition, facts: GraphFacts, terminals: set[str], report: Reporter) -> None:
    for edge in facts.edges:
        if edge.target in facts.index:
            continue
        if edge.kind == "fork":
            kind = "terminal" if edge.target in {t.value for t in Terminal} else "unknown stage"
            report.add(
                edge.path,
                f"fork branch {edge.target!r} must be a stage ({kind}){_suggest(edge.target, facts.index)}",
            )
        elif edge.target in {t.value for t in Terminal}:
            if edge.target not in terminals:
                report.add(
                    edge.path,
                    f"routes to terminal {edge.target!r}, which is not declared in "
                    f"terminals ({', '.join(sorted(terminals))})",
                )
        else:
            report.add(
                edge.path,
                f"{_edge_label(edge)} {edge.target!r} is neither a stage nor a declared "
                f"terminal{_suggest(edge.target, [*facts.index, *terminals])}",
            )


def _edge_label(edge: Edge) -> str:
    return {
        "success": "on_success target",
        "failure": "on_failure target",
        "decision": "decision branch target",
        "evaluation_error": "on_evaluation_error target",
    }[edge.kind]


def _suggest(name: str, candidates: object) -> str:
    names = [str(c) for c in candidates]  # type: ignore[attr-defined]
    close = difflib.get_close_matches(name, names, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _check_decisions(defn: Definition, facts: GraphFacts, report: Reporter) -> None:
    for position, stage in enumerate(defn.stages):
        if not isinstance(stage, DecisionStage):
            continue
        base: Path = ("stages", position, "branches")
        fallbacks = [i for i, b in enumerate(stage.branches) if b.when.strip() == FALLBACK]
        last = len(stage.branches) - 1
        if not fallbacks:
            report.add(base, f'decision has no fallback; add a last branch with when: "{FALLBACK}"')
        elif fallbacks[0] != last:
            report.add(
                (*base, fallbacks[0], "when"),
                f'the fallback (when: "{FALLBACK}") must be the last branch; '
                f"the {last - fallbacks[0]} branch(es) after it can never be taken",
            )


def _check_reachable(defn: Definition, facts: GraphFacts, edges: list[Edge], report: Reporter) -> None:
    if defn.entry not in facts.index:
        return
    adjacency = _adjacency(edges)
    seen = {defn.entry}
    queue = deque([defn.entry])
    while queue:
        for nxt in adjacency.get(queue.popleft(), []):
            if nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)
    for name, i in facts.index.items():
        if name not in seen:
            report.add(
                ("stages", i, "name"), f"is unreachable from entry {defn.entry!r}; route to it or remove it"
            )


def _adjacency(edges: list[Edge]) -> dict[str, list[str]]:
    adjacency: dict[str, list[str]] = {}
    for edge in edges:
        adjacency.setdefault(edge.source, []).append(edge.target)
    return adjacency


def _check_acyclic(facts: GraphFacts, edges: list[Edge], report: Reporter) -> bool:
    adjacency = _adjacency(edges)
    colour: dict[str, int] = {}  # 1 on the stack, 2 done
    for start in facts.index:
        if colour.get(start):
            continue
        stack: list[tuple[str, int]] = [(start, 0)]
        trail: list[str] = []
        while stack:
            node, i = stack.pop()
            if i == 0:
                colour[node] = 1
                trail.append(node)
            succ = adjacency.get(node, [])
            if i < len(succ):
                stack.append((node, i + 1))
                nxt = succ[i]
                if colour.get(nxt) == 1:
                    cycle = [*trail[trail.index(nxt) :], nxt]
                    report.add(
                        ("stages", facts.index[nxt], "name"),
                        f"cycle: {' -> '.join(cycle)}; workflows are acyclic (use retry for repetition)",
                    )
                    return False
                if not colour.get(nxt):
                    stack.append((nxt, 0))
            else:
                colour[node] = 2
                trail.pop()
    return True


def _check_forks_and_joins(defn: Definition, facts: GraphFacts, edges: list[Edge], report: Reporter) -> None:
    forks = {s.name: s for s in defn.stages if isinstance(s, ForkStage)}
    joins = {s.name: s for s in defn.stages if isinstance(s, JoinStage)}
    branch_of: dict[str, str] = {}
    for fork in forks.values():
        for i, branch in enumerate(fork.branches):
            path: Path = ("stages", facts.index[fork.name], "branches", i)
            if branch in branch_of:
                report.add(
                    path,
                    f"stage {branch!r} is already a branch of fork {branch_of[branch]!r}; "
                    "a stage can start only one branch",
                )
            elif branch in joins:
                report.add(path, f"branch {branch!r} is a join; a branch must start with a working stage")
            else:
                branch_of[branch] = fork.name
    joined_by = _match_joins(joins, branch_of, facts, report)
    adjacency = _adjacency(edges)
    for fork in forks.values():
        mine = [j for j, f in joined_by.items() if f == fork.name]
        path = ("stages", facts.index[fork.name], "branches")
        if not mine:
            report.add(
                path,
                f"fork {fork.name!r} has no join; add a join stage whose required lists "
                f"{', '.join(fork.branches)}",
            )
            continue
        if len(mine) > 1:
            report.add(
                path,
                f"fork {fork.name!r} is joined by several joins ({', '.join(sorted(mine))}); "
                "one join must wait for all its branches",
            )
            continue
        _check_branch_regions(
            fork, joins[mine[0]], adjacency, facts, report, {s.name: s for s in defn.stages}
        )


def _match_joins(
    joins: dict[str, JoinStage], branch_of: dict[str, str], facts: GraphFacts, report: Reporter
) -> dict[str, str]:
    """join -> the fork whose branches its ``required`` names."""
    joined_by: dict[str, str] = {}
    for join in joins.values():
        base: Path = ("stages", facts.index[join.name], "required")
        owners = set()
        for i, name in enumerate(join.required):
            if name not in branch_of:
                report.add(
                    (*base, i),
                    f"required {name!r} is not a fork branch; list the branches of the "
                    f"fork this join waits for{_suggest(name, branch_of)}",
                )
            else:
                owners.add(branch_of[name])
        for i, name in enumerate(join.required):
            if name in join.required[:i]:
                report.add((*base, i), f"required lists {name!r} more than once")
        if len(owners) > 1:
            report.add(
                base,
                f"required mixes branches of forks {', '.join(sorted(owners))}; "
                "a join waits for the branches of one fork",
            )
        elif owners:
            joined_by[join.name] = owners.pop()
    return joined_by


def _check_branch_regions(
    fork: ForkStage,
    join: JoinStage,
    adjacency: dict[str, list[str]],
    facts: GraphFacts,
    report: Reporter,
    stages: dict[str, object],
) -> None:
    """Each branch must reach the join, branches must not share stages, and ``required`` must name
    exactly the branches that reach the join (which, since every branch must, is all of them; a required
    name that is no branch of this fork is reported by ``_match_joins``)."""
    owner: dict[str, str] = {}
    reaching = set()
    join_path: Path = ("stages", facts.index[join.name], "required")
    after_join = _region(join.name, "", adjacency) - {join.name}
    for branch in fork.branches:
        if branch not in facts.index or branch == join.name or isinstance(stages.get(branch), JoinStage):
            continue  # already reported: not a stage, or a join
        region = _region(branch, join.name, adjacency)
        for stage in sorted((region - {join.name}) & after_join):
            report.add(
                ("stages", facts.index[stage], "name"),
                f"is reachable from branch {branch!r} of fork {fork.name!r} without passing its join "
                f"{join.name!r}, and again after the join, so it could run twice; route the branch there "
                "only through the join (arrive at it, with acceptable_terminal_states) or end at a terminal",
            )
        for stage in region - {join.name}:
            if stage in owner and owner[stage] != branch:
                report.add(
                    ("stages", facts.index[stage], "name"),
                    f"is reachable from both branch {owner[stage]!r} and branch {branch!r} of fork "
                    f"{fork.name!r}; branches must not share stages before their join",
                )
            owner.setdefault(stage, branch)
        if join.name in region:
            reaching.add(branch)
            for stage in region - {join.name}:
                if join.name in adjacency.get(stage, []):
                    facts.arrivals[stage] = Arrival(join.name, branch)
        else:
            report.add(
                ("stages", facts.index[fork.name], "branches", fork.branches.index(branch)),
                f"branch {branch!r} of fork {fork.name!r} never routes to its join {join.name!r}",
            )
    required = set(join.required)
    for branch in sorted(reaching - required):
        report.add(
            join_path,
            f"branch {branch!r} of fork {fork.name!r} reaches join {join.name!r} but is "
            "missing from required",
        )
    facts.joins[join.name] = JoinInfo(fork.name, tuple(fork.branches))
    _check_join_entries(fork, join, facts, report)


def _check_join_entries(fork: ForkStage, join: JoinStage, facts: GraphFacts, report: Reporter) -> None:
    """Only the stages that end a branch may route to the join: anything else would arrive as no branch."""
    for edge in facts.edges:
        if edge.target == join.name and edge.kind != "fork" and edge.source not in facts.arrivals:
            report.add(
                edge.path,
                f"routes to join {join.name!r}, but is not on a branch of fork {fork.name!r}; "
                "only the stages that end a branch may route to its join",
            )


def _region(branch: str, join: str, adjacency: dict[str, list[str]]) -> set[str]:
    """Stages reachable from a branch's first stage without passing through its join."""
    seen = {branch}
    queue = deque([branch])
    while queue:
        node = queue.popleft()
        if node == join:
            continue
        for nxt in adjacency.get(node, []):
            if nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)
    return seen


def _available_results(defn: Definition, facts: GraphFacts) -> dict[str, frozenset[str]]:
    """Forward data-flow over the acyclic graph: which stage results exist on every path to a node."""
    by_name = {s.name: s for s in defn.stages}
    incoming: dict[str, list[Edge]] = {}
    for edge in facts.edges:
        incoming.setdefault(edge.target, []).append(edge)
    order = _topological(defn, facts)
    available: dict[str, frozenset[str]] = {}
    for node in order:
        edges = incoming.get(node, [])
        if node == defn.entry or not edges:
            available[node] = frozenset()
            continue
        if node in facts.joins:
            available[node] = _join_available(node, edges, facts, available, by_name)
            continue
        outs = [_edge_out(e, available, by_name) for e in edges if e.source in available]
        available[node] = frozenset.intersection(*outs) if outs else frozenset()
    return available


def _edge_out(
    edge: Edge, available: dict[str, frozenset[str]], by_name: Mapping[str, object]
) -> frozenset[str]:
    produced = edge.kind == "success" and isinstance(by_name.get(edge.source), WorkStage | MapStage)
    before = available[edge.source]
    return before | {edge.source} if produced else before


def _join_available(
    node: str,
    edges: list[Edge],
    facts: GraphFacts,
    available: dict[str, frozenset[str]],
    by_name: Mapping[str, object],
) -> frozenset[str]:
    union: set[str] = set()
    for branch in facts.joins[node].branches:
        outs = [
            _edge_out(e, available, by_name)
            for e in edges
            if facts.arrivals.get(e.source, Arrival("", "")).branch == branch and e.source in available
        ]
        if outs:
            union |= frozenset.intersection(*outs)
    return frozenset(union)


def _topological(defn: Definition, facts: GraphFacts) -> list[str]:
    nodes = [*facts.index, *(t.value for t in defn.terminals)]
    indegree = dict.fromkeys(nodes, 0)
    adjacency = _adjacency(facts.edges)
    for edge in facts.edges:
        indegree[edge.target] = indegree.get(edge.target, 0) + 1
    queue = deque(n for n in nodes if indegree[n] == 0)
    order = []
    while queue:
        node = queue.popleft()
        order.append(node)
        for nxt in adjacency.get(node, []):
            indegree[nxt] -= 1
            if indegree[nxt] == 0:
                queue.append(nxt)
    return order

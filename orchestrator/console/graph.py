"""Lay out a compiled plan's graph server-side and render it as a standalone SVG for the web console.

Pure: a plan dict in, an SVG string out; the same plan always gives the same bytes. The layout is grandalf's
Sugiyama (layered, top to bottom). The SVG carries hooks rather than colours: every stage is a
``<g class="stage" data-stage=... data-type=... data-state="">`` the console's stylesheet styles by
``data-state``, map stages carry an empty ``<text class="progress">`` the console fills in, and edges are
classed ``edge-success``, ``edge-failure`` or ``edge-branch``. Presentation attributes hold only neutral
defaults, which any stylesheet rule overrides. Names and CEL conditions come from user definitions, so every
text and attribute is escaped here, and nothing in the output refers outside the document.

Each stage that routes to a terminal intent gets its own small terminal node
(``<g class="terminal" data-terminal="failed" data-source="<stage>">``): one shared ``failed`` would pull
a long edge from nearly every stage across the drawing. The edge walk mirrors
``orchestrator.compiler.mermaid`` (``_targets``/``_edges``, which write Mermaid text directly); here it is
data, :func:`edges`.
"""

from __future__ import annotations

import itertools
import math
import re
import threading
import unicodedata
from collections import deque
from collections.abc import Iterator, Mapping, Sequence, Set
from dataclasses import dataclass, replace
from typing import Any, Literal, NamedTuple
from xml.sax.saxutils import escape

from grandalf import graphs as _grandalf  # type: ignore[import-untyped]
from grandalf.layouts import SugiyamaLayout  # type: ignore[import-untyped]

EdgeKind = Literal["success", "failure", "branch"]
Shape = Literal["rect", "diamond", "pill"]
Point = tuple[float, float]

MARGIN = 16.0
X_SPACE = 28.0  # between neighbours in a layer
Y_SPACE = 40.0  # between layers: room for the arrows
COMPONENT_GAP = 40.0
DUMMY_W = 12.0
PARALLEL_GAP = 14.0  # how far apart edges joining the same two nodes bow
LABEL_CHAR_W, DETAIL_CHAR_W = 7.8, 6.6  # rough advance at 13 px and 11 px sans-serif
PAD_X = 14.0
STAGE_H, MAP_H, DECISION_H, TERMINAL_H = 46.0, 60.0, 64.0, 28.0
MIN_STAGE_W, MIN_TERMINAL_W = 96.0, 72.0
LABEL_MAX, DETAIL_MAX = 64, 48  # characters shown; the <title> has the full text
NEUTRAL_FILL, NEUTRAL_STROKE, NEUTRAL_TEXT, MUTED_TEXT = "#ffffff", "#64748b", "#0f172a", "#64748b"

# grandalf keeps Tarjan's counter on the Vertex class: two layouts at once would share it
_GRANDALF = threading.Lock()
# characters XML 1.0 cannot carry at all, even escaped
_NOT_XML = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
_ATTR_ENTITIES = {'"': "&quot;", "\n": "&#10;", "\r": "&#13;", "\t": "&#9;"}
# one arrowhead per edge kind, so that a stylesheet can colour each to match its edges
_MARKER = (
    '<marker id="plan-arrow-{0}" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7"'
    ' orient="auto"><path class="arrow arrow-{0}" d="M0,0 L10,5 L0,10 z" fill="{1}"/></marker>'
)
_DEFS = f"<defs>{''.join(_MARKER.format(k, NEUTRAL_STROKE) for k in ('success', 'failure', 'branch'))}</defs>"


class NodeKey(NamedTuple):
    """A node of the drawing: a stage, or the copy of a terminal intent one stage routes to."""

    kind: Literal["stage", "terminal"]
    name: str
    source: str = ""  # terminals: the stage whose routes end here


@dataclass(frozen=True)
class PlanEdge:
    """One route out of a stage: to another stage or to a terminal intent."""

    source: str
    target: str
    kind: EdgeKind
    title: str | None = None  # decision branches: the ``when`` condition


@dataclass(frozen=True)
class Box:
    """A laid-out node: its centre (x, y) and size, in SVG user units."""

    name: str  # a stage's name or a terminal intent
    shape: Shape
    x: float
    y: float
    w: float
    h: float
    source: str | None = None  # terminals: the stage whose routes end here

    @property
    def key(self) -> NodeKey:
        if self.source is None:
            return NodeKey("stage", self.name)
        return NodeKey("terminal", self.name, self.source)

    @property
    def left(self) -> float:
        return self.x - self.w / 2

    @property
    def right(self) -> float:
        return self.x + self.w / 2

    @property
    def top(self) -> float:
        return self.y - self.h / 2

    @property
    def bottom(self) -> float:
        return self.y + self.h / 2


@dataclass(frozen=True)
class Route:
    """An edge and the points its path runs through, from the source's border to the target's."""

    edge: PlanEdge
    points: tuple[Point, ...]


@dataclass(frozen=True)
class Layout:
    """Node positions and edge routes for a plan; (0, 0) is the top left corner."""

    width: float
    height: float
    stages: Mapping[str, Box]
    terminals: Mapping[tuple[str, str], Box]  # by (source stage, terminal intent)
    routes: tuple[Route, ...]


# ---- the plan's edges ------------------------------------------------------------------------------


def edges(plan: Mapping[str, Any]) -> list[PlanEdge]:
    """Every route of the plan, stage by stage in :func:`stage_order`, in declared order within a stage."""
    stages = plan["stages"]
    return [edge for name in stage_order(plan) for edge in _stage_edges(name, stages[name])]


def _stage_edges(name: str, stage: Mapping[str, Any]) -> list[PlanEdge]:
    kind = stage.get("type")
    if kind == "fork":
        out = [PlanEdge(name, str(branch), "branch") for branch in stage.get("branches", [])]
    elif kind == "decision":
        out = [PlanEdge(name, str(b["next"]), "branch", str(b["when"])) for b in stage.get("branches", [])]
        on_error = stage.get("on_evaluation_error")
        if on_error is not None:
            out.append(PlanEdge(name, str(on_error), "failure", "on evaluation error"))
    else:
        routes: tuple[tuple[str, EdgeKind], ...] = (("on_success", "success"), ("on_failure", "failure"))
        out = [PlanEdge(name, str(stage[f]), k) for f, k in routes if stage.get(f) is not None]
    return out


def stage_order(plan: Mapping[str, Any]) -> list[str]:
    """Stages breadth-first from the entry (each stage's routes in declared order), then any others by
    name: the order nodes are handed to the layout, so the main line tends to the left."""
    stages = plan["stages"]
    entry = plan.get("entry")
    seen: set[str] = {str(entry)} if entry in stages else set()
    queue, order = deque(seen), list[str]()
    while queue:
        name = queue.popleft()
        order.append(name)
        for edge in _stage_edges(name, stages[name]):
            if edge.target in stages and edge.target not in seen:
                seen.add(edge.target)
                queue.append(edge.target)
    return order + sorted(set(stages) - seen)


# ---- nodes ---------------------------------------------------------------------------------------


def _target_key(edge: PlanEdge, stage_names: Set[str]) -> NodeKey:
    # each stage gets its own copy of a terminal: one shared "failed" would pull a long edge from every
    # stage across the whole drawing
    if edge.target in stage_names:
        return NodeKey("stage", edge.target)
    return NodeKey("terminal", edge.target, edge.source)


def _nodes(plan: Mapping[str, Any], plan_edges: Sequence[PlanEdge]) -> list[Box]:
    stages = plan["stages"]
    nodes = [_stage_node(name, stages[name]) for name in stage_order(plan)]
    terminals = dict.fromkeys(_target_key(e, stages.keys()) for e in plan_edges if e.target not in stages)
    return nodes + [_terminal_node(key) for key in terminals]


def _stage_node(name: str, stage: Mapping[str, Any]) -> Box:
    kind = str(stage.get("type"))
    label_w = _text_w(_short(name, LABEL_MAX), LABEL_CHAR_W)
    detail_w = _text_w(_short(_detail(stage), DETAIL_MAX), DETAIL_CHAR_W)
    if kind == "decision":
        # a line |dy| from a diamond's centre has w * (1 - 2|dy|/h) of room
        need = [(label_w + 12) / (1 - 2 * 10 / DECISION_H), (detail_w + 12) / (1 - 2 * 20 / DECISION_H)]
        return Box(name, "diamond", 0.0, 0.0, max(*need, 120.0), DECISION_H)
    w = max(label_w, detail_w, MIN_STAGE_W - 2 * PAD_X) + 2 * PAD_X
    return Box(name, "rect", 0.0, 0.0, w, MAP_H if kind == "map" else STAGE_H)


def _terminal_node(key: NodeKey) -> Box:
    w = max(_text_w(_short(key.name, LABEL_MAX), DETAIL_CHAR_W) + 2 * PAD_X, MIN_TERMINAL_W)
    return Box(key.name, "pill", 0.0, 0.0, w, TERMINAL_H, key.source)


def _detail(stage: Mapping[str, Any]) -> str:
    """The contract a work stage calls, else the stage's type."""
    ref = stage.get("action") or stage.get("worker")
    return str(ref) if ref else str(stage.get("type"))


def _text_w(text: str, char_w: float) -> float:
    return sum(2 * char_w if unicodedata.east_asian_width(c) in "WF" else char_w for c in text)


def _short(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


# ---- layout ----------------------------------------------------------------------------------------


class _View:
    """The ``view`` grandalf reads a vertex's size from and writes its centre (or an edge's path) to."""

    def __init__(self, w: float = 0.0, h: float = 0.0) -> None:
        self.w, self.h, self.xy, self.points = w, h, (0.0, 0.0), list[Point]()

    def setpath(self, points: list[Point]) -> None:
        self.points = [(float(x), float(y)) for x, y in points]


def layout(plan: Mapping[str, Any]) -> Layout:
    """Place every stage, and a terminal node for each stage that routes to a terminal intent, in layers
    from top to bottom."""
    plan_edges = edges(plan)
    nodes = _nodes(plan, plan_edges)
    stage_names = plan["stages"].keys()
    pairs = _layout_pairs(plan_edges, stage_names, [n.key for n in nodes])
    with _GRANDALF:
        centres, paths = _place(nodes, pairs)
    boxes = {n.key: replace(n, x=centres[n.key][0], y=centres[n.key][1]) for n in nodes}
    return _framed(boxes, _routes(plan_edges, stage_names, boxes, paths))


def _framed(boxes: Mapping[NodeKey, Box], routes: Sequence[Route]) -> Layout:
    """Everything moved so that the drawing, bowed edges included, starts ``MARGIN`` from the top left."""
    points = [p for r in routes for p in r.points]
    dx = MARGIN - min([b.left for b in boxes.values()] + [x for x, _ in points])
    dy = MARGIN - min([b.top for b in boxes.values()] + [y for _, y in points])
    moved = {k: replace(b, x=b.x + dx, y=b.y + dy) for k, b in boxes.items()}
    routes = [Route(r.edge, tuple((x + dx, y + dy) for x, y in r.points)) for r in routes]
    corners = [(b.right, b.bottom) for b in moved.values()] + [p for r in routes for p in r.points]
    return Layout(
        width=max(x for x, _ in corners) + MARGIN,
        height=max(y for _, y in corners) + MARGIN,
        stages={k.name: b for k, b in moved.items() if k.kind == "stage"},
        terminals={(k.source, k.name): b for k, b in moved.items() if k.kind == "terminal"},
        routes=tuple(routes),
    )


def _layout_pairs(
    plan_edges: Sequence[PlanEdge], stage_names: Set[str], order: Sequence[NodeKey]
) -> list[tuple[NodeKey, NodeKey]]:
    """One downward edge per pair of joined nodes, no self loops; edges closing a cycle are turned round
    (plans are acyclic once compiled, but the layout must not depend on that)."""
    adjacency: dict[NodeKey, list[NodeKey]] = {key: [] for key in order}
    for e in plan_edges:
        src, dst = NodeKey("stage", e.source), _target_key(e, stage_names)
        if src != dst and dst not in adjacency[src]:
            adjacency[src].append(dst)
    # in reverse DFS finishing order every forward edge points later: keep those, turn back edges round
    position = _dfs_finish_order(adjacency, order)
    down = ((a, b) if position[a] < position[b] else (b, a) for a in order for b in adjacency[a])
    return list(dict.fromkeys(down))


def _dfs_finish_order(
    adjacency: Mapping[NodeKey, list[NodeKey]], order: Sequence[NodeKey]
) -> dict[NodeKey, int]:
    """Each node's index in reverse DFS finishing order (a topological order if the graph is acyclic)."""
    finished: list[NodeKey] = []
    visited: set[NodeKey] = set()
    for root in order:
        if root in visited:
            continue
        visited.add(root)
        stack: list[tuple[NodeKey, Iterator[NodeKey]]] = [(root, iter(adjacency[root]))]
        while stack:
            node, children = stack[-1]
            child = next((c for c in children if c not in visited), None)
            if child is None:
                stack.pop()
                finished.append(node)
            else:
                visited.add(child)
                stack.append((child, iter(adjacency[child])))
    return {key: i for i, key in enumerate(reversed(finished))}


def _place(
    nodes: Sequence[Box], pairs: Sequence[tuple[NodeKey, NodeKey]]
) -> tuple[dict[NodeKey, Point], dict[tuple[NodeKey, NodeKey], list[Point]]]:
    """Lay out each connected component with Sugiyama and set the components side by side."""
    centres: dict[NodeKey, Point] = {}
    paths: dict[tuple[NodeKey, NodeKey], list[Point]] = {}
    left = 0.0
    for members, component_pairs in _components(nodes, pairs):
        c_centres, c_paths = _sugiyama(members, component_pairs)
        xs = [c_centres[n.key][0] + side * n.w / 2 for n in members for side in (-1, 1)]
        xs += [x for path in c_paths.values() for x, _ in path]
        shift = left - min(xs)
        centres.update({key: (x + shift, y) for key, (x, y) in c_centres.items()})
        paths.update({pair: [(x + shift, y) for x, y in path] for pair, path in c_paths.items()})
        left = max(xs) + shift + COMPONENT_GAP
    return centres, paths


def _components(
    nodes: Sequence[Box], pairs: Sequence[tuple[NodeKey, NodeKey]]
) -> list[tuple[list[Box], list[tuple[NodeKey, NodeKey]]]]:
    """Connected components, each in node order, ordered by their first node."""
    parent = {n.key: n.key for n in nodes}

    def find(key: NodeKey) -> NodeKey:
        while parent[key] != key:
            parent[key] = parent[parent[key]]
            key = parent[key]
        return key

    for a, b in pairs:
        parent[find(a)] = find(b)
    groups: dict[NodeKey, tuple[list[Box], list[tuple[NodeKey, NodeKey]]]] = {}
    for n in nodes:
        groups.setdefault(find(n.key), ([], []))[0].append(n)
    for pair in pairs:
        groups[find(pair[0])][1].append(pair)
    return list(groups.values())


def _sugiyama(
    members: Sequence[Box], pairs: Sequence[tuple[NodeKey, NodeKey]]
) -> tuple[dict[NodeKey, Point], dict[tuple[NodeKey, NodeKey], list[Point]]]:
    # graph_core, not Graph: Graph gathers edges in a set, and set order would make the layout vary by run
    vertices = {n.key: _grandalf.Vertex(n.key) for n in members}
    for n in members:
        vertices[n.key].view = _View(n.w, n.h)
    g_edges = []
    for a, b in pairs:
        edge = _grandalf.Edge(vertices[a], vertices[b])
        edge.view = _View()
        g_edges.append(edge)
    core = _grandalf.graph_core(list(vertices.values()), g_edges)
    sugiyama = SugiyamaLayout(core)
    sugiyama.xspace, sugiyama.yspace = X_SPACE, Y_SPACE
    sugiyama.dw = DUMMY_W  # a long edge's bends: grandalf makes them as wide as the median node
    roots = [v for v in vertices.values() if not v.e_in()]
    sugiyama.init_all(roots=roots, inverted_edges=[])
    sugiyama.draw(8)
    _separate(sugiyama)
    sugiyama.draw_edges()
    centres = {key: (float(v.view.xy[0]), float(v.view.xy[1])) for key, v in vertices.items()}
    return centres, {pair: e.view.points for pair, e in zip(pairs, g_edges, strict=True)}


def _separate(sugiyama: Any) -> None:
    """Push apart any two neighbours in a layer closer than ``xspace``: a guard, as the averaged
    Brandes-Koepf placement keeps them apart in theory but grandalf's is not proven to."""
    for layer in sugiyama.layers:
        row = sorted(layer, key=lambda v: (v.view.xy[0], sugiyama.grx[v].pos))
        for prev, cur in itertools.pairwise(row):
            least = prev.view.xy[0] + (prev.view.w + cur.view.w) / 2 + sugiyama.xspace
            if cur.view.xy[0] < least:
                cur.view.xy = (least, cur.view.xy[1])


# ---- routes ----------------------------------------------------------------------------------------


def _routes(
    plan_edges: Sequence[PlanEdge],
    stage_names: Set[str],
    boxes: Mapping[NodeKey, Box],
    paths: Mapping[tuple[NodeKey, NodeKey], list[Point]],
) -> tuple[Route, ...]:
    ends = [(NodeKey("stage", e.source), _target_key(e, stage_names)) for e in plan_edges]
    groups: dict[frozenset[NodeKey], list[int]] = {}
    for i, (src, dst) in enumerate(ends):
        groups.setdefault(frozenset((src, dst)), []).append(i)
    routes: list[Route] = []
    for i, (e, (src, dst)) in enumerate(zip(plan_edges, ends, strict=True)):
        if src == dst:
            routes.append(Route(e, _loop(boxes[src])))
            continue
        # edges joining the same two nodes share a layout path and bow apart from it
        group = groups[frozenset((src, dst))]
        forward = (src, dst) in paths
        path = _bowed(
            paths[(src, dst) if forward else (dst, src)],
            (group.index(i) - (len(group) - 1) / 2) * PARALLEL_GAP,
        )
        if not forward:
            path.reverse()
        routes.append(Route(e, _clipped(path, boxes[src], boxes[dst])))
    return tuple(routes)


def _bowed(path: list[Point], offset: float) -> list[Point]:
    """Shift the path's inner points ``offset`` to its right, adding a midpoint to a straight one."""
    if offset == 0:
        return list(path)
    if len(path) == 2:
        (x0, y0), (x1, y1) = path
        path = [path[0], ((x0 + x1) / 2, (y0 + y1) / 2), path[1]]
    (x0, y0), (x1, y1) = path[0], path[-1]
    length = math.hypot(x1 - x0, y1 - y0) or 1.0
    nx, ny = -(y1 - y0) / length, (x1 - x0) / length
    inner = [(x + nx * offset, y + ny * offset) for x, y in path[1:-1]]
    return [path[0], *inner, path[-1]]


def _clipped(path: list[Point], src: Box, dst: Box) -> tuple[Point, ...]:
    """The path from the source's border to the target's, rather than centre to centre."""
    return (_border(src, path[1]), *path[1:-1], _border(dst, path[-2]))


def _border(box: Box, toward: Point) -> Point:
    """Where the ray from the box's centre toward a point leaves the box."""
    dx, dy = toward[0] - box.x, toward[1] - box.y
    if dx == 0 and dy == 0:
        return (box.x, box.y)
    hw, hh = box.w / 2, box.h / 2
    if box.shape == "diamond":
        t = 1 / (abs(dx) / hw + abs(dy) / hh)
    else:
        t = min(hw / abs(dx) if dx else math.inf, hh / abs(dy) if dy else math.inf)
    t = min(t, 1.0)
    return (box.x + dx * t, box.y + dy * t)


def _loop(box: Box) -> tuple[Point, ...]:
    """A route from a node back to itself, round its right side."""
    x, y = box.right, box.y
    return ((x, y - 8), (x + 24, y - 14), (x + 24, y + 14), (x, y + 8))


# ---- SVG -------------------------------------------------------------------------------------------


def plan_svg(plan: Mapping[str, Any]) -> str:
    """The plan's graph as a standalone SVG document (no script, no external references)."""
    placed = layout(plan)
    finalisers = [str(f) for f in plan.get("finalisers") or []]
    height = placed.height + (22.0 if finalisers else 0.0)
    name, version = str(plan.get("name", "")), str(plan.get("version", ""))
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="plan-graph" data-plan={_attr(name)}'
        f" data-version={_attr(version)} width={_attr(_n(placed.width))} height={_attr(_n(height))}"
        f' viewBox="0 0 {_n(placed.width)} {_n(height)}" role="img" font-family="sans-serif">',
        f"<title>{_text(f'{name} {version}'.strip())}</title>",
        _DEFS,
        '<g class="edges">',
        *(_edge_svg(route) for route in placed.routes),
        '</g>\n<g class="nodes">',
        *(_stage_svg(box, plan["stages"][box.name]) for box in placed.stages.values()),
        *(_terminal_svg(box) for box in placed.terminals.values()),
        "</g>",
    ]
    if finalisers:
        caption = _short("finalisers: " + ", ".join(finalisers), 160)
        out.append(
            f'<text class="finalisers" x="{_n(MARGIN)}" y="{_n(placed.height + 8)}" font-size="11"'
            f' fill="{MUTED_TEXT}">{_text(caption)}</text>'
        )
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _edge_svg(route: Route) -> str:
    e = route.edge
    dash = ' stroke-dasharray="5 4"' if e.kind == "failure" else ""
    title = f"<title>{_text(e.title)}</title>" if e.title is not None else ""
    return (
        f'<path class="edge edge-{e.kind}" data-from={_attr(e.source)} data-to={_attr(e.target)}'
        f' d="{_path_d(route.points)}" fill="none" stroke="{NEUTRAL_STROKE}" stroke-width="1.5"{dash}'
        f' marker-end="url(#plan-arrow-{e.kind})">{title}</path>'
    )


def _path_d(points: Sequence[Point]) -> str:
    """Straight through two points; through more, corners rounded by quadratic curves."""
    if len(points) == 2:
        return f"M{_p(points[0])} L{_p(points[1])}"
    parts = [f"M{_p(points[0])}", f"L{_p(_mid(points[0], points[1]))}"]
    for i in range(1, len(points) - 1):
        parts.append(f"Q{_p(points[i])} {_p(_mid(points[i], points[i + 1]))}")
    parts.append(f"L{_p(points[-1])}")
    return " ".join(parts)


def _stage_svg(box: Box, stage: Mapping[str, Any]) -> str:
    kind = str(stage.get("type"))
    label, detail = _short(box.name, LABEL_MAX), _short(_detail(stage), DETAIL_MAX)
    top = box.y - 6 if kind == "map" else box.y + (5 if box.shape == "diamond" else 0)
    parts = [
        f'<g class="stage" id={_attr("stage-" + safe_id(box.name))} data-stage={_attr(box.name)}'
        f' data-type={_attr(kind)} data-state="">',
        f"<title>{_text(_tooltip(box.name, stage))}</title>",
        _shape_svg(box),
        f'<text class="label" x="{_n(box.x)}" y="{_n(top - 4)}" text-anchor="middle" font-size="13"'
        f' font-weight="600" fill="{NEUTRAL_TEXT}">{_text(label)}</text>',
        f'<text class="detail" x="{_n(box.x)}" y="{_n(top + 12)}" text-anchor="middle" font-size="11"'
        f' fill="{MUTED_TEXT}">{_text(detail)}</text>',
    ]
    if kind == "map":
        parts.append(
            f'<text class="progress" data-stage={_attr(box.name)} x="{_n(box.x)}" y="{_n(top + 26)}"'
            f' text-anchor="middle" font-size="11" fill="{MUTED_TEXT}"></text>'
        )
    parts.append("</g>")
    return "".join(parts)


def _shape_svg(box: Box) -> str:
    paint = f'fill="{NEUTRAL_FILL}" stroke="{NEUTRAL_STROKE}" stroke-width="1.5"'
    if box.shape == "diamond":
        corners = [(box.x, box.top), (box.right, box.y), (box.x, box.bottom), (box.left, box.y)]
        return f'<polygon class="shape" points="{" ".join(_p(c) for c in corners)}" {paint}/>'
    radius = box.h / 2 if box.shape == "pill" else 6.0
    return (
        f'<rect class="shape" x="{_n(box.left)}" y="{_n(box.top)}" width="{_n(box.w)}"'
        f' height="{_n(box.h)}" rx="{_n(radius)}" {paint}/>'
    )


def _tooltip(name: str, stage: Mapping[str, Any]) -> str:
    fields = [
        f"{field}: {stage[field]}"
        for field in ("action", "worker", "queue", "compensate")
        if stage.get(field)
    ]
    return "\n".join([f"{name} ({stage.get('type')})", *fields])


def _terminal_svg(box: Box) -> str:
    source = box.source or ""
    return (
        f'<g class="terminal" id={_attr(f"terminal-{safe_id(source)}_to_{safe_id(box.name)}")}'
        f" data-terminal={_attr(box.name)} data-source={_attr(source)}>{_shape_svg(box)}"
        f'<text class="label" x="{_n(box.x)}" y="{_n(box.y + 4)}" text-anchor="middle" font-size="11"'
        f' fill="{NEUTRAL_TEXT}">{_text(_short(box.name, LABEL_MAX))}</text></g>'
    )


def safe_id(name: str) -> str:
    """A name as an id fragment: [a-z0-9-] kept, '_' doubled, anything else as ``_x<hex>_``. Distinct
    names stay distinct, and ``_to_`` can join two fragments unambiguously."""
    out = []
    for c in name:
        if c == "_":
            out.append("__")
        elif c == "-" or ("a" <= c <= "z") or ("0" <= c <= "9"):
            out.append(c)
        else:
            out.append(f"_x{ord(c):x}_")
    return "".join(out)


def _text(value: str) -> str:
    return escape(_NOT_XML.sub("\ufffd", value))


def _attr(value: str) -> str:
    return '"' + escape(_NOT_XML.sub("\ufffd", value), _ATTR_ENTITIES) + '"'


def _n(value: float) -> str:
    """A coordinate with one decimal at most, so output does not depend on float noise."""
    text = f"{round(value, 1) + 0.0:.1f}"
    return text[:-2] if text.endswith(".0") else text


def _p(point: Point) -> str:
    return f"{_n(point[0])},{_n(point[1])}"


def _mid(a: Point, b: Point) -> Point:
    return ((a[0] + b[0]) / 2, (a[1] + b[1]) / 2)

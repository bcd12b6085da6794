"""Safe YAML loading that keeps line numbers and refuses hostile input early.

PyYAML's ``compose`` builds a node graph in which an alias is the *same* node object as its anchor, so a
"billion laughs" file composes cheaply; it only explodes when expanded. We expand the nodes ourselves,
counting every node we produce, and stop at the first limit crossed. Scalars are constructed by PyYAML's
``SafeConstructor``, so no tag can instantiate Python objects.

The result is plain data plus a :class:`SourceMap` from paths (tuples of keys and indices) to line numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import yaml

from orchestrator.dsl.paths import Path, render_path
from orchestrator.errors import DefinitionError, Problem


@dataclass(frozen=True)
class YamlLimits:
    """Bounds applied while loading a definition file; the defaults fit any sane definition."""

    max_bytes: int = 1_048_576
    max_depth: int = 64
    max_nodes: int = 100_000
    max_aliases: int = 100


@dataclass
class SourceMap:
    """Where each value of a loaded document was written: path -> 1-based line."""

    file: str
    lines: dict[Path, int] = field(default_factory=dict)

    def line_for(self, path: Path) -> int:
        """The line of ``path`` or, if it was never written (a missing field), of its nearest ancestor."""
        for end in range(len(path), -1, -1):
            line = self.lines.get(path[:end])
            if line is not None:
                return line
        return 1


@dataclass(frozen=True)
class LoadedDocument:
    data: Any
    source: SourceMap


_PLAIN_COLLECTION_TAGS = frozenset({"tag:yaml.org,2002:map", "tag:yaml.org,2002:seq"})


class _LimitExceeded(Exception):
    def __init__(self, message: str, line: int, path: Path = ()) -> None:
        super().__init__(message)
        self.message = message
        self.line = line
        self.path = path


class _Expander:
    """Turns a composed node graph into plain data, recording lines and enforcing limits."""

    def __init__(self, loader: yaml.SafeLoader, source: SourceMap, limits: YamlLimits) -> None:
        self._loader = loader
        self._source = source
        self._limits = limits
        self._nodes = 0
        self._aliases = 0
        self._seen: set[int] = set()
        self.problems: list[Problem] = []

    def expand(self, node: yaml.Node, path: Path, depth: int, key_line: int | None = None) -> Any:
        line = node.start_mark.line + 1
        self._count(node, depth, line)
        self._source.lines.setdefault(path, key_line or line)
        if isinstance(node, yaml.CollectionNode) and node.tag not in _PLAIN_COLLECTION_TAGS:
            raise _LimitExceeded(f"tag {node.tag!r} is not allowed in a definition", line, path)
        if isinstance(node, yaml.MappingNode):
            return self._mapping(node, path, depth)
        if isinstance(node, yaml.SequenceNode):
            return [self.expand(item, (*path, i), depth + 1) for i, item in enumerate(node.value)]
        try:
            value = self._loader.construct_object(node, deep=True)
        except yaml.YAMLError as exc:
            raise _LimitExceeded(f"cannot read value: {_first_line(exc)}", line, path) from exc
        if isinstance(value, float) and not math.isfinite(value):  # JSON (and the plan) has no NaN/inf
            message = f"{node.value} is not a JSON number; write a finite number, or quote it for a string"
            self.problems.append(Problem(self._source.file, line, render_path(path), message))
        return value

    def _count(self, node: yaml.Node, depth: int, line: int) -> None:
        if id(node) in self._seen and isinstance(node, yaml.CollectionNode):
            self._aliases += 1
            if self._aliases > self._limits.max_aliases:
                raise _LimitExceeded(
                    f"more than {self._limits.max_aliases} alias expansions; "
                    "a definition should not need anchors at this scale (possible 'billion laughs' input)",
                    line,
                )
        self._seen.add(id(node))
        self._nodes += 1
        if self._nodes > self._limits.max_nodes:
            raise _LimitExceeded(
                f"document expands to more than {self._limits.max_nodes} values; "
                "split the definition or check for runaway aliases",
                line,
            )
        if depth > self._limits.max_depth:
            raise _LimitExceeded(f"nesting deeper than {self._limits.max_depth} levels", line)

    def _key(self, node: yaml.Node, depth: int) -> Any:
        line = node.start_mark.line + 1
        self._count(node, depth, line)
        if not isinstance(node, yaml.ScalarNode):
            raise _LimitExceeded("mapping keys must be plain strings", line)
        try:
            return self._loader.construct_object(node)
        except yaml.YAMLError as exc:
            raise _LimitExceeded(f"cannot read key: {_first_line(exc)}", line) from exc

    def _mapping(self, node: yaml.MappingNode, path: Path, depth: int) -> dict[str, Any]:
        explicit = sum(1 for key, _ in node.value if key.tag != "tag:yaml.org,2002:merge")
        self._loader.flatten_mapping(node)  # resolves YAML merge keys (<<) the safe way
        merged = len(node.value) - explicit  # flatten_mapping puts the merged pairs first
        result: dict[str, Any] = {}
        written: set[str] = set()
        for index, (key_node, value_node) in enumerate(node.value):
            key_line = key_node.start_mark.line + 1
            key = self._key(key_node, depth + 1)
            if not isinstance(key, str):
                self.problems.append(
                    Problem(self._source.file, key_line, render_path(path), f"key {key!r} must be a string")
                )
                continue
            if key in written:
                first = self._source.lines.get((*path, key), key_line)
                self.problems.append(
                    Problem(
                        self._source.file,
                        key_line,
                        render_path((*path, key)),
                        f"duplicate key {key!r} (first written on line {first}); remove one of them",
                    )
                )
                continue
            if key in result:  # an explicit key overrides a merged one: forget the merged value's lines
                prefix = (*path, key)
                for stale in [p for p in self._source.lines if p[: len(prefix)] == prefix]:
                    del self._source.lines[stale]
            if index >= merged:
                written.add(key)
            result[key] = self.expand(value_node, (*path, key), depth + 1, key_line)
        return result


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _check_depth(text: str, limits: YamlLimits) -> None:
    """Apply the depth limit to the (iterative) event stream, before PyYAML's recursive composer
    sees the document: a few kilobytes of brackets would otherwise raise RecursionError."""
    open_collections = 0
    probe = yaml.SafeLoader(text)
    try:
        while probe.check_event():
            event = probe.get_event()  # type: ignore[no-untyped-call]
            if isinstance(event, yaml.NodeEvent) and open_collections > limits.max_depth:
                line = event.start_mark.line + 1 if event.start_mark else 1
                raise _LimitExceeded(f"nesting deeper than {limits.max_depth} levels", line)
            if isinstance(event, yaml.CollectionStartEvent):
                open_collections += 1
            elif isinstance(event, yaml.CollectionEndEvent):
                open_collections -= 1
    finally:
        probe.dispose()


def load_yaml(text: str | bytes, file: str, limits: YamlLimits | None = None) -> LoadedDocument:
    """Parse one YAML document safely; raise :class:`DefinitionError` listing what is wrong."""
    limits = limits or YamlLimits()
    raw = text.encode("utf-8") if isinstance(text, str) else text
    if len(raw) > limits.max_bytes:
        raise DefinitionError(
            [Problem(file, 1, "definition", f"file is {len(raw)} bytes, over the {limits.max_bytes} limit")]
        )
    source = SourceMap(file)
    text = raw.decode("utf-8", errors="replace")
    try:
        loader = yaml.SafeLoader(text)
    except yaml.YAMLError as exc:  # the reader refuses control characters before parsing starts
        position = getattr(exc, "position", 0) or 0
        line = text.count("\n", 0, position) + 1
        raise DefinitionError(
            [Problem(file, line, "definition", f"invalid YAML: {_first_line(exc)}")]
        ) from exc
    try:
        _check_depth(text, limits)
        root = loader.get_single_node()
        if root is None:
            raise DefinitionError([Problem(file, 1, "definition", "file is empty; expected a definition")])
        expander = _Expander(loader, source, limits)
        data = expander.expand(root, (), 0)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else 1
        problem = exc.problem or _first_line(exc)
        if exc.context and problem.startswith("but "):
            problem = f"{exc.context} {problem}"
        raise DefinitionError([Problem(file, line, "definition", f"invalid YAML: {problem}")]) from exc
    except yaml.YAMLError as exc:
        raise DefinitionError([Problem(file, 1, "definition", f"invalid YAML: {_first_line(exc)}")]) from exc
    except _LimitExceeded as exc:
        raise DefinitionError([Problem(file, exc.line, render_path(exc.path), exc.message)]) from exc
    finally:
        loader.dispose()
    if expander.problems:
        raise DefinitionError(expander.problems)
    return LoadedDocument(data, source)

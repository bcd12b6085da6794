"""Per-namespace allowlists: which contracts and task queues a definition may use, by the start of its name.

The file that ``SAGA_ALLOWLIST_FILE`` names (format: ``docs/allowlists.md``)::

    namespaces:
      "media-":                       # definitions whose name starts with media-
        contracts: ["thumbnail.render@3", "thumbnail.render@*", "cache.*"]
        queues: ["tasks.parallel", "rendering"]
      "":                             # optional catch-all for every other definition
        contracts: ["audit.*@1"]

A contract pattern is ``name@version``, ``name@*`` or a name alone (any version); ``*`` in a name or a
queue matches any run of characters, dots included. The longest prefix that starts the definition's name
applies; a definition no prefix matches is unrestricted. Within an entry, a list left out does not
restrict (``contracts:`` alone leaves queues open) and an empty list allows nothing. The contracts checked
are those of stages, compensations and finalisers; the queues, every queue their tasks are sent to.

:func:`parse_allowlist` is pure; the edge (``orchestrator/allowlists.py``, for the CLI and provisioning)
reads the file once and passes the :class:`Allowlist` to ``compile_text``, which does no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import ErrorDetails

from orchestrator.compiler.report import Reporter
from orchestrator.compiler.usage import QueueUse, Role, Usage
from orchestrator.dsl.paths import Path, render_path
from orchestrator.dsl.yaml_source import SourceMap, load_yaml
from orchestrator.errors import DefinitionError, Problem, SagaError

SETTING = "SAGA_ALLOWLIST_FILE"
FORMAT_DOC = "docs/allowlists.md"
#: The start of a definition name (``orchestrator.dsl.models.NAME_PATTERN``), or "" for the catch-all.
PREFIX_PATTERN = r"^([a-z][a-z0-9_-]{0,63})?$"
CONTRACT_PATTERN = r"^[a-z*][a-z0-9_.*-]{0,127}(@([1-9][0-9]{0,5}|\*))?$"
QUEUE_PATTERN = r"^[a-z*][a-z0-9_.*-]{0,127}$"

ContractPattern = Annotated[str, Field(pattern=CONTRACT_PATTERN)]
QueuePattern = Annotated[str, Field(pattern=QUEUE_PATTERN)]


class AllowlistError(SagaError):
    """Raised when the allowlist file cannot be read or is not a valid allowlist: a configuration error."""

    code = "allowlist_invalid"
    id_fields = ("file",)
    #: The CLI's exit code for a configuration error (``orchestrator/cli_errors.py``).
    exit_code: ClassVar[int] = 2

    def __init__(
        self, file: str, reason: str, problems: list[Problem] | None = None, todo: str | None = None
    ) -> None:
        self.file = file
        self.problems = sorted(problems or [])
        todo = todo or f"fix it (the format is in {FORMAT_DOC}) or unset {SETTING}"
        lines = "".join(f"\n{p}" for p in self.problems)
        super().__init__(f"allowlist {file} ({SETTING}) {reason}; {todo}{lines}")


class Rules(BaseModel):
    """What the definitions of one prefix may use; a list left out does not restrict."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    contracts: list[ContractPattern] | None = None
    queues: list[QueuePattern] | None = None

    def allows_contract(self, ref: str) -> bool:
        return self.contracts is None or any(_contract_matches(p, ref) for p in self.contracts)

    def allows_queue(self, queue: str) -> bool:
        return self.queues is None or any(_glob(p).fullmatch(queue) for p in self.queues)


class _Document(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    namespaces: dict[str, Rules]


@dataclass(frozen=True)
class Allowlist:
    """A loaded allowlist: definition-name prefix -> :class:`Rules`; ``file`` names it in messages."""

    file: str
    namespaces: Mapping[str, Rules]

    def rules_for(self, name: str) -> tuple[str, Rules] | None:
        """The longest prefix of ``name`` with an entry, and its rules; None if no entry applies."""
        matching = [prefix for prefix in self.namespaces if name.startswith(prefix)]
        if not matching:
            return None
        prefix = max(matching, key=len)
        return prefix, self.namespaces[prefix]


# ---- loading -----------------------------------------------------------------------------------------


def parse_allowlist(text: str | bytes, file: str) -> Allowlist:
    """Parse an allowlist document; raises :class:`AllowlistError` listing every problem."""
    if not text.strip():
        raise AllowlistError(file, "is empty; it needs a namespaces: mapping")
    try:
        document = load_yaml(text, file)
    except DefinitionError as exc:
        problems = [Problem(p.file, p.line, _rendered(p.path), p.message) for p in exc.problems]
        raise AllowlistError(file, "is not valid YAML", problems) from exc
    problems = _problems(document.data, document.source)
    if problems:
        raise AllowlistError(file, "is invalid", problems)
    parsed = _Document.model_validate(document.data)
    return Allowlist(file, dict(parsed.namespaces))


def _problems(data: Any, source: SourceMap) -> list[Problem]:
    def problem(path: Path, message: str) -> Problem:
        return Problem(source.file, source.line_for(path), _rendered(render_path(path)), message)

    if not isinstance(data, dict):
        return [
            problem((), "an allowlist is a mapping with one key, namespaces: (prefix -> contracts, queues)")
        ]
    found: list[Problem] = []
    try:
        _Document.model_validate(data)
    except ValidationError as exc:
        for error in exc.errors(include_url=False):
            path, message = _translate(error)
            found.append(problem(path, message))
    namespaces = data.get("namespaces")
    for prefix in namespaces if isinstance(namespaces, dict) else ():
        if not re.match(PREFIX_PATTERN, prefix):
            found.append(problem(("namespaces", prefix), _prefix_hint(prefix)))
    return found


def _translate(error: ErrorDetails) -> tuple[Path, str]:
    path: Path = tuple(error["loc"])
    kind = error["type"]
    if kind == "missing":
        return path[:-1], f"missing {path[-1]!r}: the mapping of definition-name prefixes to their rules"
    if kind == "extra_forbidden":
        allowed = "namespaces" if len(path) == 1 else "contracts, queues"
        return path, f"unknown field {path[-1]!r} (allowed: {allowed})"
    if kind == "string_pattern_mismatch":
        if "contracts" in path:
            hint = "write name@version, name@* or a name with * (any version), e.g. cache.*"
        else:
            hint = "write a queue name, * matching any characters, e.g. tasks.*"
        return path, f"{error['input']!r} is not a pattern: {hint}"
    if kind in {"model_type", "dict_type"}:
        if len(path) == 1:
            return path, 'must map definition-name prefixes to entries, e.g. "media-": {queues: [tasks.*]}'
        return path, "an entry is a mapping with contracts: and/or queues:, lists of patterns"
    if kind == "string_type":
        return path, f"must be a pattern (a string), got {error.get('input')!r:.60}; quote it in YAML"
    if kind == "list_type":
        return path, f"must be a list of patterns, e.g. [{'cache.*' if 'contracts' in path else 'tasks.*'}]"
    return path, f"{error['msg']} (got {error.get('input')!r:.60})"


def _prefix_hint(prefix: str) -> str:
    if "." in prefix:
        return (
            f"prefix {prefix!r} can match no definition: definition names have no '.'; "
            f"end it with '-' or '_' instead, e.g. {prefix.replace('.', '-')!r}"
        )
    return (
        f"prefix {prefix!r} is not the start of a definition name: use lowercase letters, digits, '-' and "
        "'_', starting with a letter, or \"\" for every definition no other prefix matches"
    )


def _rendered(path: str) -> str:
    return "allowlist" if path == "definition" else path


# ---- checking ----------------------------------------------------------------------------------------


def check_allowlist(name: str, usage: Usage, allowlist: Allowlist, report: Reporter) -> None:
    """Report every contract and queue in ``usage`` that the entry for definition ``name`` does not allow."""
    match = allowlist.rules_for(name)
    if match is None:
        return
    prefix, rules = match
    scope = (
        f"definitions named '{prefix}*'" if prefix else "definitions no other prefix matches (the '' entry)"
    )
    by = f"by allowlist {allowlist.file}"
    entry = f"have it added to the allowlist's {prefix!r} entry"
    if rules.contracts is not None:
        allowed = ", ".join(rules.contracts) or "none"
        for use in usage.contracts:
            if not rules.allows_contract(use.ref):
                report.add(
                    use.path,
                    f"contract {use.ref!r} is not allowed for {scope} {by} (allowed: {allowed}); "
                    f"use an allowed {'contract' if use.role is Role.STAGE else use.role.value}, or {entry}",
                )
    if rules.queues is not None:
        allowed = ", ".join(rules.queues) or "none"
        for queue in usage.queues:
            if not rules.allows_queue(queue.queue):
                report.add(
                    queue.path,
                    f"queue {queue.describe()} is not allowed for {scope} {by} (allowed: {allowed}); "
                    f"{_instead(queue)}, or {entry}",
                )


def _instead(use: QueueUse) -> str:
    if use.written:
        return "name an allowed queue"
    if use.role is Role.STAGE:
        return "name an allowed queue with queue:"
    return f"use a {use.role.value} whose contract declares an allowed queue"


def _contract_matches(pattern: str, ref: str) -> bool:
    name, _, version = ref.rpartition("@")
    name_pattern, _, version_pattern = pattern.partition("@")
    return bool(_glob(name_pattern).fullmatch(name)) and version_pattern in ("", "*", version)


@lru_cache(maxsize=1024)
def _glob(pattern: str) -> re.Pattern[str]:
    """``*`` matches any run of characters (dots too); everything else matches itself."""
    return re.compile(".*".join(re.escape(part) for part in pattern.split("*")))

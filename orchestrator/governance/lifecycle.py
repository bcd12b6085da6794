"""The lifecycle of definition versions, as pure functions of a definition's state.

A version is ``(name, version) -> digest``, written once. Its states, and the verbs that move it:

=============  ==========================  =================================================
verb           from                        to
=============  ==========================  =================================================
publish        (new)                       published
approve        published                   approved (not by its publisher, where required)
activate       approved, standby           active; the active one before it -> standby
canary         approved, standby           canary (P % of new runs, the rest stay on active)
promote        canary                      active; the active one before it -> standby
abort          canary                      approved
rollback       standby                     active (the one active before the current one)
retire         published, approved,        retired (final)
               standby
=============  ==========================  =================================================

Each verb takes the current :class:`DefinitionState` and returns a :class:`Change`: the state after and the
audit records that say who did what, when and why; or raises :class:`LifecycleRefused` with the reason.
Storing a change (atomically, over the revision it was computed from) is ``governance/store.py``'s job.
No I/O and no clock here: the time and the actor are passed in.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from orchestrator.errors import SagaError


class State(StrEnum):
    PUBLISHED = "published"
    APPROVED = "approved"
    ACTIVE = "active"
    CANARY = "canary"
    STANDBY = "standby"
    RETIRED = "retired"


#: States a run may be created from (DESIGN invariant 12: approved and not retired).
STARTABLE = frozenset({State.APPROVED, State.ACTIVE, State.CANARY, State.STANDBY})
#: States ``activate`` and ``canary`` accept: approved, now or before.
ACTIVATABLE = frozenset({State.APPROVED, State.STANDBY})
CANARY_BUCKETS = 10_000


class LifecycleRefused(SagaError):
    """A lifecycle verb that the definition's state does not allow; nothing was changed."""

    code = "lifecycle_refused"
    id_fields = ("definition", "version", "reason")

    def __init__(self, definition: str, version: str | None, reason: str, message: str) -> None:
        self.definition = definition
        self.version = version
        self.reason = reason
        super().__init__(message)


class VersionConflict(SagaError):
    """Publishing a (name, version) that is already stored with another digest."""

    code = "version_exists"
    id_fields = ("definition", "version", "digest", "stored_digest")

    def __init__(self, definition: str, version: str, digest: str, stored_digest: str) -> None:
        self.definition = definition
        self.version = version
        self.digest = digest
        self.stored_digest = stored_digest
        super().__init__(
            f"{definition} {version} is already published with digest {stored_digest}; this file compiles "
            f"to {digest}. A published version never changes: bump 'version' in the file and publish again"
        )


@dataclass(frozen=True)
class VersionRecord:
    """One version of a definition, with who moved it through its lifecycle and when (ms)."""

    version: str
    digest: str
    state: State
    published_by: str
    published_at: int
    approved_by: str | None = None
    approved_at: int | None = None
    activated_by: str | None = None
    activated_at: int | None = None
    retired_by: str | None = None
    retired_at: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: (v.value if isinstance(v, State) else v) for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> VersionRecord:
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in fields}
        return cls(**{**values, "state": State(values["state"])})


@dataclass(frozen=True)
class DefinitionState:
    """Every version of one definition, which one new runs use (``active``) and the canary, if any."""

    name: str
    revision: int = 0
    versions: Mapping[str, VersionRecord] = field(default_factory=dict)
    active: str | None = None
    canary: str | None = None
    canary_percent: int = 0

    def record(self, version: str) -> VersionRecord:
        found = self.versions.get(version)
        if found is None:
            known = ", ".join(self.versions) or "none"
            raise LifecycleRefused(
                self.name,
                version,
                "unknown_version",
                f"{self.name} has no version {version!r} (published versions: {known}); publish it first",
            )
        return found

    def startable(self) -> list[str]:
        return [v for v, r in self.versions.items() if r.state in STARTABLE]

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "revision": self.revision,
            "versions": {v: r.to_json() for v, r in self.versions.items()},
            "active": self.active,
            "canary": self.canary,
            "canary_percent": self.canary_percent,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DefinitionState:
        return cls(
            name=data["name"],
            revision=int(data.get("revision", 0)),
            versions={v: VersionRecord.from_json(r) for v, r in data.get("versions", {}).items()},
            active=data.get("active"),
            canary=data.get("canary"),
            canary_percent=int(data.get("canary_percent", 0)),
        )


@dataclass(frozen=True)
class AuditRecord:
    """One lifecycle change: appended to the definition's audit stream with the change itself."""

    definition: str
    version: str
    digest: str
    action: str
    from_state: str | None
    to_state: str
    actor: str
    at: int
    reason: str

    def to_fields(self) -> dict[str, str]:
        return {
            "definition": self.definition,
            "version": self.version,
            "digest": self.digest,
            "action": self.action,
            "from": self.from_state or "",
            "to": self.to_state,
            "actor": self.actor,
            "at": str(self.at),
            "reason": self.reason,
        }


@dataclass(frozen=True)
class Change:
    """What a verb does: the state after and its audit records (none: nothing changes)."""

    before: DefinitionState
    after: DefinitionState
    records: tuple[AuditRecord, ...] = ()

    @property
    def noop(self) -> bool:
        return not self.records


@dataclass(frozen=True)
class Actor:
    """Who acts, when (ms) and why: the same for every record of one change."""

    name: str
    at: int
    reason: str = ""


class _Builder:
    """Accumulates version moves into one Change."""

    def __init__(self, state: DefinitionState, action: str, actor: Actor) -> None:
        self.before = state
        self.state = state
        self.action = action
        self.actor = actor
        self.records: list[AuditRecord] = []

    def move(self, version: str, to: State, **stamps: Any) -> None:
        old = self.state.versions.get(version)
        record = (
            dataclasses.replace(old, state=to, **stamps)
            if old is not None
            else VersionRecord(version=version, state=to, **stamps)
        )
        versions = {**self.state.versions, version: record}
        self.state = dataclasses.replace(self.state, versions=versions)
        self.records.append(
            AuditRecord(
                definition=self.state.name,
                version=version,
                digest=record.digest,
                action=self.action,
                from_state=old.state.value if old is not None else None,
                to_state=to.value,
                actor=self.actor.name,
                at=self.actor.at,
                reason=self.actor.reason,
            )
        )

    def route(self, **changes: Any) -> None:
        self.state = dataclasses.replace(self.state, **changes)

    def done(self) -> Change:
        return Change(self.before, self.state, tuple(self.records))


def _refuse(state: DefinitionState, version: str | None, reason: str, message: str) -> LifecycleRefused:
    return LifecycleRefused(state.name, version, reason, message)


def _no_canary(state: DefinitionState, verb: str, version: str | None) -> None:
    if state.canary is not None:
        raise _refuse(
            state,
            version,
            "canary_in_progress",
            f"{state.name} has a canary on ({state.canary} for {state.canary_percent}% of new runs, "
            f"{state.active} for the rest): '{verb}' is refused until it ends; run 'saga definitions "
            f"promote {state.name}' or 'saga definitions abort {state.name}' first",
        )


def publish(state: DefinitionState, version: str, digest: str, actor: Actor) -> Change:
    """Store a new version as ``published``; the same digest again changes nothing; another digest under
    a stored version is refused (:class:`VersionConflict`)."""
    old = state.versions.get(version)
    if old is not None:
        if old.digest != digest:
            raise VersionConflict(state.name, version, digest, old.digest)
        return Change(state, state)
    _no_canary(state, "publish", version)
    change = _Builder(state, "publish", actor)
    change.move(version, State.PUBLISHED, digest=digest, published_by=actor.name, published_at=actor.at)
    return change.done()


def approve(state: DefinitionState, version: str, actor: Actor, *, separate_approver: bool) -> Change:
    """``published`` -> ``approved``; with ``separate_approver``, never by the actor who published it."""
    record = state.record(version)
    _no_canary(state, "approve", version)
    if record.state is not State.PUBLISHED:
        if record.state in STARTABLE:
            return Change(state, state)  # approved already: nothing to do
        raise _refuse(
            state,
            version,
            "not_published",
            f"{state.name} {version} is {record.state}: only a published version can be approved; publish "
            "the definition under a new version to release it again",
        )
    if separate_approver and actor.name == record.published_by:
        raise _refuse(
            state,
            version,
            "separate_approver_required",
            f"{state.name} {version} was published by {actor.name}, who may not also approve it "
            "(SAGA_REQUIRE_SEPARATE_APPROVER is on): someone else must run 'saga definitions approve'",
        )
    change = _Builder(state, "approve", actor)
    change.move(version, State.APPROVED, approved_by=actor.name, approved_at=actor.at)
    return change.done()


def activate(state: DefinitionState, version: str, actor: Actor, action: str = "activate") -> Change:
    """An approved (or standby) version becomes the one new runs use; the one before goes to ``standby``.
    Runs in flight keep the plan they pinned."""
    record = state.record(version)
    _no_canary(state, action, version)
    if state.active == version:
        return Change(state, state)
    if record.state not in ACTIVATABLE:
        raise _refuse(
            state,
            version,
            "not_approved",
            f"{state.name} {version} is {record.state}: only an approved version can be activated"
            + _approve_hint(state.name, version, record.state),
        )
    change = _Builder(state, action, actor)
    if state.active is not None:
        change.move(state.active, State.STANDBY)
    change.move(version, State.ACTIVE, activated_by=actor.name, activated_at=actor.at)
    change.route(active=version)
    return change.done()


def _approve_hint(name: str, version: str, current: State) -> str:
    if current is State.PUBLISHED:
        return f"; approve it first: saga definitions approve {name} --version {version}"
    return ""


def start_canary(state: DefinitionState, version: str, percent: int, actor: Actor) -> Change:
    """``percent`` % of new runs (by run id) use ``version``; the active version takes the rest."""
    record = state.record(version)
    _no_canary(state, "canary", version)
    if not 0 < percent < 100:
        raise _refuse(
            state,
            version,
            "bad_percent",
            f"a canary of {state.name} {version} takes between 1 and 99 percent of new runs, not {percent}: "
            "give --percent in that range",
        )
    if state.active is None:
        raise _refuse(
            state,
            version,
            "no_active_version",
            f"{state.name} has no active version to share new runs with: activate {version} instead",
        )
    if state.active == version or record.state not in ACTIVATABLE:
        raise _refuse(
            state,
            version,
            "not_approved",
            f"{state.name} {version} is {record.state}: a canary must be an approved version other than "
            "the active one" + _approve_hint(state.name, version, record.state),
        )
    change = _Builder(state, "canary", actor)
    change.move(version, State.CANARY, activated_by=actor.name, activated_at=actor.at)
    change.route(canary=version, canary_percent=percent)
    return change.done()


def _canary_of(state: DefinitionState, verb: str) -> str:
    if state.canary is None:
        raise _refuse(
            state,
            None,
            "no_canary",
            f"{state.name} has no canary on: nothing to {verb}; start one with 'saga definitions canary "
            f"{state.name} --version V --percent P'",
        )
    return state.canary


def promote(state: DefinitionState, actor: Actor) -> Change:
    """The canary becomes active for every new run; the active one goes to ``standby``."""
    canary = _canary_of(state, "promote")
    change = _Builder(state, "promote", actor)
    if state.active is not None:
        change.move(state.active, State.STANDBY)
    change.move(canary, State.ACTIVE, activated_by=actor.name, activated_at=actor.at)
    change.route(active=canary, canary=None, canary_percent=0)
    return change.done()


def abort(state: DefinitionState, actor: Actor) -> Change:
    """The canary goes back to ``approved``; the active version takes every new run again."""
    canary = _canary_of(state, "abort")
    change = _Builder(state, "abort", actor)
    change.move(canary, State.APPROVED)
    change.route(canary=None, canary_percent=0)
    return change.done()


def rollback(state: DefinitionState, activations: Iterable[str], actor: Actor) -> Change:
    """The version that was active before the current one (``activations``: the versions that became
    active, oldest first, from the audit stream) becomes active again."""
    _no_canary(state, "rollback", None)
    if state.active is None:
        raise _refuse(
            state,
            None,
            "no_active_version",
            f"{state.name} has no active version to roll back: activate one with 'saga definitions activate "
            f"{state.name} --version V'",
        )
    previous = _previous_active(list(activations), state.active)
    if previous is None:
        raise _refuse(
            state,
            state.active,
            "no_previous_version",
            f"{state.name} {state.active} is the first version ever activated: there is nothing to roll "
            f"back to; activate another approved version with 'saga definitions activate {state.name} "
            "--version V'",
        )
    if state.record(previous).state is State.RETIRED:
        raise _refuse(
            state,
            previous,
            "previous_retired",
            f"{state.name} {previous}, active before {state.active}, is retired and cannot run again; "
            f"activate another approved version with 'saga definitions activate {state.name} --version V'",
        )
    return activate(state, previous, actor, action="rollback")


def _previous_active(activations: list[str], current: str) -> str | None:
    """The last version other than ``current`` that was active before ``current`` last became active."""
    if current not in activations:
        return None
    last = len(activations) - 1 - activations[::-1].index(current)
    for version in reversed(activations[:last]):
        if version != current:
            return version
    return None


def retire(state: DefinitionState, version: str, actor: Actor) -> Change:
    """No new runs of ``version``; those pinned to it finish on it. Never the active version."""
    record = state.record(version)
    _no_canary(state, "retire", version)
    if record.state is State.RETIRED:
        return Change(state, state)
    if record.state is State.ACTIVE:
        raise _refuse(
            state,
            version,
            "version_active",
            f"{state.name} {version} is the active version: activate another one first (or roll back), "
            "then retire it",
        )
    change = _Builder(state, "retire", actor)
    change.move(version, State.RETIRED, retired_by=actor.name, retired_at=actor.at)
    return change.done()


def chain(*verbs: Callable[[DefinitionState], Change]) -> Callable[[DefinitionState], Change]:
    """Several verbs as one change (``publish --activate``: publish, approve, activate), stored at once."""

    def apply(state: DefinitionState) -> Change:
        records: list[AuditRecord] = []
        current = state
        for verb in verbs:
            step = verb(current)
            records.extend(step.records)
            current = step.after
        return Change(state, current, tuple(records))

    return apply


# ---- choosing the version of a new run ----------------------------------------------------------------


def canary_bucket(run_id: str) -> int:
    """0..9999 from the run id alone, so a re-sent start (same run id) always picks the same version."""
    return int.from_bytes(hashlib.sha256(run_id.encode()).digest()[:8], "big") % CANARY_BUCKETS


def on_canary(run_id: str, percent: int) -> bool:
    return canary_bucket(run_id) < percent * CANARY_BUCKETS // 100


class DefinitionNotFound(SagaError):
    """Raised when a start names a definition that has no active version; ``did_you_mean`` is the
    published name closest to it, if one is close."""

    code = "definition_not_found"
    id_fields = ("definition", "did_you_mean")

    def __init__(self, definition: str, published: Iterable[str] = ()) -> None:
        self.definition = definition
        close = difflib.get_close_matches(definition, sorted(published), n=1)
        self.did_you_mean = close[0] if close else None
        hint = f" (did you mean {self.did_you_mean!r}?)" if self.did_you_mean else ""
        super().__init__(
            f"definition {definition!r} is not published{hint}; run 'saga definitions publish FILE'"
        )


class NotStartable(SagaError):
    """A start that names a version no run may be created from (or a definition with no active one)."""

    code = "version_not_startable"
    id_fields = ("definition", "version")

    def __init__(self, definition: str, version: str | None, why: str, startable: list[str]) -> None:
        self.definition = definition
        self.version = version
        self.startable = startable
        you_may = (
            f"versions you may start: {', '.join(startable)}"
            if startable
            else "no version of it is approved yet: publish, approve and activate one"
        )
        super().__init__(f"cannot start {definition}: {why}; {you_may}")


def choose(state: DefinitionState, run_id: str, version: str | None = None) -> VersionRecord:
    """The version a new run ``run_id`` uses: ``version`` if given (any approved, not retired one),
    else the active version, or the canary for the canary's share of run ids."""
    if version is not None:
        record = state.versions.get(version)
        if record is None:
            raise NotStartable(state.name, version, f"it has no version {version!r}", state.startable())
        if record.state not in STARTABLE:
            why = f"version {version} is {record.state}" + (
                " (not approved yet)" if record.state is State.PUBLISHED else " (no new runs)"
            )
            raise NotStartable(state.name, version, why, state.startable())
        return record
    if state.active is None:
        raise NotStartable(state.name, None, "it has no active version", state.startable())
    if state.canary is not None and on_canary(run_id, state.canary_percent):
        return state.versions[state.canary]
    return state.versions[state.active]

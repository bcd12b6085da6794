"""Property tests over the definition version lifecycle (``orchestrator/governance/lifecycle.py``).

Hypothesis applies random sequences of verbs (random versions, digests, actors and percents) to a
definition's state; a verb the state does not allow raises :class:`LifecycleRefused` (or
:class:`VersionConflict`) and counts as a refusal. After every step:

* at most one version is ``active``, and it is ``state.active``; at most one is the ``canary``, and it is
  ``state.canary``, with ``0 < canary_percent < 100`` exactly when a canary is on (and an active version);
* a version's digest and publisher never change once published; a retired version stays retired;
* a refused verb leaves the state unchanged, and is refused for the reason the rules give;
* a change that changes something has audit records, whose from/to states match the before/after states
  of the versions they name (and a change without records changes nothing);
* no version is startable without an approver, who, with separate approval on, is not its publisher;
* the state survives a JSON round-trip.

And the canary's share: ``choose`` picks the canary exactly for the run ids ``on_canary`` says, about
``percent`` % of them, and always the same version for the same run id.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from orchestrator.governance.lifecycle import (
    ACTIVATABLE,
    STARTABLE,
    Actor,
    AuditRecord,
    Change,
    DefinitionState,
    LifecycleRefused,
    NotStartable,
    State,
    VersionConflict,
    abort,
    activate,
    approve,
    choose,
    on_canary,
    promote,
    publish,
    retire,
    rollback,
    start_canary,
)

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FEW = settings(SETTINGS, max_examples=25)
NAME = "model-ingest"
VERSIONS = ("1.0", "1.1", "2.0", "3.0")
ACTORS = ("alice", "bob", "carol")
# publish, approve and activate are drawn more often so that sequences get past the first states
VERB_NAMES = (
    ("publish",) * 3
    + ("approve",) * 3
    + ("activate",) * 2
    + (
        "canary",
        "canary",
        "promote",
        "abort",
        "rollback",
        "retire",
    )
)


@dataclass(frozen=True)
class Op:
    verb: str
    version: str
    actor: str
    percent: int
    other_digest: bool  # publish: a digest other than the version's own (a conflict if it is stored)


def ops_of(versions: tuple[str, ...]) -> st.SearchStrategy[Op]:
    return st.builds(
        Op,
        verb=st.sampled_from(VERB_NAMES),
        version=st.sampled_from(versions),
        actor=st.sampled_from(ACTORS),
        percent=st.integers(0, 5).flatmap(  # one percent in six outside 1..99
            lambda n: st.sampled_from([0, 100, -1, 101, 250]) if n == 0 else st.integers(1, 99)
        ),
        other_digest=st.integers(0, 5).map(lambda n: n == 0),
    )


ops = ops_of(VERSIONS)
# from an empty definition, two versions (and an unknown one now and then) get further along in one sequence
few_ops = ops_of(("1.0", "1.0", "2.0", "2.0", "3.0"))


def digest_of(op: Op) -> str:
    return f"sha256:{op.version}" + (f"-{op.actor}" if op.other_digest else "")


def apply(state: DefinitionState, op: Op, actor: Actor, separate: bool, activations: list[str]) -> Change:
    verbs: dict[str, Callable[[], Change]] = {
        "publish": lambda: publish(state, op.version, digest_of(op), actor),
        "approve": lambda: approve(state, op.version, actor, separate_approver=separate),
        "activate": lambda: activate(state, op.version, actor),
        "canary": lambda: start_canary(state, op.version, op.percent, actor),
        "promote": lambda: promote(state, actor),
        "abort": lambda: abort(state, actor),
        "rollback": lambda: rollback(state, list(activations), actor),
        "retire": lambda: retire(state, op.version, actor),
    }
    return verbs[op.verb]()


# ---- the rules, as the issue gives them: what each verb should do (None: allowed) ------------------------


def _previous(activations: list[str], current: str) -> str | None:
    """The version active just before ``current`` last became active (no two activations in a row are of
    one version: activating the active version records nothing)."""
    if current not in activations:
        return None
    last = max(i for i, v in enumerate(activations) if v == current)
    return activations[last - 1] if last > 0 else None


def _publish(state: DefinitionState, op: Op, separate: bool, activations: list[str]) -> str | None:
    record = state.versions.get(op.version)
    if record is not None:
        return "version_exists" if record.digest != digest_of(op) else None
    return "canary_in_progress" if state.canary else None


def _promote_or_abort(state: DefinitionState, op: Op, separate: bool, activations: list[str]) -> str | None:
    return None if state.canary else "no_canary"


def _rollback(state: DefinitionState, op: Op, separate: bool, activations: list[str]) -> str | None:
    if state.canary:
        return "canary_in_progress"
    if state.active is None:
        return "no_active_version"
    previous = _previous(activations, state.active)
    if previous is None:
        return "no_previous_version"
    return "previous_retired" if state.versions[previous].state is State.RETIRED else None


def _approve(state: DefinitionState, op: Op, separate: bool, activations: list[str]) -> str | None:
    record = state.versions[op.version]
    if record.state is State.PUBLISHED:
        return "separate_approver_required" if separate and op.actor == record.published_by else None
    return None if record.state in STARTABLE else "not_published"


def _activate(state: DefinitionState, op: Op, separate: bool, activations: list[str]) -> str | None:
    record = state.versions[op.version]
    return None if op.version == state.active or record.state in ACTIVATABLE else "not_approved"


def _canary(state: DefinitionState, op: Op, separate: bool, activations: list[str]) -> str | None:
    if not 0 < op.percent < 100:
        return "bad_percent"
    if state.active is None:
        return "no_active_version"
    record = state.versions[op.version]
    return "not_approved" if op.version == state.active or record.state not in ACTIVATABLE else None


def _retire(state: DefinitionState, op: Op, separate: bool, activations: list[str]) -> str | None:
    return "version_active" if state.versions[op.version].state is State.ACTIVE else None


RULES = {"publish": _publish, "promote": _promote_or_abort, "abort": _promote_or_abort, "rollback": _rollback}
VERSION_RULES = {"approve": _approve, "activate": _activate, "canary": _canary, "retire": _retire}


def expected_refusal(state: DefinitionState, op: Op, separate: bool, activations: list[str]) -> str | None:
    """The reason the rules refuse ``op`` for (``version_exists``: a VersionConflict), None if allowed."""
    if op.verb in RULES:
        return RULES[op.verb](state, op, separate, activations)
    if op.version not in state.versions:
        return "unknown_version"
    if state.canary:
        return "canary_in_progress"
    return VERSION_RULES[op.verb](state, op, separate, activations)


# ---- invariants -----------------------------------------------------------------------------------------


@dataclass
class History:
    """What the sequence has seen so far: first digests and publishers, retired versions, activations."""

    digests: dict[str, str] = field(default_factory=dict)
    publishers: dict[str, str] = field(default_factory=dict)
    retired: set[str] = field(default_factory=set)
    activations: list[str] = field(default_factory=list)
    refusals: int = 0


def check_state(state: DefinitionState, history: History, separate: bool) -> None:
    actives = [v for v, r in state.versions.items() if r.state is State.ACTIVE]
    assert actives == ([state.active] if state.active is not None else [])
    canaries = [v for v, r in state.versions.items() if r.state is State.CANARY]
    assert canaries == ([state.canary] if state.canary is not None else [])
    if state.canary is not None:
        assert 0 < state.canary_percent < 100
        assert state.active is not None and state.active != state.canary
    else:
        assert state.canary_percent == 0
    for version, rec in state.versions.items():
        assert rec.version == version
        assert history.digests.setdefault(version, rec.digest) == rec.digest
        assert history.publishers.setdefault(version, rec.published_by) == rec.published_by
        if version in history.retired:
            assert rec.state is State.RETIRED
        if rec.state is State.RETIRED:
            history.retired.add(version)
            assert rec.retired_by is not None and rec.retired_at is not None
        if rec.state in STARTABLE:
            assert rec.approved_by is not None and rec.approved_at is not None
            if separate:
                assert rec.approved_by != rec.published_by
        if rec.state in (State.ACTIVE, State.CANARY, State.STANDBY):
            assert rec.activated_by is not None
    assert set(state.startable()) == {v for v, r in state.versions.items() if r.state in STARTABLE}
    assert DefinitionState.from_json(json.loads(json.dumps(state.to_json()))) == state


def check_change(change: Change, state: DefinitionState, actor: Actor) -> None:
    before, after = change.before, change.after
    assert before == state
    assert (after == before) == change.noop, "a change without records must change nothing, and back"
    assert after.name == before.name and after.revision == before.revision  # the store bumps the revision
    named: dict[str, list[AuditRecord]] = {}
    for audit in change.records:
        named.setdefault(audit.version, []).append(audit)
        assert (audit.definition, audit.actor, audit.at, audit.reason) == (
            NAME,
            actor.name,
            actor.at,
            actor.reason,
        )
        assert audit.digest == after.versions[audit.version].digest
    for version, records in named.items():
        old = before.versions.get(version)
        assert records[0].from_state == (old.state.value if old is not None else None)
        for first, second in itertools.pairwise(records):
            assert first.to_state == second.from_state
        assert records[-1].to_state == after.versions[version].state.value
        assert all(r.from_state != r.to_state for r in records)
    for version, rec in after.versions.items():
        if version not in named:
            assert before.versions.get(version) == rec, f"{version} changed without an audit record"
    assert set(before.versions) <= set(after.versions)


def check_outcome(op: Op, change: Change, actor: Actor, history: History) -> None:
    """What each allowed verb does, beyond the invariants."""
    before, after = change.before, change.after
    rec = after.versions.get(op.version)
    if op.verb == "publish" and not change.noop:
        assert rec is not None and rec.state is State.PUBLISHED and rec.published_by == actor.name
    elif op.verb == "approve" and not change.noop:
        assert rec is not None and rec.state is State.APPROVED and rec.approved_by == actor.name
    elif op.verb == "activate":
        assert after.active == op.version
    elif op.verb == "canary":
        assert (after.active, after.canary, after.canary_percent) == (before.active, op.version, op.percent)
    elif op.verb == "promote":
        assert (after.active, after.canary) == (before.canary, None)
        assert before.active is not None and after.versions[before.active].state is State.STANDBY
    elif op.verb == "abort":
        assert (after.active, after.canary) == (before.active, None)
        assert before.canary is not None and after.versions[before.canary].state is State.APPROVED
    elif op.verb == "rollback":
        assert before.active is not None
        assert after.active == _previous(history.activations, before.active)
        assert after.versions[before.active].state is State.STANDBY
    elif op.verb == "retire":
        assert rec is not None and rec.state is State.RETIRED
        assert after.active == before.active


def run(sequence: list[Op], separate: bool) -> DefinitionState:
    state = DefinitionState(NAME)
    history = History()
    check_state(state, history, separate)
    for step, op in enumerate(sequence):
        actor = Actor(op.actor, 1_000 * (step + 1), f"step {step}")
        snapshot = json.dumps(state.to_json(), sort_keys=True)
        expected = expected_refusal(state, op, separate, history.activations)
        try:
            change = apply(state, op, actor, separate, history.activations)
        except LifecycleRefused as exc:
            assert (exc.definition, exc.reason) == (NAME, expected), op
            assert json.dumps(state.to_json(), sort_keys=True) == snapshot  # refused: nothing changed
            history.refusals += 1
            event(f"refused: {exc.reason}")
            continue
        except VersionConflict as exc:
            assert expected == "version_exists", op
            assert (exc.definition, exc.version, exc.digest) == (NAME, op.version, digest_of(op))
            assert exc.stored_digest == state.versions[op.version].digest
            assert json.dumps(state.to_json(), sort_keys=True) == snapshot
            history.refusals += 1
            continue
        assert expected is None, (op, f"allowed, but the rules refuse it: {expected}")
        check_change(change, state, actor)
        check_outcome(op, change, actor, history)
        history.activations += [r.version for r in change.records if r.to_state == State.ACTIVE.value]
        event(f"{op.verb}{' (noop)' if change.noop else ''}")
        state = change.after
        check_state(state, history, separate)
    return state


@SETTINGS
@given(st.lists(few_ops, min_size=5, max_size=60), st.booleans())
def test_random_verb_sequences_keep_the_lifecycle_invariants(sequence: list[Op], separate: bool) -> None:
    run(sequence, separate)


# A scripted prefix (1.0 active, 1.1 and 2.0 approved, 3.0 published) so random suffixes start where the
# interesting verbs (canary, promote, rollback, retire) are allowed.
PREFIX = [
    Op("publish", "1.0", "alice", 10, False),
    Op("approve", "1.0", "bob", 10, False),
    Op("activate", "1.0", "carol", 10, False),
    Op("publish", "1.1", "alice", 10, False),
    Op("approve", "1.1", "bob", 10, False),
    Op("publish", "2.0", "bob", 10, False),
    Op("approve", "2.0", "carol", 10, False),
    Op("publish", "3.0", "carol", 10, False),
]


@SETTINGS
@given(st.lists(ops, min_size=3, max_size=40), st.booleans())
def test_random_verbs_from_a_released_definition_keep_the_invariants(
    sequence: list[Op], separate: bool
) -> None:
    state = run(PREFIX + sequence, separate)
    assert set(state.versions) == set(VERSIONS)


# ---- choosing the version of a new run ------------------------------------------------------------------


def canary_state(percent: int) -> DefinitionState:
    state = run(PREFIX[:5], separate=True)
    return start_canary(state, "1.1", percent, Actor("carol", 9_000)).after


run_ids = st.one_of(st.uuids().map(str), st.text(min_size=1, max_size=40))


@SETTINGS
@given(st.lists(run_ids, min_size=1, max_size=200, unique=True), st.integers(1, 99))
def test_choose_picks_the_canary_exactly_for_its_run_ids(ids: list[str], percent: int) -> None:
    state = canary_state(percent)
    copy = DefinitionState.from_json(json.loads(json.dumps(state.to_json())))
    for run_id in ids:
        chosen = choose(state, run_id)
        assert chosen.version == ("1.1" if on_canary(run_id, percent) else "1.0")
        assert choose(state, run_id) == chosen == choose(copy, run_id)  # the same run id: the same version
        # a larger share keeps every run of the smaller one on the canary
        if on_canary(run_id, percent):
            assert all(on_canary(run_id, p) for p in range(percent, 101))


@FEW
@given(st.integers(1, 99), st.integers(0, 2**32 - 1))
def test_the_canary_share_is_about_its_percent(percent: int, seed: int) -> None:
    rng = random.Random(seed)
    state = canary_state(percent)
    n = 10_000
    picks = sum(choose(state, f"{rng.getrandbits(128):032x}").version == "1.1" for _ in range(n))
    assert abs(picks / n - percent / 100) < 0.03, (picks, n, percent)


@SETTINGS
@given(st.lists(ops, max_size=30), st.booleans(), run_ids, st.sampled_from((None, *VERSIONS)))
def test_choose_only_ever_picks_a_startable_version(
    sequence: list[Op], separate: bool, run_id: str, version: str | None
) -> None:
    state = run(PREFIX + sequence, separate)
    try:
        chosen = choose(state, run_id, version)
    except NotStartable as exc:
        assert exc.startable == state.startable()
        if version is None:
            assert state.active is None
        else:
            assert state.versions[version].state not in STARTABLE
        return
    assert chosen.state in STARTABLE
    assert chosen == choose(state, run_id, version)
    if version is not None:
        assert chosen.version == version
    else:
        assert chosen.version in (state.active, state.canary)
        assert (chosen.version == state.canary) == (
            state.canary is not None and on_canary(run_id, state.canary_percent)
        )

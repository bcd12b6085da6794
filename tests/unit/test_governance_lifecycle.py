"""Example tests for the definition version lifecycle (``orchestrator/governance/lifecycle.py``).

Every verb's success (the state after and its audit records), every refusal (its ``reason`` code and a
message naming the definition, the version and what to do), ``choose`` and the JSON round-trip of
:class:`DefinitionState`."""

from __future__ import annotations

import hashlib
import json

import pytest

from orchestrator.errors import SagaError
from orchestrator.governance.lifecycle import (
    CANARY_BUCKETS,
    STARTABLE,
    Actor,
    AuditRecord,
    Change,
    DefinitionState,
    LifecycleRefused,
    NotStartable,
    State,
    VersionConflict,
    VersionRecord,
    abort,
    activate,
    approve,
    canary_bucket,
    chain,
    choose,
    on_canary,
    promote,
    publish,
    retire,
    rollback,
    start_canary,
)

NAME = "model-ingest"
ALICE = Actor("alice", 1_000, "first cut")
BOB = Actor("bob", 2_000, "reviewed")
CAROL = Actor("carol", 3_000, "release")


def digest(version: str) -> str:
    return f"sha256:{version.replace('.', '')}"


def empty() -> DefinitionState:
    return DefinitionState(NAME)


def published(*versions: str) -> DefinitionState:
    state = empty()
    for version in versions:
        state = publish(state, version, digest(version), ALICE).after
    return state


def approved(*versions: str) -> DefinitionState:
    state = published(*versions)
    for version in versions:
        state = approve(state, version, BOB, separate_approver=True).after
    return state


def active(*versions: str) -> DefinitionState:
    """Every version approved, then activated in order: the last one is active, the others standby."""
    state = approved(*versions)
    for version in versions:
        state = activate(state, version, CAROL).after
    return state


def canary_on(percent: int = 10) -> DefinitionState:
    """1.0 active, 2.0 the canary for ``percent`` % of new runs, 3.0 approved."""
    state = active("1.0")
    state = approve(
        publish(state, "2.0", digest("2.0"), ALICE).after, "2.0", BOB, separate_approver=True
    ).after
    state = approve(
        publish(state, "3.0", digest("3.0"), ALICE).after, "3.0", BOB, separate_approver=True
    ).after
    return start_canary(state, "2.0", percent, CAROL).after


def states_of(state: DefinitionState) -> dict[str, State]:
    return {v: r.state for v, r in state.versions.items()}


def refusal(exc: pytest.ExceptionInfo[LifecycleRefused], reason: str, version: str | None) -> str:
    assert exc.value.reason == reason
    assert exc.value.definition == NAME
    assert exc.value.version == version
    assert exc.value.code == "lifecycle_refused"
    assert exc.value.ids == {
        k: v for k, v in {"definition": NAME, "version": version, "reason": reason}.items() if v is not None
    }
    assert isinstance(exc.value, SagaError)
    return str(exc.value)


def record(change: Change, version: str) -> AuditRecord:
    (found,) = [r for r in change.records if r.version == version]
    return found


# ---- publish --------------------------------------------------------------------------------------------


def test_publish_stores_a_published_version_and_audits_it() -> None:
    change = publish(empty(), "1.0", "sha256:aa", ALICE)
    assert not change.noop
    assert change.before == empty()
    rec = change.after.versions["1.0"]
    assert rec == VersionRecord("1.0", "sha256:aa", State.PUBLISHED, "alice", 1_000)
    assert change.after.active is None and change.after.canary is None
    assert change.records == (
        AuditRecord(NAME, "1.0", "sha256:aa", "publish", None, "published", "alice", 1_000, "first cut"),
    )
    assert change.records[0].to_fields() == {
        "definition": NAME,
        "version": "1.0",
        "digest": "sha256:aa",
        "action": "publish",
        "from": "",
        "to": "published",
        "actor": "alice",
        "at": "1000",
        "reason": "first cut",
    }


def test_publish_keeps_the_versions_already_there() -> None:
    state = published("1.0", "2.0")
    assert list(state.versions) == ["1.0", "2.0"]
    assert states_of(state) == {"1.0": State.PUBLISHED, "2.0": State.PUBLISHED}


def test_republishing_the_same_digest_is_a_noop() -> None:
    state = active("1.0")
    change = publish(state, "1.0", digest("1.0"), BOB)
    assert change.noop
    assert change.records == ()
    assert change.after == state == change.before


def test_republishing_the_same_digest_during_a_canary_is_a_noop() -> None:
    state = canary_on()
    change = publish(state, "2.0", digest("2.0"), BOB)
    assert change.noop and change.after == state


def test_publishing_another_digest_under_a_stored_version_is_a_conflict() -> None:
    state = active("1.0")
    with pytest.raises(VersionConflict) as exc:
        publish(state, "1.0", "sha256:other", BOB)
    err = exc.value
    assert (err.definition, err.version, err.digest, err.stored_digest) == (
        NAME,
        "1.0",
        "sha256:other",
        digest("1.0"),
    )
    assert err.code == "version_exists"
    assert err.ids == {
        "definition": NAME,
        "version": "1.0",
        "digest": "sha256:other",
        "stored_digest": digest("1.0"),
    }
    message = str(err)
    for part in (NAME, "1.0", "sha256:other", digest("1.0"), "bump 'version'"):
        assert part in message


def test_a_conflict_is_reported_even_during_a_canary() -> None:
    with pytest.raises(VersionConflict):
        publish(canary_on(), "1.0", "sha256:other", BOB)


def test_publishing_a_new_version_during_a_canary_is_refused() -> None:
    state = canary_on(25)
    with pytest.raises(LifecycleRefused) as exc:
        publish(state, "4.0", digest("4.0"), ALICE)
    message = refusal(exc, "canary_in_progress", "4.0")
    for part in (NAME, "2.0 for 25%", "1.0 for the rest", "'publish'", "promote model-ingest", "abort"):
        assert part in message


# ---- approve --------------------------------------------------------------------------------------------


def test_approve_moves_published_to_approved_and_stamps_the_approver() -> None:
    change = approve(published("1.0"), "1.0", BOB, separate_approver=True)
    rec = change.after.versions["1.0"]
    assert rec.state is State.APPROVED
    assert (rec.approved_by, rec.approved_at) == ("bob", 2_000)
    assert (rec.published_by, rec.published_at) == ("alice", 1_000)
    assert change.records == (
        AuditRecord(NAME, "1.0", digest("1.0"), "approve", "published", "approved", "bob", 2_000, "reviewed"),
    )


def test_the_publisher_may_approve_when_separate_approval_is_off() -> None:
    change = approve(published("1.0"), "1.0", ALICE, separate_approver=False)
    assert change.after.versions["1.0"].state is State.APPROVED
    assert change.after.versions["1.0"].approved_by == "alice"


def test_the_publisher_may_not_approve_with_separate_approval_on() -> None:
    state = published("1.0")
    with pytest.raises(LifecycleRefused) as exc:
        approve(state, "1.0", ALICE, separate_approver=True)
    message = refusal(exc, "separate_approver_required", "1.0")
    for part in (NAME, "1.0", "published by alice", "someone else", "saga definitions approve"):
        assert part in message


@pytest.mark.parametrize("setup", ["approved", "active", "standby", "canary"])
def test_approving_an_approved_version_is_a_noop(setup: str) -> None:
    if setup == "approved":
        state, version = approved("1.0"), "1.0"
    elif setup == "active":
        state, version = active("1.0"), "1.0"
    elif setup == "standby":
        state, version = active("1.0", "2.0"), "1.0"
    else:  # no canary in progress, but a version that was one: abort puts it back to approved
        state, version = abort(canary_on(), CAROL).after, "2.0"
    assert state.versions[version].state in STARTABLE
    change = approve(state, version, ALICE, separate_approver=True)  # even by its publisher: nothing to do
    assert change.noop and change.after == state


def test_approving_a_retired_version_is_refused() -> None:
    state = retire(published("1.0"), "1.0", CAROL).after
    with pytest.raises(LifecycleRefused) as exc:
        approve(state, "1.0", BOB, separate_approver=True)
    message = refusal(exc, "not_published", "1.0")
    assert NAME in message and "1.0 is retired" in message and "only a published version" in message


def test_approving_an_unknown_version_is_refused() -> None:
    with pytest.raises(LifecycleRefused) as exc:
        approve(published("1.0", "2.0"), "9.9", BOB, separate_approver=False)
    message = refusal(exc, "unknown_version", "9.9")
    for part in (NAME, "'9.9'", "1.0, 2.0", "publish it first"):
        assert part in message


def test_unknown_version_of_an_empty_definition_says_none_are_published() -> None:
    with pytest.raises(LifecycleRefused) as exc:
        activate(empty(), "1.0", CAROL)
    assert "published versions: none" in refusal(exc, "unknown_version", "1.0")


def test_approve_during_a_canary_is_refused() -> None:
    state = canary_on()
    state = publish(abort(state, CAROL).after, "4.0", digest("4.0"), ALICE).after
    state = start_canary(state, "2.0", 10, CAROL).after
    with pytest.raises(LifecycleRefused) as exc:
        approve(state, "4.0", BOB, separate_approver=False)
    message = refusal(exc, "canary_in_progress", "4.0")
    assert "'approve'" in message and "promote" in message and "abort" in message


# ---- activate -------------------------------------------------------------------------------------------


def test_activate_makes_an_approved_version_active() -> None:
    change = activate(approved("1.0"), "1.0", CAROL)
    assert change.after.active == "1.0"
    rec = change.after.versions["1.0"]
    assert rec.state is State.ACTIVE
    assert (rec.activated_by, rec.activated_at) == ("carol", 3_000)
    assert change.records == (
        AuditRecord(NAME, "1.0", digest("1.0"), "activate", "approved", "active", "carol", 3_000, "release"),
    )


def test_activate_puts_the_previous_active_version_on_standby() -> None:
    state = active("1.0")
    state = approve(
        publish(state, "2.0", digest("2.0"), ALICE).after, "2.0", BOB, separate_approver=True
    ).after
    change = activate(state, "2.0", CAROL)
    assert change.after.active == "2.0"
    assert states_of(change.after) == {"1.0": State.STANDBY, "2.0": State.ACTIVE}
    assert [(r.version, r.from_state, r.to_state, r.action) for r in change.records] == [
        ("1.0", "active", "standby", "activate"),
        ("2.0", "approved", "active", "activate"),
    ]
    assert {(r.actor, r.at, r.reason) for r in change.records} == {("carol", 3_000, "release")}
    # the standby one keeps its stamps: who activated it before
    assert change.after.versions["1.0"].activated_by == "carol"


def test_a_standby_version_may_be_activated_again() -> None:
    state = active("1.0", "2.0")
    change = activate(state, "1.0", Actor("dave", 4_000))
    assert change.after.active == "1.0"
    assert states_of(change.after) == {"1.0": State.ACTIVE, "2.0": State.STANDBY}
    assert change.after.versions["1.0"].activated_by == "dave"
    assert record(change, "1.0").from_state == "standby"


def test_activating_the_active_version_is_a_noop() -> None:
    state = active("1.0")
    change = activate(state, "1.0", CAROL)
    assert change.noop and change.after == state


def test_activating_a_published_version_is_refused_with_the_approve_hint() -> None:
    with pytest.raises(LifecycleRefused) as exc:
        activate(published("1.0"), "1.0", CAROL)
    message = refusal(exc, "not_approved", "1.0")
    assert "1.0 is published" in message
    assert "saga definitions approve model-ingest --version 1.0" in message


def test_activating_a_retired_version_is_refused() -> None:
    state = retire(active("1.0", "2.0"), "1.0", CAROL).after
    with pytest.raises(LifecycleRefused) as exc:
        activate(state, "1.0", CAROL)
    message = refusal(exc, "not_approved", "1.0")
    assert NAME in message and "1.0 is retired" in message
    assert "approve it first" not in message  # approving a retired version would not help


def test_activate_during_a_canary_is_refused() -> None:
    with pytest.raises(LifecycleRefused) as exc:
        activate(canary_on(), "3.0", CAROL)
    assert "'activate'" in refusal(exc, "canary_in_progress", "3.0")


# ---- canary, promote, abort -----------------------------------------------------------------------------


def test_start_canary_shares_new_runs_with_an_approved_version() -> None:
    state = active("1.0")
    state = approve(
        publish(state, "2.0", digest("2.0"), ALICE).after, "2.0", BOB, separate_approver=True
    ).after
    change = start_canary(state, "2.0", 10, CAROL)
    after = change.after
    assert (after.active, after.canary, after.canary_percent) == ("1.0", "2.0", 10)
    assert states_of(after) == {"1.0": State.ACTIVE, "2.0": State.CANARY}
    assert after.versions["2.0"].activated_by == "carol"
    assert change.records == (
        AuditRecord(NAME, "2.0", digest("2.0"), "canary", "approved", "canary", "carol", 3_000, "release"),
    )


def test_a_standby_version_may_be_the_canary() -> None:
    change = start_canary(active("1.0", "2.0"), "1.0", 50, CAROL)
    assert (change.after.active, change.after.canary) == ("2.0", "1.0")
    assert record(change, "1.0").from_state == "standby"


@pytest.mark.parametrize("percent", [0, 100, -5, 150])
def test_a_canary_percent_outside_1_to_99_is_refused(percent: int) -> None:
    state = approve(
        publish(active("1.0"), "2.0", "sha256:2", ALICE).after, "2.0", BOB, separate_approver=True
    )
    with pytest.raises(LifecycleRefused) as exc:
        start_canary(state.after, "2.0", percent, CAROL)
    message = refusal(exc, "bad_percent", "2.0")
    assert "between 1 and 99" in message and str(percent) in message


def test_the_bad_percent_message_names_the_definition_and_version() -> None:
    state = approve(
        publish(active("1.0"), "2.0", "sha256:2", ALICE).after, "2.0", BOB, separate_approver=True
    )
    with pytest.raises(LifecycleRefused) as exc:
        start_canary(state.after, "2.0", 0, CAROL)
    message = refusal(exc, "bad_percent", "2.0")
    assert NAME in message and "2.0" in message


def test_a_canary_without_an_active_version_is_refused() -> None:
    with pytest.raises(LifecycleRefused) as exc:
        start_canary(approved("1.0"), "1.0", 10, CAROL)
    message = refusal(exc, "no_active_version", "1.0")
    assert NAME in message and "activate 1.0 instead" in message


def test_the_active_version_cannot_be_its_own_canary() -> None:
    with pytest.raises(LifecycleRefused) as exc:
        start_canary(active("1.0"), "1.0", 10, CAROL)
    message = refusal(exc, "not_approved", "1.0")
    assert NAME in message and "other than the active one" in message


def test_a_published_version_cannot_be_a_canary() -> None:
    state = publish(active("1.0"), "2.0", digest("2.0"), ALICE).after
    with pytest.raises(LifecycleRefused) as exc:
        start_canary(state, "2.0", 10, CAROL)
    message = refusal(exc, "not_approved", "2.0")
    assert "2.0 is published" in message
    assert "saga definitions approve model-ingest --version 2.0" in message


def test_a_retired_version_cannot_be_a_canary() -> None:
    state = retire(active("1.0", "2.0"), "1.0", CAROL).after
    with pytest.raises(LifecycleRefused) as exc:
        start_canary(state, "1.0", 10, CAROL)
    assert "1.0 is retired" in refusal(exc, "not_approved", "1.0")


def test_a_second_canary_is_refused() -> None:
    with pytest.raises(LifecycleRefused) as exc:
        start_canary(canary_on(), "3.0", 20, CAROL)
    assert "'canary'" in refusal(exc, "canary_in_progress", "3.0")


def test_promote_makes_the_canary_active_and_the_old_active_standby() -> None:
    state = canary_on(30)
    change = promote(state, Actor("dave", 5_000, "looks good"))
    after = change.after
    assert (after.active, after.canary, after.canary_percent) == ("2.0", None, 0)
    assert states_of(after) == {"1.0": State.STANDBY, "2.0": State.ACTIVE, "3.0": State.APPROVED}
    assert after.versions["2.0"].activated_by == "dave"
    assert change.records == (
        AuditRecord(NAME, "1.0", digest("1.0"), "promote", "active", "standby", "dave", 5_000, "looks good"),
        AuditRecord(NAME, "2.0", digest("2.0"), "promote", "canary", "active", "dave", 5_000, "looks good"),
    )


def test_abort_puts_the_canary_back_to_approved() -> None:
    state = canary_on(30)
    change = abort(state, Actor("dave", 5_000, "error rate"))
    after = change.after
    assert (after.active, after.canary, after.canary_percent) == ("1.0", None, 0)
    assert states_of(after) == {"1.0": State.ACTIVE, "2.0": State.APPROVED, "3.0": State.APPROVED}
    assert change.records == (
        AuditRecord(NAME, "2.0", digest("2.0"), "abort", "canary", "approved", "dave", 5_000, "error rate"),
    )


@pytest.mark.parametrize("verb", [promote, abort])
def test_promote_and_abort_without_a_canary_are_refused(verb: object) -> None:
    name = verb.__name__  # type: ignore[attr-defined]
    with pytest.raises(LifecycleRefused) as exc:
        verb(active("1.0"), CAROL)  # type: ignore[operator]
    message = refusal(exc, "no_canary", None)
    assert message.startswith(f"{NAME} has no canary on: nothing to {name}; start one with")


# ---- rollback -------------------------------------------------------------------------------------------


def test_rollback_activates_the_version_active_before_the_current_one() -> None:
    state = active("1.0", "2.0")
    change = rollback(state, ["1.0", "2.0"], Actor("dave", 5_000, "regression"))
    assert change.after.active == "1.0"
    assert states_of(change.after) == {"1.0": State.ACTIVE, "2.0": State.STANDBY}
    assert [
        (r.version, r.action, r.from_state, r.to_state, r.actor, r.at, r.reason) for r in change.records
    ] == [
        ("2.0", "rollback", "active", "standby", "dave", 5_000, "regression"),
        ("1.0", "rollback", "standby", "active", "dave", 5_000, "regression"),
    ]


def test_rollback_twice_goes_back_and_forth() -> None:
    state = rollback(active("1.0", "2.0"), ["1.0", "2.0"], CAROL).after
    again = rollback(state, ["1.0", "2.0", "1.0"], CAROL)
    assert again.after.active == "2.0"


def test_rollback_uses_the_last_time_the_current_version_became_active() -> None:
    # 1.0, 2.0, 3.0, then 2.0 again: before 2.0 last became active, 3.0 was
    state = activate(active("1.0", "2.0", "3.0"), "2.0", CAROL).after
    change = rollback(state, ["1.0", "2.0", "3.0", "2.0"], CAROL)
    assert change.after.active == "3.0"


def test_rollback_after_a_promote() -> None:
    state = promote(canary_on(), CAROL).after
    assert rollback(state, ["1.0", "2.0"], CAROL).after.active == "1.0"


def test_rollback_without_an_active_version_is_refused() -> None:
    with pytest.raises(LifecycleRefused) as exc:
        rollback(approved("1.0"), [], CAROL)
    message = refusal(exc, "no_active_version", None)
    assert NAME in message and "no active version" in message


@pytest.mark.parametrize("activations", [["1.0"], [], ["1.0", "1.0"]])
def test_rollback_of_the_first_version_ever_activated_is_refused(activations: list[str]) -> None:
    with pytest.raises(LifecycleRefused) as exc:
        rollback(active("1.0"), activations, CAROL)
    message = refusal(exc, "no_previous_version", "1.0")
    assert NAME in message and "1.0 is the first version ever activated" in message


def test_rollback_to_a_retired_version_is_refused() -> None:
    state = retire(active("1.0", "2.0"), "1.0", CAROL).after
    with pytest.raises(LifecycleRefused) as exc:
        rollback(state, ["1.0", "2.0"], CAROL)
    message = refusal(exc, "previous_retired", "1.0")
    for part in (NAME, "1.0, active before 2.0, is retired", "saga definitions activate model-ingest"):
        assert part in message


def test_rollback_during_a_canary_is_refused() -> None:
    with pytest.raises(LifecycleRefused) as exc:
        rollback(canary_on(), ["1.0"], CAROL)
    assert "'rollback'" in refusal(exc, "canary_in_progress", None)


# ---- retire ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("setup", "version", "before"),
    [("published", "1.0", "published"), ("approved", "1.0", "approved"), ("standby", "1.0", "standby")],
)
def test_retire_stops_new_runs_of_a_version(setup: str, version: str, before: str) -> None:
    state = {"published": published("1.0"), "approved": approved("1.0"), "standby": active("1.0", "2.0")}[
        setup
    ]
    change = retire(state, version, Actor("dave", 6_000, "eol"))
    rec = change.after.versions[version]
    assert rec.state is State.RETIRED
    assert (rec.retired_by, rec.retired_at) == ("dave", 6_000)
    assert rec.digest == state.versions[version].digest
    assert change.records == (
        AuditRecord(NAME, version, rec.digest, "retire", before, "retired", "dave", 6_000, "eol"),
    )
    assert change.after.active == state.active


def test_retiring_a_retired_version_is_a_noop() -> None:
    state = retire(published("1.0"), "1.0", CAROL).after
    change = retire(state, "1.0", BOB)
    assert change.noop and change.after == state


def test_retiring_the_active_version_is_refused() -> None:
    with pytest.raises(LifecycleRefused) as exc:
        retire(active("1.0"), "1.0", CAROL)
    message = refusal(exc, "version_active", "1.0")
    for part in (NAME, "1.0 is the active version", "activate another one first", "roll back"):
        assert part in message


@pytest.mark.parametrize("version", ["1.0", "2.0", "3.0"])
def test_retire_during_a_canary_is_refused(version: str) -> None:
    with pytest.raises(LifecycleRefused) as exc:
        retire(canary_on(), version, CAROL)
    assert "'retire'" in refusal(exc, "canary_in_progress", version)


def test_retire_of_an_unknown_version_is_refused() -> None:
    with pytest.raises(LifecycleRefused) as exc:
        retire(published("1.0"), "2.0", CAROL)
    refusal(exc, "unknown_version", "2.0")


# ---- chain ----------------------------------------------------------------------------------------------


def test_chain_publishes_approves_and_activates_as_one_change() -> None:
    state = active("1.0")
    change = chain(
        lambda s: publish(s, "2.0", digest("2.0"), ALICE),
        lambda s: approve(s, "2.0", ALICE, separate_approver=False),
        lambda s: activate(s, "2.0", ALICE),
    )(state)
    assert change.before == state
    assert change.after.active == "2.0"
    assert states_of(change.after) == {"1.0": State.STANDBY, "2.0": State.ACTIVE}
    assert [(r.version, r.action, r.from_state, r.to_state) for r in change.records] == [
        ("2.0", "publish", None, "published"),
        ("2.0", "approve", "published", "approved"),
        ("1.0", "activate", "active", "standby"),
        ("2.0", "activate", "approved", "active"),
    ]


def test_chain_of_noops_is_a_noop() -> None:
    state = active("1.0")
    change = chain(
        lambda s: publish(s, "1.0", digest("1.0"), ALICE),
        lambda s: approve(s, "1.0", ALICE, separate_approver=False),
        lambda s: activate(s, "1.0", ALICE),
    )(state)
    assert change.noop and change.after == state


def test_chain_stops_at_the_first_refusal() -> None:
    state = published("1.0")
    verbs = chain(
        lambda s: approve(s, "1.0", ALICE, separate_approver=True),
        lambda s: activate(s, "1.0", ALICE),
    )
    with pytest.raises(LifecycleRefused) as exc:
        verbs(state)
    assert exc.value.reason == "separate_approver_required"
    assert state == published("1.0")


# ---- choosing the version of a new run ------------------------------------------------------------------


def test_choose_uses_the_active_version_without_a_canary() -> None:
    state = active("1.0", "2.0")
    assert {choose(state, f"run-{i}").version for i in range(200)} == {"2.0"}


def test_choose_a_named_startable_version() -> None:
    state = canary_on()
    assert {v: choose(state, "r", v).state for v in ("1.0", "2.0", "3.0")} == {
        "1.0": State.ACTIVE,
        "2.0": State.CANARY,
        "3.0": State.APPROVED,
    }
    standby = active("1.0", "2.0")
    assert choose(standby, "r", "1.0").state is State.STANDBY


def test_choose_refuses_a_published_version_and_lists_the_startable_ones() -> None:
    state = publish(active("1.0"), "2.0", digest("2.0"), ALICE).after
    with pytest.raises(NotStartable) as exc:
        choose(state, "r", "2.0")
    err = exc.value
    assert (err.definition, err.version, err.startable) == (NAME, "2.0", ["1.0"])
    assert err.code == "version_not_startable"
    assert str(err) == (
        f"cannot start {NAME}: version 2.0 is published (not approved yet); versions you may start: 1.0"
    )


def test_choose_refuses_a_retired_version() -> None:
    state = retire(active("1.0", "2.0"), "1.0", CAROL).after
    with pytest.raises(NotStartable) as exc:
        choose(state, "r", "1.0")
    assert exc.value.startable == ["2.0"]
    assert "version 1.0 is retired (no new runs)" in str(exc.value)


def test_choose_refuses_an_unknown_version() -> None:
    with pytest.raises(NotStartable) as exc:
        choose(active("1.0"), "r", "7")
    assert exc.value.startable == ["1.0"]
    assert "it has no version '7'" in str(exc.value) and "versions you may start: 1.0" in str(exc.value)


def test_choose_without_an_active_version_says_what_to_do() -> None:
    with pytest.raises(NotStartable) as exc:
        choose(published("1.0"), "r")
    assert exc.value.version is None and exc.value.startable == []
    assert str(exc.value) == (
        f"cannot start {NAME}: it has no active version; no version of it is approved yet: publish, "
        "approve and activate one"
    )
    with pytest.raises(NotStartable) as exc:
        choose(approved("1.0"), "r")
    assert "versions you may start: 1.0" in str(exc.value)


def test_choose_picks_the_canary_for_its_share_of_run_ids() -> None:
    state = canary_on(30)
    picks = {f"run-{i}": choose(state, f"run-{i}").version for i in range(2_000)}
    assert {run for run, v in picks.items() if v == "2.0"} == {run for run in picks if on_canary(run, 30)}
    assert set(picks.values()) == {"1.0", "2.0"}
    assert 0.25 < sum(v == "2.0" for v in picks.values()) / len(picks) < 0.35


def test_canary_bucket_is_a_stable_function_of_the_run_id() -> None:
    assert canary_bucket("run-1") == canary_bucket("run-1")
    assert all(0 <= canary_bucket(f"r{i}") < CANARY_BUCKETS for i in range(500))
    # pinned: a change in the hash would move runs between versions across releases
    expected = int.from_bytes(hashlib.sha256(b"run-1").digest()[:8], "big") % CANARY_BUCKETS
    assert canary_bucket("run-1") == expected


def test_on_canary_takes_exactly_percent_of_the_buckets() -> None:
    # run ids found by search, at the edges of the 10% share (buckets 0..999) and of the bucket range
    edges = {"run-9498": 0, "run-2754": 999, "run-11804": 1_000, "run-12872": CANARY_BUCKETS - 1}
    assert {run: canary_bucket(run) for run in edges} == edges
    assert on_canary("run-9498", 1) and on_canary("run-2754", 10)
    assert not on_canary("run-11804", 10) and on_canary("run-11804", 11)
    assert not on_canary("run-12872", 99) and not on_canary("run-9498", 0)
    state = canary_on(10)
    assert choose(state, "run-2754").version == "2.0"
    assert choose(state, "run-11804").version == "1.0"


def test_on_canary_bounds() -> None:
    ids = [f"r{i}" for i in range(500)]
    assert not any(on_canary(r, 0) for r in ids)
    assert all(on_canary(r, 100) for r in ids)
    # a larger share includes every run of a smaller one
    assert all(on_canary(r, 40) for r in ids if on_canary(r, 10))


# ---- JSON -----------------------------------------------------------------------------------------------


def test_definition_state_round_trips_through_json() -> None:
    state = retire(promote(canary_on(40), CAROL).after, "3.0", Actor("dave", 9_000, "obsolete")).after
    state = start_canary(state, "1.0", 40, CAROL).after
    state = DefinitionState(state.name, 7, state.versions, state.active, state.canary, state.canary_percent)
    document = json.loads(json.dumps(state.to_json()))
    assert document["revision"] == 7
    assert document["canary"] == "1.0" and document["canary_percent"] == 40
    assert document["versions"]["3.0"]["state"] == "retired"
    assert document["versions"]["3.0"]["retired_by"] == "dave"
    back = DefinitionState.from_json(document)
    assert back == state
    assert list(back.versions) == list(state.versions)
    assert all(isinstance(r.state, State) for r in back.versions.values())


def test_empty_state_round_trips_and_defaults_apply() -> None:
    assert DefinitionState.from_json(empty().to_json()) == empty()
    assert DefinitionState.from_json({"name": NAME}) == empty()


def test_version_record_json_ignores_unknown_fields() -> None:
    rec = VersionRecord("1.0", "sha256:1", State.STANDBY, "alice", 1, "bob", 2, "carol", 3)
    data = {**rec.to_json(), "future_field": "x"}
    assert data["state"] == "standby"
    assert VersionRecord.from_json(data) == rec

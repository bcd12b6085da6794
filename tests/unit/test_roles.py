"""Roles and permissions (``orchestrator/auth/roles.py``): the whole action x role matrix written out
once by hand, the roles each action needs, the 403 message, and the pure token helpers of
``orchestrator/auth/tokens.py`` (key names, secret shape, hashing)."""

from __future__ import annotations

import pytest

from orchestrator.auth.roles import (
    Action,
    Forbidden,
    Identity,
    Role,
    RoleUnknown,
    allows,
    needed_roles,
    parse_role,
    refusal,
    require,
)
from orchestrator.auth.tokens import (
    TokenNameInvalid,
    audit_key,
    check_name,
    hash_secret,
    ids_key,
    names_key,
    token_id_of,
    token_key,
)
from orchestrator.errors import SagaError

V, AU, AP, OP, AD = Role.VIEWER, Role.AUTHOR, Role.APPROVER, Role.OPERATOR, Role.ADMIN

#: Written out by hand rather than derived from GRANTS: the table the brief states, checked cell by cell.
EXPECTED: dict[Action, set[Role]] = {
    Action.READ: {V, AU, AP, OP, AD},
    Action.PUBLISH: {AU, AD},
    Action.APPROVE: {AP, AD},
    Action.ACTIVATE: {AP, AD},
    Action.CANARY: {AP, AD},
    Action.PROMOTE: {AP, AD},
    Action.ABORT: {AP, AD},
    Action.ROLLBACK: {AP, AD},
    Action.RETIRE: {AP, AD},
    Action.START: {OP, AD},
    Action.CANCEL: {OP, AD},
    Action.REDRIVE: {OP, AD},
    Action.HANDLE_DEAD_LETTERS: {OP, AD},
    Action.CHANGE_SHARDS: {OP, AD},
    Action.MANAGE_TOKENS: {AD},
}


def test_the_expected_table_covers_every_action() -> None:
    assert set(EXPECTED) == set(Action)


@pytest.mark.parametrize("action", list(Action))
@pytest.mark.parametrize("role", list(Role))
def test_every_cell_of_the_matrix(role: Role, action: Action) -> None:
    assert allows(role, action) is (role in EXPECTED[action])
    assert Identity("someone", role).allows(action) is (role in EXPECTED[action])


@pytest.mark.parametrize("action", list(Action))
def test_needed_roles_are_those_allowed_in_role_order_admin_last(action: Action) -> None:
    needed = needed_roles(action)
    assert set(needed) == EXPECTED[action]
    assert list(needed) == [r for r in Role if r in needed]
    assert needed[-1] is Role.ADMIN


def test_every_role_reads_and_only_admin_manages_tokens() -> None:
    assert all(allows(role, Action.READ) for role in Role)
    assert needed_roles(Action.MANAGE_TOKENS) == (Role.ADMIN,)
    assert all(allows(Role.ADMIN, action) for action in Action)


def test_wire_values_are_stable() -> None:
    assert [r.value for r in Role] == ["viewer", "author", "approver", "operator", "admin"]
    assert Action.HANDLE_DEAD_LETTERS == "handle_dead_letters"
    assert Action.CHANGE_SHARDS == "change_shards"
    assert Action.MANAGE_TOKENS == "manage_tokens"


@pytest.mark.parametrize(
    ("action", "role", "message"),
    [
        (
            Action.START,
            V,
            "this needs the operator role (or admin); your token 'ci-bot' has role viewer",
        ),
        (
            Action.APPROVE,
            OP,
            "this needs the approver role (or admin); your token 'ci-bot' has role operator",
        ),
        (
            Action.PUBLISH,
            AP,
            "this needs the author role (or admin); your token 'ci-bot' has role approver",
        ),
        (Action.MANAGE_TOKENS, OP, "this needs the admin role; your token 'ci-bot' has role operator"),
    ],
)
def test_refusal_names_the_roles_needed_and_the_token(action: Action, role: Role, message: str) -> None:
    identity = Identity("ci-bot", role, token_id="0123456789ab")
    assert refusal(identity, action) == message
    with pytest.raises(Forbidden) as caught:
        require(identity, action)
    error = caught.value
    assert isinstance(error, SagaError)
    assert str(error) == message
    assert error.code == "forbidden"
    assert error.ids == {
        "action": action.value,
        "token": "ci-bot",
        "role": role.value,
        "needed": [r.value for r in needed_roles(action)],
    }


@pytest.mark.parametrize("action", list(Action))
@pytest.mark.parametrize("role", list(Role))
def test_require_raises_exactly_where_the_role_does_not_allow(role: Role, action: Action) -> None:
    identity = Identity("t", role)
    if role in EXPECTED[action]:
        require(identity, action)
    else:
        with pytest.raises(Forbidden):
            require(identity, action)


def test_identity_defaults() -> None:
    identity = Identity("alice", Role.AUTHOR)
    assert identity.tenant == "default"
    assert identity.token_id is None


def test_parse_role() -> None:
    assert parse_role("operator") is Role.OPERATOR
    with pytest.raises(RoleUnknown) as caught:
        parse_role("root")
    assert caught.value.code == "role_unknown"
    assert caught.value.ids == {"role": "root"}
    assert "viewer, author, approver, operator, admin" in str(caught.value)


# ---- tokens: the pure parts -----------------------------------------------------------------------


def test_every_key_is_under_the_auth_hash_tag() -> None:
    assert token_key("p", "0123456789ab") == "p:{auth}:token:0123456789ab"
    assert names_key("p") == "p:{auth}:names"
    assert ids_key("p") == "p:{auth}:tokens"
    assert audit_key("p") == "p:{auth}:audit"


def test_token_id_of_accepts_only_the_secret_shape() -> None:
    good = "saga_0123456789ab_" + "A" * 43
    assert token_id_of(good) == "0123456789ab"
    assert token_id_of("saga_0123456789ab_" + "a_b-" * 11) == "0123456789ab"
    for bad in [
        "",
        "0123456789ab",
        "saga_0123456789ab_short",
        "saga_0123456789AB_" + "A" * 43,  # the id is lowercase hex
        "saga_0123456789a_" + "A" * 43,
        "sage_0123456789ab_" + "A" * 43,
        good + "\n",
        good + "!",
        "saga_0123456789ab_" + "A" * 500,
    ]:
        assert token_id_of(bad) is None, bad


def test_hash_secret_is_sha256_hex() -> None:
    assert hash_secret("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


@pytest.mark.parametrize("name", ["ci-bot", "alice@example.com", "a", "svc.deploy_2", "x" * 100])
def test_valid_names(name: str) -> None:
    assert check_name("name", name) == name


@pytest.mark.parametrize("name", ["", "bad name", "-leading", ".hidden", "x" * 101, "a:b", "a{b}", "é"])
def test_invalid_names(name: str) -> None:
    with pytest.raises(TokenNameInvalid) as caught:
        check_name("name", name)
    assert caught.value.code == "token_name_invalid"
    assert caught.value.ids == {"field": "name", "value": name}

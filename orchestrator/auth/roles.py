"""Roles and what each may do: pure, no I/O, so the HTTP API, the CLI and the tests share one table.

Every role reads. Beyond that: an ``author`` publishes definition versions; an ``approver`` governs them
(approve, activate, canary, promote, abort, rollback, retire); an ``operator`` runs the system (start,
cancel and re-drive runs, replay or purge dead letters, change the shard map); an ``admin`` may do all of
that and manages tokens. Roles do not nest otherwise: an approver cannot start a run, an operator cannot
approve a version (a separation of duties, as ``SAGA_REQUIRE_SEPARATE_APPROVER`` is for actors).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from orchestrator.errors import SagaError


class Role(StrEnum):
    """A token's role; the values are stored with tokens and never reworded."""

    VIEWER = "viewer"
    AUTHOR = "author"
    APPROVER = "approver"
    OPERATOR = "operator"
    ADMIN = "admin"


class Action(StrEnum):
    """What a request does, as far as permissions go; the values are stable (error documents carry them)."""

    READ = "read"  # runs, status, history, definitions, contracts, shards, dead letters: every read
    PUBLISH = "publish"
    APPROVE = "approve"
    ACTIVATE = "activate"
    CANARY = "canary"
    PROMOTE = "promote"
    ABORT = "abort"
    ROLLBACK = "rollback"
    RETIRE = "retire"
    START = "start"
    CANCEL = "cancel"
    REDRIVE = "redrive"
    HANDLE_DEAD_LETTERS = "handle_dead_letters"  # replay, purge
    CHANGE_SHARDS = "change_shards"  # add, drain, retire
    MANAGE_TOKENS = "manage_tokens"  # create, list, revoke


#: The lifecycle verbs of definition versions (orchestrator.governance.service.VERBS) as actions.
GOVERNANCE = frozenset(
    {
        Action.APPROVE,
        Action.ACTIVATE,
        Action.CANARY,
        Action.PROMOTE,
        Action.ABORT,
        Action.ROLLBACK,
        Action.RETIRE,
    }
)
OPERATIONS = frozenset(
    {Action.START, Action.CANCEL, Action.REDRIVE, Action.HANDLE_DEAD_LETTERS, Action.CHANGE_SHARDS}
)

GRANTS: Mapping[Role, frozenset[Action]] = {
    Role.VIEWER: frozenset({Action.READ}),
    Role.AUTHOR: frozenset({Action.READ, Action.PUBLISH}),
    Role.APPROVER: frozenset({Action.READ, *GOVERNANCE}),
    Role.OPERATOR: frozenset({Action.READ, *OPERATIONS}),
    Role.ADMIN: frozenset(Action),
}


def allows(role: Role, action: Action) -> bool:
    """Whether ``role`` may do ``action``."""
    return action in GRANTS[role]


def needed_roles(action: Action) -> tuple[Role, ...]:
    """The roles that may do ``action``, in the order :class:`Role` lists them (admin last)."""
    return tuple(role for role in Role if allows(role, action))


class RoleUnknown(SagaError):
    """Raised when a role name is none of :class:`Role`'s values."""

    code = "role_unknown"
    id_fields = ("role",)

    def __init__(self, role: str) -> None:
        self.role = role
        super().__init__(f"unknown role {role!r}: use one of {', '.join(Role)}")


def parse_role(value: str) -> Role:
    """``value`` as a :class:`Role`; raises :class:`RoleUnknown`."""
    try:
        return Role(value)
    except ValueError:
        raise RoleUnknown(value) from None


@dataclass(frozen=True)
class Identity:
    """Who a request acts as: a token's name (the actor in audit records), its role and its tenant.
    ``token_id`` is None for an identity that no token stands for (the local CLI)."""

    name: str
    role: Role
    tenant: str = "default"
    token_id: str | None = None

    def allows(self, action: Action) -> bool:
        return allows(self.role, action)


def refusal(identity: Identity, action: Action) -> str:
    """Why ``identity`` may not do ``action``, naming the roles that may:
    ``this needs the operator role (or admin); your token 'ci-bot' has role viewer``."""
    first, *others = needed_roles(action)
    alternatives = f" (or {', '.join(others)})" if others else ""
    yours = f"your token {identity.name!r} has role {identity.role}"
    return f"this needs the {first} role{alternatives}; {yours}"


class Forbidden(SagaError):
    """Raised when an identity's role does not allow an action (HTTP 403); the message names the roles
    that would, and ``needed`` lists them (as the 403 document of the API does)."""

    code = "forbidden"
    id_fields = ("action", "token", "role", "needed")

    def __init__(self, identity: Identity, action: Action) -> None:
        self.action = action.value
        self.token = identity.name
        self.role = identity.role.value
        self.needed = [role.value for role in needed_roles(action)]
        super().__init__(refusal(identity, action))


def require(identity: Identity, action: Action) -> None:
    """Raise :class:`Forbidden` unless ``identity`` may do ``action``."""
    if not identity.allows(action):
        raise Forbidden(identity, action)

"""The key ring: which keys sign, which verify, and what each may sign. Pure: no I/O, no clock.

A key has a *scope*, the messages it may sign (:data:`SCOPE_KINDS`), narrowed for worker keys to the
contracts their pool serves, for client keys to their one tenant and for the server's key to the tenants
of its tokens. HMAC keys are symmetric (whoever verifies with a key can sign with it), so scopes are also
what keeps each process's secrets to what it needs: a worker holds its own key and the ``dispatch`` key
it verifies tasks with, never the ``orchestrator`` key a shard continues its own runs with.

Rotation: several keys of a scope verify at once, one of them (``active``) signs. ``retire`` stops a key
signing at once; it still verifies for the ring's grace period after its retirement, so messages it
signed that are still in flight are taken, and is refused after that.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from orchestrator.wire.kinds import Kind


class Scope(StrEnum):
    """What a key may sign; the values are written in ring files and never reworded."""

    ANY = "any"  # an unscoped key (SAGA_SIGNING_KEYS): every kind, for every tenant and contract
    ORCHESTRATOR = "orchestrator"  # a shard to shards: barrier releases, bag refills
    DISPATCH = "dispatch"  # a shard to the outside: tasks, attempt cancellations, finished runs
    WORKER = "worker"  # a worker pool: results, acceptances and heartbeats of tasks of its contracts
    CLIENT = "client"  # a service: starts and run cancels, for its one tenant
    OPERATOR = "operator"  # a person: run cancels, re-drives, and dead letters replayed (re-signed)
    SERVER = "server"  # the control-plane server: what its tokens may ask, for the tokens' tenants
    DATA = "data"  # signs nothing: keys the hash that marks a sensitive value where it is shown


class KeyState(StrEnum):
    ACTIVE = "active"  # signs (the first active key of a scope that may sign a message) and verifies
    VERIFY = "verify"  # verifies only: added and not yet activated, or replaced by another
    RETIRED = "retired"  # signs nothing; verifies until its retirement plus the ring's grace period


#: Who may issue a dead letter again: an operator, the control-plane server, an unscoped key.
REPLAYERS = frozenset({Scope.OPERATOR, Scope.SERVER, Scope.ANY})
#: The kinds a shard takes from outside (what a dead letter replayed may be).
SHARD_INBOUND = frozenset({Kind.START, Kind.RESULT, Kind.RELEASE, Kind.REFILL, Kind.CANCEL_RUN, Kind.REDRIVE})
#: The kinds whose message names a contract the worker key's scope is narrowed to.
WORKER_KINDS = frozenset({Kind.RESULT, Kind.ACCEPTED, Kind.HEARTBEAT})
#: The kinds a tenant-bound key signs only for its tenant(s).
TENANT_KINDS = frozenset({Kind.START, Kind.CANCEL_RUN, Kind.REDRIVE, *SHARD_INBOUND})

SCOPE_KINDS: Mapping[Scope, frozenset[Kind]] = {
    Scope.ANY: frozenset(Kind),
    Scope.ORCHESTRATOR: frozenset({Kind.RELEASE, Kind.REFILL}),
    Scope.DISPATCH: frozenset({Kind.TASK, Kind.CANCEL, Kind.FINISHED}),
    Scope.WORKER: WORKER_KINDS,
    Scope.CLIENT: frozenset({Kind.START, Kind.CANCEL_RUN}),
    Scope.OPERATOR: frozenset({Kind.CANCEL_RUN, Kind.REDRIVE, *SHARD_INBOUND}),
    Scope.SERVER: frozenset({Kind.START, Kind.CANCEL_RUN, Kind.REDRIVE, *SHARD_INBOUND}),
    Scope.DATA: frozenset(),
}

#: What each scope signs of its own accord: an operator's and the server's keys sign other kinds only when
#: a dead letter is issued again (``bus/reissue.py`` asks for ``REPLAYERS``), never as a process's
#: ordinary signer of, say, a result a worker key of its own does not cover.
ORDINARY_KINDS: Mapping[Scope, frozenset[Kind]] = {
    **SCOPE_KINDS,
    Scope.OPERATOR: frozenset({Kind.CANCEL_RUN, Kind.REDRIVE}),
    Scope.SERVER: frozenset({Kind.START, Kind.CANCEL_RUN, Kind.REDRIVE}),
}

ALL = "*"  # in a worker key's contracts or a server key's tenants: every one


@dataclass(frozen=True)
class RingKey:
    """One key. ``secret`` is None where this process does not hold it (its file or variable is not
    here): the process can neither sign nor verify with it, which is how secrets are kept to need."""

    key_id: str
    scope: Scope
    state: KeyState
    secret: bytes | None
    contracts: frozenset[str] = frozenset()  # worker keys: contract names, or name@version, or "*"
    tenants: frozenset[str] = frozenset()  # client keys: exactly one; server keys: some, or "*"
    retired_at_ms: int | None = None

    @property
    def tenant(self) -> str | None:
        """The one tenant a client key signs for (None for other scopes)."""
        if self.scope is Scope.CLIENT and len(self.tenants) == 1:
            return next(iter(self.tenants))
        return None

    def serves(self, contract: str | None) -> bool:
        """Whether a worker key may sign about a task of ``contract`` (``name@version``): a report must name
        its task's contract, even under a key for every contract (its run checks it is its task's)."""
        if not contract:
            return False
        if ALL in self.contracts:
            return True
        return contract in self.contracts or contract.partition("@")[0] in self.contracts

    def acts_for(self, tenant: str) -> bool:
        return ALL in self.tenants or tenant in self.tenants

    def describe(self) -> str:
        """The key and its scope, for errors: ``key 'pool-a' (worker for charge, refund)``."""
        narrowed = ""
        if self.scope is Scope.WORKER:
            narrowed = f" for contracts {', '.join(sorted(self.contracts))}"
        elif self.scope in (Scope.CLIENT, Scope.SERVER):
            narrowed = f" for tenants {', '.join(sorted(self.tenants))}"
        return f"key {self.key_id!r} ({self.scope.value}{narrowed})"


def out_of_scope(key: RingKey, kind: Kind, contract: str | None, tenant: str) -> str | None:
    """Why ``key`` may not sign a ``kind`` message about ``contract`` for ``tenant`` (None: it may)."""
    if key.scope is Scope.ANY:
        return None
    if kind not in SCOPE_KINDS[key.scope]:
        return f"{key.describe()} may not sign {kind.value} messages"
    if key.scope is Scope.WORKER and not key.serves(contract):
        return f"{key.describe()} may not sign a {kind.value} for contract {contract or '(none)'}"
    if key.scope in (Scope.CLIENT, Scope.SERVER) and kind in TENANT_KINDS and not key.acts_for(tenant):
        return f"{key.describe()} may not sign a {kind.value} for tenant {tenant!r}"
    return None


class NoSigningKey(LookupError):
    """No active key this process holds may sign the message: the ring needs one added and activated."""


@dataclass(frozen=True)
class Ring:
    """The keys in their order (the first active key that may sign a message signs it) and how long a
    retired key still verifies."""

    keys: tuple[RingKey, ...]
    retire_grace_ms: int
    _by_id: Mapping[str, RingKey] = field(init=False, repr=False, compare=False)
    _signing: dict[tuple[Kind | str, str | None], RingKey] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_id", {k.key_id: k for k in self.keys})
        object.__setattr__(self, "_signing", {})

    def get(self, key_id: str) -> RingKey | None:
        return self._by_id.get(key_id)

    def signing_key(
        self, kind: Kind | str, contract: str | None = None, scopes: frozenset[Scope] | None = None
    ) -> RingKey:
        """The key that signs a ``kind`` message (about ``contract``), of one of ``scopes`` if given;
        raises :class:`NoSigningKey`."""
        cached = None if scopes else self._signing.get((kind, contract))  # a Kind hashes as its value
        if cached is not None:
            return cached
        kinds = ORDINARY_KINDS if scopes is None else SCOPE_KINDS
        for key in self.keys:
            if key.state is not KeyState.ACTIVE or key.secret is None:
                continue
            if scopes is not None and key.scope not in scopes:
                continue
            if key.scope is not Scope.ANY and kind not in kinds[key.scope]:
                continue
            if key.scope is Scope.WORKER and not key.serves(contract):
                continue
            if scopes is None:
                self._signing[(kind, contract)] = key
            return key
        what = f"a {kind} message" + (f" for contract {contract}" if contract else "")
        if scopes is not None:
            what += f" as {' or '.join(sorted(s.value for s in scopes))}"
        held = ", ".join(k.key_id for k in self.keys if k.secret is not None) or "none"
        raise NoSigningKey(
            f"no active key this process holds may sign {what} (keys held: {held}): add a key of a scope "
            f"that signs {kind} messages ('saga keys add ID --scope ...'), give this process its "
            "secret and activate it ('saga keys activate ID')"
        )

    def verifying_key(self, key_id: str, now_ms: int) -> RingKey | tuple[str, str]:
        """The key that verifies a message signed under ``key_id`` at ``now_ms``, or why none does:
        (``unknown-key`` or ``retired-key``, the detail)."""
        key = self._by_id.get(key_id)
        if key is None or key.secret is None:
            return "unknown-key", f"key id {key_id!r} is not in this process's key ring"
        if key.state is KeyState.RETIRED and expired(key, now_ms, self.retire_grace_ms):
            why = f"key {key_id!r} was retired and its grace period of {self.retire_grace_ms} ms has passed"
            return "retired-key", why
        return key

    def client_tenant(self) -> str | None:
        """The tenant of the client keys this process holds, active or not (None: it holds none)."""
        for key in self.keys:
            if key.scope is Scope.CLIENT and key.secret is not None and key.state is not KeyState.RETIRED:
                return key.tenant
        return None

    def data_secret(self) -> bytes | None:
        """The secret of the active ``data`` key this process holds (None: it holds none)."""
        for key in self.keys:
            if key.scope is Scope.DATA and key.state is KeyState.ACTIVE and key.secret is not None:
                return key.secret
        return None

    def held(self) -> tuple[RingKey, ...]:
        return tuple(k for k in self.keys if k.secret is not None)


def expired(key: RingKey, now_ms: int, grace_ms: int) -> bool:
    """Whether retired ``key`` no longer verifies at ``now_ms``."""
    return key.retired_at_ms is None or now_ms >= key.retired_at_ms + grace_ms


def unscoped_ring(pairs: Mapping[str, bytes], retire_grace_ms: int = 0) -> Ring:
    """A ring of unscoped keys (``SAGA_SIGNING_KEYS``): the first signs, every one verifies."""
    keys = tuple(
        RingKey(key_id, Scope.ANY, KeyState.ACTIVE if i == 0 else KeyState.VERIFY, secret)
        for i, (key_id, secret) in enumerate(pairs.items())
    )
    return Ring(keys, retire_grace_ms)

"""The key ring file (``SAGA_KEY_RING_FILE``): the keys' ids, scopes and states, and where each secret is.

The file holds no secret, so it can be reviewed and distributed like any configuration: each key names a
file (``secret_file``, relative to the ring file's folder) or an environment variable (``secret_env``)
that holds it, and each machine is given only the secrets its processes need. A key whose secret is not
there is in the ring but not held: that process can neither sign nor verify with it.

``saga keys add|activate|retire`` edit the file (:func:`added`, :func:`activated`, :func:`retired`, pure)
and append each change to its ``changes`` list: who, when, what. Running processes reload it when it (or
a secret file) changes, or on SIGHUP (``keys/reload.py``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from orchestrator.errors import SagaError
from orchestrator.keys.ring import ALL, KeyState, Ring, RingKey, Scope

KEY_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
NAME_PATTERN = r"^(\*|[A-Za-z0-9][A-Za-z0-9._@-]{0,199})$"  # a contract (name or name@version), a tenant
SECRET_BYTES = 32  # of a generated secret, written as hex
MIN_SECRET_CHARS = 16


class KeyRingError(SagaError):
    """A key ring file that cannot be read or used, or a change to it that is refused."""

    code = "key_ring_invalid"


class KeyEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(pattern=KEY_ID_PATTERN)
    scope: Scope
    state: KeyState = KeyState.VERIFY
    secret_file: str | None = None
    secret_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    contracts: list[Annotated[str, Field(pattern=NAME_PATTERN)]] = Field(default_factory=list)
    tenants: list[Annotated[str, Field(pattern=NAME_PATTERN)]] = Field(default_factory=list)
    retired_at_ms: int | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _consistent(self) -> KeyEntry:
        problem = entry_problem(self)
        if problem:
            raise ValueError(problem)
        return self


def entry_problem(entry: KeyEntry) -> str | None:
    """Why ``entry`` cannot be used (None: it can)."""
    if (entry.secret_file is None) == (entry.secret_env is None):
        return f"key {entry.id!r} must name exactly one of secret_file and secret_env"
    if entry.scope is Scope.WORKER and not entry.contracts:
        return f"worker key {entry.id!r} must list the contracts its pool serves (or '*' for every one)"
    if entry.scope is not Scope.WORKER and entry.contracts:
        return f"key {entry.id!r} is a {entry.scope.value} key: only worker keys list contracts"
    if entry.scope is Scope.CLIENT and (len(entry.tenants) != 1 or ALL in entry.tenants):
        return f"client key {entry.id!r} must name exactly one tenant (its runs are that tenant's)"
    if entry.scope is Scope.SERVER and not entry.tenants:
        return f"server key {entry.id!r} must list the tenants it acts for (or '*' for every one)"
    if entry.scope not in (Scope.CLIENT, Scope.SERVER) and entry.tenants:
        return f"key {entry.id!r} is a {entry.scope.value} key: only client and server keys name tenants"
    if entry.state is KeyState.RETIRED and entry.retired_at_ms is None:
        return f"retired key {entry.id!r} must say when it was retired (retired_at_ms)"
    return None


class Change(BaseModel):
    model_config = ConfigDict(extra="forbid")

    at_ms: int
    actor: str
    verb: str
    key: str
    detail: str = ""


class RingFile(BaseModel):
    """The file's contents, in order: the first active key that may sign a message signs it."""

    model_config = ConfigDict(extra="forbid")

    keys: list[KeyEntry] = Field(default_factory=list)
    changes: list[Change] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique_ids(self) -> RingFile:
        seen: set[str] = set()
        sources: dict[str, str] = {}
        for entry in self.keys:
            if entry.id in seen:
                raise ValueError(f"key id {entry.id!r} appears twice: each key needs an id of its own")
            seen.add(entry.id)
            source = f"file {entry.secret_file}" if entry.secret_file else f"variable {entry.secret_env}"
            if source in sources:
                raise ValueError(
                    f"keys {sources[source]!r} and {entry.id!r} both take their secret from {source}: "
                    "each key needs a secret of its own (one shared would give either holder both scopes)"
                )
            sources[source] = entry.id
        return self

    def entry(self, key_id: str) -> KeyEntry:
        for entry in self.keys:
            if entry.id == key_id:
                return entry
        known = ", ".join(e.id for e in self.keys) or "none"
        raise KeyRingError(f"no key {key_id!r} in the key ring (its keys: {known}): see 'saga keys list'")


# ---- reading and writing ------------------------------------------------------------------------------


def read_ring_file(path: Path) -> RingFile:
    """The ring file at ``path``; raises KeyRingError saying what is wrong (an absent file is empty)."""
    if not path.exists():
        return RingFile()
    try:
        raw = yaml.safe_load(path.read_text()) or {}
        return RingFile.model_validate(raw)
    except (OSError, yaml.YAMLError) as exc:
        raise KeyRingError(f"cannot read the key ring file {path}: {exc}") from exc
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first["loc"]) or "file"
        raise KeyRingError(f"key ring file {path} is invalid at {where}: {first['msg']}") from exc


def write_ring_file(path: Path, ring: RingFile) -> None:
    """Replace the file at ``path`` in one step, so a process reloading it never reads half of it."""
    text = "# saga key ring: no secrets here (each key names its secret's file or variable)\n"
    text += yaml.safe_dump(ring.model_dump(mode="json", exclude_none=True), sort_keys=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = path.stat().st_mode & 0o777 if path.exists() else 0o644  # it holds no secret: readable by all
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(temporary, mode)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def editing(path: Path) -> Iterator[None]:
    """Hold the ring file's edit lock (a file beside it): two ``saga keys`` run at once would otherwise
    both read it, and the second write would drop the first's change and its audit entry."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def secret_path(ring_path: Path, entry: KeyEntry) -> Path | None:
    if entry.secret_file is None:
        return None
    found = Path(entry.secret_file).expanduser()
    return found if found.is_absolute() else ring_path.parent / found


def read_secret(ring_path: Path, entry: KeyEntry, environ: Mapping[str, str]) -> bytes | None:
    """The key's secret, or None where this process does not hold it. One that is there but too short
    raises: a guessable secret is a forgery licence, not a missing key."""
    where = secret_path(ring_path, entry)
    if where is not None:
        try:
            text = where.read_text().strip()
        except (FileNotFoundError, PermissionError):
            return None  # not this process's to hold
        except OSError as exc:
            raise KeyRingError(f"cannot read the secret of key {entry.id!r} from {where}: {exc}") from exc
        source = f"file {where}"
    else:
        assert entry.secret_env is not None
        text = environ.get(entry.secret_env, "").strip()
        if not text:
            return None
        source = f"variable {entry.secret_env}"
    if len(text) < MIN_SECRET_CHARS:
        raise KeyRingError(
            f"the secret of key {entry.id!r} ({source}) has {len(text)} characters, under "
            f"{MIN_SECRET_CHARS}: use a random one ('saga keys add' writes one of {SECRET_BYTES} bytes)"
        )
    return text.encode()


def ring_of(path: Path, contents: RingFile, retire_grace_ms: int, environ: Mapping[str, str]) -> Ring:
    """The ring the file describes, with the secrets this process holds."""
    keys = tuple(
        RingKey(
            key_id=e.id,
            scope=e.scope,
            state=e.state,
            secret=read_secret(path, e, environ),
            contracts=frozenset(e.contracts),
            tenants=frozenset(e.tenants),
            retired_at_ms=e.retired_at_ms,
        )
        for e in contents.keys
    )
    return Ring(keys, retire_grace_ms)


def load_ring(path: Path, retire_grace_ms: int, environ: Mapping[str, str] | None = None) -> Ring:
    """The ring a process signs and verifies with. A file that is not there is an error (a typo in
    SAGA_KEY_RING_FILE, a file replaced by deleting it first), never an empty ring that refuses all."""
    if not path.exists():
        raise KeyRingError(
            f"the key ring file {path} does not exist: check SAGA_KEY_RING_FILE ('saga keys add' creates it)"
        )
    return ring_of(path, read_ring_file(path), retire_grace_ms, os.environ if environ is None else environ)


def new_secret() -> str:
    return secrets.token_hex(SECRET_BYTES)


def write_secret_file(path: Path) -> None:
    """A new random secret at ``path``, readable by its owner only; an existing file is kept as it is."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    with os.fdopen(fd, "w") as out:
        out.write(new_secret() + "\n")


# ---- changes (pure) -----------------------------------------------------------------------------------


def _slot(entry: KeyEntry) -> tuple[Any, ...]:
    """Keys that take each other's place: the same scope, for the same contracts or tenants."""
    return entry.scope, tuple(sorted(entry.contracts)), tuple(sorted(entry.tenants))


def _changed(ring: RingFile, keys: list[KeyEntry], change: Change) -> RingFile:
    try:
        return RingFile(keys=keys, changes=[*ring.changes, change])
    except ValidationError as exc:  # the change would make the ring one a process refuses to load
        message = str(exc.errors(include_url=False)[0]["msg"]).removeprefix("Value error, ")
        raise KeyRingError(f"{change.verb} {change.key} refused: {message}") from exc


def added(ring: RingFile, entry: KeyEntry, at_ms: int, actor: str) -> RingFile:
    """``entry`` added at the end of the ring (verifying only unless it is active: activate it once every
    process that verifies holds its secret)."""
    if any(e.id == entry.id for e in ring.keys):
        raise KeyRingError(f"key {entry.id!r} is already in the key ring: choose another id")
    detail = f"scope {entry.scope.value}, state {entry.state.value}"
    keys = [*ring.keys, entry]
    if entry.state is KeyState.ACTIVE:
        keys = _demoted(keys, entry)
    return _changed(ring, keys, Change(at_ms=at_ms, actor=actor, verb="add", key=entry.id, detail=detail))


def _demoted(keys: list[KeyEntry], signer: KeyEntry) -> list[KeyEntry]:
    """``keys`` with every other active key of ``signer``'s slot verifying only."""
    return [
        e.model_copy(update={"state": KeyState.VERIFY})
        if e.id != signer.id and e.state is KeyState.ACTIVE and _slot(e) == _slot(signer)
        else e
        for e in keys
    ]


def activated(ring: RingFile, key_id: str, at_ms: int, actor: str) -> RingFile:
    """Key ``key_id`` signs from now on; the key it replaces (same scope, contracts and tenants) verifies
    only, until retired."""
    entry = ring.entry(key_id)
    if entry.state is KeyState.RETIRED:
        raise KeyRingError(f"key {key_id!r} is retired and cannot sign again: add a new key")
    chosen = entry.model_copy(update={"state": KeyState.ACTIVE})
    keys = _demoted([chosen if e.id == key_id else e for e in ring.keys], chosen)
    replaced = [
        e.id for e, before in zip(keys, ring.keys, strict=True) if e.state != before.state and e.id != key_id
    ]
    detail = f"replaces {', '.join(replaced)}" if replaced else ""
    return _changed(ring, keys, Change(at_ms=at_ms, actor=actor, verb="activate", key=key_id, detail=detail))


def retired(ring: RingFile, key_id: str, at_ms: int, actor: str, *, force: bool = False) -> RingFile:
    """Key ``key_id`` signs nothing from now on, and verifies until ``at_ms`` plus the grace period.
    Retiring the only active key of its slot would leave its messages unsigned: refused unless forced."""
    entry = ring.entry(key_id)
    if entry.state is KeyState.RETIRED:
        raise KeyRingError(f"key {key_id!r} was retired already (at {entry.retired_at_ms} ms)")
    others = [
        e for e in ring.keys if e.id != key_id and e.state is KeyState.ACTIVE and _slot(e) == _slot(entry)
    ]
    if entry.state is KeyState.ACTIVE and not others and not force:
        raise KeyRingError(
            f"key {key_id!r} is the only active {entry.scope.value} key of its kind: retiring it leaves "
            "those messages unsigned. Add and activate its successor first (saga keys add, saga keys "
            "activate), or pass --force"
        )
    gone = entry.model_copy(update={"state": KeyState.RETIRED, "retired_at_ms": at_ms})
    keys = [gone if e.id == key_id else e for e in ring.keys]
    return _changed(ring, keys, Change(at_ms=at_ms, actor=actor, verb="retire", key=key_id))

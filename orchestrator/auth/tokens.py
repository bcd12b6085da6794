"""Bearer tokens in Redis, every key under the ``{auth}`` hash tag (one slot, so one Lua call can check
and write them all):

- ``<prefix>:{auth}:token:<token_id>``: a hash: ``name``, ``role``, ``tenant``, ``hash`` (SHA-256 of the
  secret, hex), ``created_at`` (ms, Redis's clock), ``created_by``, and once revoked ``revoked_at`` and
  ``revoked_by``; kept after revocation, for the record;
- ``<prefix>:{auth}:names``: a hash: name -> token id, of live tokens only (names are unique among them);
- ``<prefix>:{auth}:tokens``: the set of every token id, live or revoked;
- ``<prefix>:{auth}:audit``: a stream, one entry per create and revoke (``action``, ``actor``, ``at``,
  ``token_id``, ``name``, ``role``, ``tenant``).

A secret is ``saga_<token_id>_<random>``: 12 hex characters of id, then 32 random bytes (URL-safe base64).
It is returned once, by :meth:`TokenStore.create`, and never stored: only its hash is.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import re
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from orchestrator.auth.roles import Identity, Role, parse_role
from orchestrator.errors import SagaError
from orchestrator.settings import Settings, redis_client

SECRET_PREFIX = "saga"
TOKEN_ID_HEX = 12
SECRET_BYTES = 32
_SECRET = re.compile(rf"{SECRET_PREFIX}_([0-9a-f]{{{TOKEN_ID_HEX}}})_[A-Za-z0-9_-]{{43,100}}")
_TOKEN_ID = re.compile(rf"[0-9a-f]{{{TOKEN_ID_HEX}}}")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,99}")
MAX_TENANT_CHARS = 64  # an envelope's tenant (orchestrator/bus/envelope.py TENANT_PATTERN)
MAX_ID_COLLISIONS = 8


def token_key(prefix: str, token_id: str) -> str:
    return f"{prefix}:{{auth}}:token:{token_id}"


def names_key(prefix: str) -> str:
    return f"{prefix}:{{auth}}:names"


def ids_key(prefix: str) -> str:
    return f"{prefix}:{{auth}}:tokens"


def audit_key(prefix: str) -> str:
    return f"{prefix}:{{auth}}:audit"


# KEYS: token, names, ids, audit. ARGV: token id, name, role, tenant, hash, created_at (ms), actor.
# Returns {1, id} created; {0, the live token's id} the name is taken; {-1, ''} the id is (retry another).
_CREATE = """
local token, names, ids, audit = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local id, name, role, tenant, hash, at, actor = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7]
local holder = redis.call('HGET', names, name)
if holder then return {0, holder} end
if redis.call('EXISTS', token) == 1 then return {-1, ''} end
redis.call('HSET', token, 'name', name, 'role', role, 'tenant', tenant, 'hash', hash,
  'created_at', at, 'created_by', actor)
redis.call('HSET', names, name, id)
redis.call('SADD', ids, id)
redis.call('XADD', audit, '*', 'action', 'create', 'actor', actor, 'at', at, 'token_id', id,
  'name', name, 'role', role, 'tenant', tenant)
return {1, id}
"""
_CREATED, _NAME_TAKEN = 1, 0

# KEYS: token, names, audit. ARGV: token id, actor, revoked_at (ms).
# Returns 1 revoked; 0 no such token; 2 already revoked (nothing changed).
_REVOKE = """
local token, names, audit = KEYS[1], KEYS[2], KEYS[3]
local id, actor, at = ARGV[1], ARGV[2], ARGV[3]
local f = redis.call('HMGET', token, 'name', 'role', 'tenant', 'revoked_at')
local name, role, tenant, revoked = f[1], f[2], f[3], f[4]
if not name then return 0 end
if revoked then return 2 end
redis.call('HSET', token, 'revoked_at', at, 'revoked_by', actor)
if redis.call('HGET', names, name) == id then redis.call('HDEL', names, name) end
redis.call('XADD', audit, '*', 'action', 'revoke', 'actor', actor, 'at', at, 'token_id', id,
  'name', name, 'role', role, 'tenant', tenant)
return 1
"""
_REVOKED, _NOT_FOUND = 1, 0

_RECORD_FIELDS = ["name", "role", "tenant", "created_at", "created_by", "revoked_at", "revoked_by"]
_ROLES = frozenset(role.value for role in Role)
_Entries = list[dict[str, Any]]  # TokenStore.list hides the builtin in the class body


class TokenNameInvalid(SagaError):
    """Raised when a token name or tenant is empty, too long, or holds characters other than letters,
    digits and ``. _ @ -`` (or does not start with a letter or digit)."""

    code = "token_name_invalid"
    id_fields = ("field", "value")

    def __init__(self, field: str, value: str) -> None:
        self.field = field
        self.value = value
        most = 64 if field == "tenant" else 100
        super().__init__(
            f"{field} {value!r} is not valid: 1 to {most} letters, digits and '. _ @ -', starting with a "
            "letter or digit"
        )


class TokenNameTaken(SagaError):
    """Raised when a token is created under the name of a live token."""

    code = "token_name_taken"
    id_fields = ("name", "token_id")

    def __init__(self, name: str, token_id: str) -> None:
        self.name = name
        self.token_id = token_id
        super().__init__(
            f"a live token is already named {name!r} (id {token_id}): choose another name, or revoke it "
            f"first ('saga tokens revoke {name}')"
        )


class TokenNotFound(SagaError):
    """Raised when no live token has the name given and no token (live or revoked) has it as id."""

    code = "token_not_found"
    id_fields = ("token",)

    def __init__(self, token: str) -> None:
        self.token = token
        super().__init__(
            f"no live token is named {token!r} and no token has that id: 'saga tokens list' shows them"
        )


@dataclass(frozen=True)
class TokenRecord:
    """What is known of a token, never its secret or its hash."""

    token_id: str
    name: str
    role: Role
    tenant: str
    created_at: int
    created_by: str
    revoked_at: int | None = None
    revoked_by: str | None = None

    @property
    def live(self) -> bool:
        return self.revoked_at is None

    def to_json(self) -> dict[str, Any]:
        return {
            "token_id": self.token_id,
            "name": self.name,
            "role": self.role.value,
            "tenant": self.tenant,
            "created_at": self.created_at,
            "created_by": self.created_by,
            "revoked_at": self.revoked_at,
            "revoked_by": self.revoked_by,
            "live": self.live,
        }


def check_name(field: str, value: str) -> str:
    """``value`` if it is a valid token name or tenant (a tenant as messages carry it: at most 64
    characters); raises :class:`TokenNameInvalid`."""
    if not _NAME.fullmatch(value) or (field == "tenant" and len(value) > MAX_TENANT_CHARS):
        raise TokenNameInvalid(field, value)
    return value


def hash_secret(secret: str) -> str:
    """The stored form of a secret. A plain SHA-256, not a slow password hash (bcrypt, scrypt, argon2):
    those exist to make guessing a low-entropy password from its hash expensive, but a secret here holds
    256 random bits, which no guessing reaches, and a slow hash would cost every API request milliseconds
    of CPU for nothing."""
    return hashlib.sha256(secret.encode()).hexdigest()


def token_id_of(secret: str) -> str | None:
    """The token id a secret names, or None for anything that is not shaped like a secret."""
    match = _SECRET.fullmatch(secret)
    return match.group(1) if match else None


class TokenStore:
    """Create, list, revoke and verify tokens. Every call reads Redis: a revocation holds from the next
    :meth:`verify` on, in every process, with no cache to outlive it."""

    def __init__(self, client: Any, prefix: str) -> None:
        self.client = client
        self.prefix = prefix

    async def now_ms(self) -> int:
        """Redis's clock, so the records of every process share one."""
        seconds, micros = await self.client.time()
        return int(seconds) * 1000 + int(micros) // 1000

    async def create(
        self, name: str, role: Role | str, tenant: str = "default", *, actor: str
    ) -> tuple[str, TokenRecord]:
        """A new live token: its secret (shown once: only its hash is stored) and its record. Raises
        :class:`TokenNameTaken` if a live token has ``name``, :class:`TokenNameInvalid` for a bad name
        or tenant, :class:`~orchestrator.auth.roles.RoleUnknown` for a bad role."""
        check_name("name", name)
        check_name("tenant", tenant)
        role = parse_role(str(role))
        for _ in range(MAX_ID_COLLISIONS):  # 48 bits of id: a collision is as good as impossible
            token_id = secrets.token_hex(TOKEN_ID_HEX // 2)
            secret = f"{SECRET_PREFIX}_{token_id}_{secrets.token_urlsafe(SECRET_BYTES)}"
            at = await self.now_ms()
            code, holder = await self.client.eval(
                _CREATE,
                4,
                token_key(self.prefix, token_id),
                names_key(self.prefix),
                ids_key(self.prefix),
                audit_key(self.prefix),
                token_id,
                name,
                role.value,
                tenant,
                hash_secret(secret),
                at,
                actor,
            )
            if int(code) == _NAME_TAKEN:
                raise TokenNameTaken(name, _str(holder))
            if int(code) == _CREATED:
                return secret, TokenRecord(token_id, name, role, tenant, at, actor)
        raise RuntimeError(f"{MAX_ID_COLLISIONS} random token ids in a row were taken")

    async def list(self) -> list[TokenRecord]:
        """Every token, live and revoked, oldest first."""
        ids = sorted(_str(i) for i in await self.client.smembers(ids_key(self.prefix)))
        if not ids:
            return []
        async with self.client.pipeline(transaction=False) as pipe:
            for token_id in ids:
                pipe.hmget(token_key(self.prefix, token_id), _RECORD_FIELDS)
            rows = await pipe.execute()
        records = [_record(i, row) for i, row in zip(ids, rows, strict=True)]
        return sorted((r for r in records if r is not None), key=lambda r: (r.created_at, r.token_id))

    async def get(self, name_or_id: str) -> TokenRecord:
        """The live token named ``name_or_id``, else the token with that id; raises
        :class:`TokenNotFound`."""
        record = await self._load(await self._resolve(name_or_id))
        if record is None:
            raise TokenNotFound(name_or_id)
        return record

    async def revoke(self, name_or_id: str, actor: str) -> tuple[TokenRecord, bool]:
        """Revoke the live token named ``name_or_id``, else the token with that id: from now on
        :meth:`verify` refuses its secret. Returns its record and whether this call revoked it (False:
        it already was). Raises :class:`TokenNotFound`."""
        token_id = await self._resolve(name_or_id)
        code = await self.client.eval(
            _REVOKE,
            3,
            token_key(self.prefix, token_id),
            names_key(self.prefix),
            audit_key(self.prefix),
            token_id,
            actor,
            await self.now_ms(),
        )
        record = await self._load(token_id)
        if int(code) == _NOT_FOUND or record is None:
            raise TokenNotFound(name_or_id)
        return record, int(code) == _REVOKED

    async def verify(self, secret: str) -> Identity | None:
        """The identity a live token's secret stands for; None for anything else (not a secret, an
        unknown token, a revoked one)."""
        token_id = token_id_of(secret)
        if token_id is None:
            return None
        stored, name, role, tenant, revoked_at = (
            _opt(v)
            for v in await self.client.hmget(
                token_key(self.prefix, token_id), ["hash", "name", "role", "tenant", "revoked_at"]
            )
        )
        # the id is looked up, not the secret, and the id is no secret (list shows it): what must not
        # leak through timing is how much of the hash matched, hence compare_digest
        if stored is None or not hmac.compare_digest(stored, hash_secret(secret)):
            return None
        if revoked_at is not None or name is None or role not in _ROLES:
            return None
        return Identity(name, Role(role), tenant or "default", token_id)

    async def audit(self) -> _Entries:
        """Every create and revoke, oldest first: action, actor, at (ms), token_id, name, role, tenant."""
        out = []
        for entry_id, fields in await self.client.xrange(audit_key(self.prefix)):
            entry: dict[str, Any] = {_str(k): _str(v) for k, v in fields.items()}
            entry["id"] = _str(entry_id)
            entry["at"] = int(entry["at"])
            out.append(entry)
        return out

    async def _load(self, token_id: str) -> TokenRecord | None:
        return _record(token_id, await self.client.hmget(token_key(self.prefix, token_id), _RECORD_FIELDS))

    async def _resolve(self, name_or_id: str) -> str:
        token_id = await self.client.hget(names_key(self.prefix), name_or_id)
        if token_id is not None:
            return _str(token_id)
        if _TOKEN_ID.fullmatch(name_or_id):
            return name_or_id
        raise TokenNotFound(name_or_id)


@contextlib.asynccontextmanager
async def opened(settings: Settings) -> AsyncIterator[TokenStore]:
    """A store on a Redis connection of its own, closed after."""
    client = redis_client(settings)
    try:
        yield TokenStore(client, settings.key_prefix)
    finally:
        await client.aclose()


def _record(token_id: str, row: list[Any]) -> TokenRecord | None:
    name, role, tenant, created_at, created_by, revoked_at, revoked_by = (_opt(v) for v in row)
    if name is None or role is None or created_at is None:
        return None
    return TokenRecord(
        token_id=token_id,
        name=name,
        role=parse_role(role),
        tenant=tenant or "default",
        created_at=int(created_at),
        created_by=created_by or "",
        revoked_at=int(revoked_at) if revoked_at is not None else None,
        revoked_by=revoked_by,
    )


def _opt(value: Any) -> str | None:
    return None if value is None else _str(value)


def _str(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)

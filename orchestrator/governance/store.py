"""Definition versions in Redis, every key under the ``{plans}`` hash tag (one slot, so one Lua call can
check and write them all):

- ``<prefix>:{plans}:def:<name>``: the definition's state (its versions and their lifecycle, the active
  version and the canary), JSON with a ``revision``; written only over the revision it was read at;
- ``<prefix>:{plans}:audit:<name>``: a stream, one entry per lifecycle change (who, when, from, to, why);
- ``<prefix>:{plans}:digests``: plan digest -> ``{definition, version, state}``, what a shard checks
  before it creates a run (one HMGET for a batch of starts);
- ``<prefix>:{plans}:definitions``: the set of definition names;
- ``<prefix>:{plans}:plan:<digest>``: the plan itself (immutable), written with the version that
  publishes it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from orchestrator.compiler import CompiledPlan
from orchestrator.errors import SagaError
from orchestrator.governance.lifecycle import (
    STARTABLE,
    Actor,
    Change,
    DefinitionNotFound,
    DefinitionState,
    State,
)
from orchestrator.store.keys import plan_key


def definition_key(prefix: str, name: str) -> str:
    return f"{prefix}:{{plans}}:def:{name}"


def audit_key(prefix: str, name: str) -> str:
    return f"{prefix}:{{plans}}:audit:{name}"


def digests_key(prefix: str) -> str:
    return f"{prefix}:{{plans}}:digests"


def names_key(prefix: str) -> str:
    return f"{prefix}:{{plans}}:definitions"


# KEYS: definition, audit, digests, names, plan. ARGV: state JSON, the revision it was computed from,
# {digest: JSON} to set, [[field, value, ...], ...] audit entries, the plan body ('' for none), the name.
_SAVE = """
local current = redis.call('GET', KEYS[1])
local revision = 0
if current then revision = cjson.decode(current).revision end
if revision ~= tonumber(ARGV[2]) then return {0, current or ''} end
if ARGV[5] ~= '' then redis.call('SET', KEYS[5], ARGV[5], 'NX') end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('SADD', KEYS[4], ARGV[6])
for digest, value in pairs(cjson.decode(ARGV[3])) do redis.call('HSET', KEYS[3], digest, value) end
for _, fields in ipairs(cjson.decode(ARGV[4])) do redis.call('XADD', KEYS[2], '*', unpack(fields)) end
return {1, ARGV[1]}
"""

MAX_CONFLICTS = 8


class DefinitionChanged(SagaError):
    """The definition kept changing under this command (another lifecycle command at the same time)."""

    code = "definition_changed"
    id_fields = ("definition",)

    def __init__(self, definition: str) -> None:
        self.definition = definition
        super().__init__(
            f"{definition} changed {MAX_CONFLICTS} times while this command tried to change it: nothing "
            "was changed; look at 'saga definitions list' and try again"
        )


@dataclass(frozen=True)
class DigestInfo:
    """What the shard needs to know of a plan digest before it creates a run from it."""

    definition: str
    version: str
    state: State

    @property
    def startable(self) -> bool:
        return self.state in STARTABLE


#: A verb: the state now, who acts, the versions that became active (oldest first) -> the change.
Verb = Callable[[DefinitionState, Actor, list[str]], Change]


class DefinitionStore:
    def __init__(self, client: Any, prefix: str) -> None:
        self.client = client
        self.prefix = prefix

    async def load(self, name: str) -> DefinitionState:
        raw = await self.client.get(definition_key(self.prefix, name))
        return parse_state(name, raw)

    async def names(self) -> list[str]:
        return sorted(_str(n) for n in await self.client.smembers(names_key(self.prefix)))

    async def require(self, name: str) -> DefinitionState:
        state = await self.load(name)
        if not state.versions:
            raise DefinitionNotFound(name, await self.names())
        return state

    async def audit(self, name: str) -> list[dict[str, Any]]:
        rows = await self.client.xrange(audit_key(self.prefix, name))
        out = []
        for entry_id, fields in rows:
            record: dict[str, Any] = {_str(k): _str(v) for k, v in fields.items()}
            record["id"] = _str(entry_id)
            record["at"] = int(record["at"])
            out.append(record)
        return out

    async def now_ms(self) -> int:
        """Redis's clock, so the audit of every process shares one."""
        seconds, micros = await self.client.time()
        return int(seconds) * 1000 + int(micros) // 1000

    async def change(
        self, name: str, verb: Verb, actor: str, reason: str, plan: CompiledPlan | None = None
    ) -> Change:
        """Apply ``verb`` to the stored state of ``name`` and store the result atomically, over the
        revision it was computed from (computed again if another change came first)."""
        for _ in range(MAX_CONFLICTS):
            state = await self.load(name)
            activations = [r["version"] for r in await self.audit(name) if r["to"] == State.ACTIVE.value]
            change = verb(state, Actor(actor, await self.now_ms(), reason), activations)
            if change.noop or await self._save(change, plan):
                return change
        raise DefinitionChanged(name)

    async def _save(self, change: Change, plan: CompiledPlan | None) -> bool:
        after = change.after
        stored = {**after.to_json(), "revision": change.before.revision + 1}
        digests = {
            digest: json.dumps({"definition": after.name, "version": version, "state": state})
            for digest, (version, state) in _moved(change).items()
        }
        body = (
            json.dumps({"plan": plan.plan, "versions": plan.versions}, sort_keys=True, separators=(",", ":"))
            if plan is not None
            else ""
        )
        audit = [_flat(r.to_fields()) for r in change.records]
        written, _ = await self.client.eval(
            _SAVE,
            5,
            definition_key(self.prefix, after.name),
            audit_key(self.prefix, after.name),
            digests_key(self.prefix),
            names_key(self.prefix),
            plan_key(self.prefix, plan.digest) if plan is not None else definition_key(self.prefix, ""),
            json.dumps(stored, sort_keys=True),
            change.before.revision,
            json.dumps(digests) if digests else "{}",
            json.dumps(audit),
            body,
            after.name,
        )
        return bool(int(written))


def parse_state(name: str, raw: Any) -> DefinitionState:
    if raw is None:
        return DefinitionState(name)
    return DefinitionState.from_json(json.loads(_str(raw)))


def parse_digest_info(raw: Any) -> DigestInfo | None:
    if raw is None:
        return None
    data = json.loads(_str(raw))
    return DigestInfo(data["definition"], data["version"], State(data["state"]))


def _moved(change: Change) -> Mapping[str, tuple[str, str]]:
    moved = {r.version for r in change.records}
    return {change.after.versions[v].digest: (v, change.after.versions[v].state.value) for v in sorted(moved)}


def _flat(fields: Mapping[str, str]) -> list[str]:
    return [item for pair in fields.items() for item in pair]


def _str(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)

"""Clients for services: start runs and wait for them.

``Client`` is async (aio-pika + redis.asyncio); ``SyncClient`` is blocking (pika + redis). Both publish a
signed start message to ``saga.start.<class>`` (consistent hash on the run id) with publisher confirms,
and read run state from Redis. The same idempotency key always gives the same run id, and the shard
creates a run only once, so a start sent twice (a retry after a timeout) starts one run.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import aio_pika
import pika
import pika.exceptions
from pika.adapters.blocking_connection import BlockingChannel
from redis.exceptions import ResponseError

from orchestrator.bus.connect import blocking_parameters, connect_robust, untracked_channel
from orchestrator.bus.envelope import Envelope, Signer, encode
from orchestrator.bus.publisher import PUBLISH_ATTEMPTS, Publisher
from orchestrator.engine.door import start_problems
from orchestrator.engine.model import TERMINAL_RUN_STATUSES, RunSnapshot, RunStatus
from orchestrator.engine.plan import Plan, typed_plan
from orchestrator.errors import SagaError
from orchestrator.governance.lifecycle import DefinitionNotFound, DefinitionState, VersionRecord, choose
from orchestrator.governance.store import definition_key, names_key, parse_state
from orchestrator.keys.reload import RingFollower, opened, signer_for, start_reloading, tenant_scope
from orchestrator.run_ends import CONFIRM_TIMEOUT_S, Ending, RunEnds, parse_ending
from orchestrator.sealing import Sealer, SealError
from orchestrator.settings import Settings, redis_client
from orchestrator.store import shardmap_store
from orchestrator.store.connect import REDIS_ERRORS, announces_run_ends, sync_client
from orchestrator.store.keys import REFUSED, ShardKeys, finished_channel, index_key, plan_key, refused_key
from orchestrator.store.keys import idempotency_key as claim_key
from orchestrator.store.spec import snapshot_from_record
from orchestrator.wire import bodies
from orchestrator.wire.bodies import DEFAULT_TENANT
from orchestrator.wire.kinds import Kind

log = logging.getLogger(__name__)
RUN_NAMESPACE = uuid.UUID("6f1d2c3e-5a4b-4c8d-9e7f-0a1b2c3d4e5f")
# How often a wait reads its run at most: the run's end is announced where Redis has pub/sub for the
# client, so its reads are only for an announcement lost with its subscription; elsewhere they are all
POLL_ANNOUNCED_S, POLL_UNANNOUNCED_S = 1.0, 0.1


class RunNotFound(SagaError):
    """Raised when a run id is not known (never started, or expired after its retention)."""

    code = "run_not_found"
    id_fields = ("run_id",)

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        super().__init__(f"run {run_id} not found; it never started or its record has expired")


class StartRefused(SagaError):
    """Raised when a start cannot be sent: its context does not fit the definition's context schema, or
    it (or a task it would cause) is too large for a message. Nothing was published."""

    code = "start_refused"
    id_fields = ("definition",)

    def __init__(self, definition: str, problems: list[str]) -> None:
        self.definition = definition
        self.problems = problems
        listed = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"start of {definition!r} refused; nothing was sent:\n{listed}")


class NoAnswer(SagaError):
    """Raised when no orchestrator recorded an answer to a request in time; the request still waits on
    the run's shard queue and will be handled once an orchestrator serves that shard."""

    code = "no_answer"
    id_fields = ("run_id", "request_id", "shard")

    def __init__(self, run_id: str, request_id: str, shard: str, timeout_s: float) -> None:
        self.run_id = run_id
        self.request_id = request_id
        self.shard = shard
        super().__init__(
            f"no answer to request {request_id} for run {run_id} within {timeout_s:g} s; it waits on "
            f"shard {shard}'s queue: is an orchestrator serving {shard}?"
        )


@dataclass(frozen=True)
class RequestAnswer:
    """What a run's shard did with an operator's request: ``applied`` (with the recorded detail, such
    as a re-drive's epoch) or refused with ``why``."""

    request_id: str
    applied: bool
    why: str = ""
    epoch: int | None = None


def answer_of(entry: Mapping[str, str], request_id: str) -> RequestAnswer | None:
    """The answer to ``request_id`` if this history entry records it."""
    detail = json.loads(entry.get("detail") or "{}")
    kind = entry.get("kind")
    if kind == "message.poisoned" and detail.get("message_id") == request_id:
        return RequestAnswer(request_id, False, f"its transition failed: {detail.get('error')}")
    if detail.get("request") != request_id:
        return None
    if kind == "callback.rejected":
        return RequestAnswer(request_id, False, str(detail.get("detail", "refused")))
    epoch = detail.get("epoch")
    return RequestAnswer(request_id, True, epoch=epoch if isinstance(epoch, int) else None)


class WaitTimeout(SagaError):
    """Raised when a run is still going when ``wait`` gives up; the run itself goes on."""

    code = "wait_timeout"
    id_fields = ("run_id", "state")
    exit_code = 3  # the CLI's "still running" (saga wait's, and every --wait's)

    def __init__(self, run_id: str, state: str, timeout_s: float) -> None:
        self.run_id = run_id
        self.state = state
        super().__init__(
            f"run {run_id} is still {state} after {timeout_s:g} s; it goes on: 'saga wait {run_id}' waits "
            f"again, 'saga status {run_id}' shows what it waits for"
        )


class ActivePlanMissing(SagaError):
    """Raised when a definition's active digest names a plan that is not in Redis."""

    code = "plan_not_found"
    id_fields = ("definition", "digest")

    def __init__(self, definition: str, digest: str) -> None:
        self.definition = definition
        self.digest = digest
        super().__init__(
            f"plan {digest} of {definition!r} is missing from Redis; publish the definition again"
        )


class ActivePlanUnknown(SagaError):
    """Raised when Redis cannot be read and this client never resolved the definition's active version."""

    code = "redis_unreachable"
    id_fields = ("definition",)

    def __init__(self, definition: str, exc: Exception) -> None:
        self.definition = definition
        super().__init__(
            f"cannot resolve the active version of {definition!r}: Redis is unreachable ({exc}) and this "
            "client has not resolved it before; check SAGA_REDIS_URL"
        )


class ShardRetired(SagaError):
    """A request for a run whose shard is retired: its queue is gone, and a retired shard held only
    finished runs. Nothing was sent."""

    code = "shard_retired"
    id_fields = ("run_id", "shard")

    def __init__(self, run_id: str, shard: str, request: str) -> None:
        self.run_id = run_id
        self.shard = shard
        super().__init__(
            f"run {run_id} belongs to shard {shard}, which is retired: no orchestrator serves it any more, "
            f"so the {request} was not sent; its record stays readable until its retention ends"
        )


class IdempotencyConflict(SagaError):
    """Raised when an idempotency key already started a run with another context: the key names that
    run, so this start would silently get it. Nothing was published."""

    code = "idempotency_conflict"
    id_fields = ("definition", "idempotency_key", "run_id", "claimed_digest", "context_digest")

    def __init__(
        self, definition: str, key: str, run_id: str, claimed_digest: str, context_digest: str
    ) -> None:
        self.definition = definition
        self.idempotency_key = key
        self.run_id = run_id
        self.claimed_digest = claimed_digest
        self.context_digest = context_digest
        super().__init__(
            f"idempotency key {key!r} of {definition!r} already started run {run_id} with another context "
            f"(its context {claimed_digest}, this one {context_digest}); nothing was sent: use a new key "
            "for a new context, or the same context to get the same run"
        )


class CancelRefused(SagaError):
    """Raised when a run asked to be cancelled has ended, or is already ending with an intent: a cancel
    would change nothing. Nothing was published."""

    code = "cancel_refused"
    id_fields = ("run_id", "state", "intent")

    def __init__(self, run_id: str, state: str, intent: str | None, reason: str | None) -> None:
        self.run_id = run_id
        self.state = state
        self.intent = intent
        why = f" ({reason})" if reason else ""
        if RunStatus(state) in TERMINAL_RUN_STATUSES:
            what = f"run {run_id} is {state}{why}: it has ended, so there is nothing to cancel"
        else:
            what = (
                f"run {run_id} is {state} with the {intent} intent{why}: it is already ending, and a "
                "cancel would change nothing"
            )
        super().__init__(f"{what}; nothing was sent")


class RedriveRefused(SagaError):
    """Raised when a run asked to be re-driven is not failed (only a failed run can be). Nothing was
    published; ``why`` is the reason without the run's id."""

    code = "redrive_refused"
    id_fields = ("run_id", "state")

    def __init__(self, run_id: str, state: str) -> None:
        self.run_id = run_id
        self.state = state
        self.why = f"only a failed run can be re-driven; run {run_id} is {state} (nothing was sent)"
        super().__init__(f"re-drive of {run_id} refused: {self.why}")


@dataclass(frozen=True)
class RunResult:
    run_id: str
    state: str
    output: Any = None
    reason: str | None = None

    @property
    def completed(self) -> bool:
        return self.state == RunStatus.COMPLETED.value


def run_id_for(definition: str, idempotency_key: str | None, tenant: str = DEFAULT_TENANT) -> str:
    """A new run's id: random, or for an idempotency key always the same one, within its tenant (one
    tenant's keys never meet another's runs; the default tenant's ids are those runs always had)."""
    if idempotency_key is None:
        return uuid.uuid4().hex
    namespace = RUN_NAMESPACE if tenant == DEFAULT_TENANT else uuid.uuid5(RUN_NAMESPACE, f"tenant:{tenant}")
    return uuid.uuid5(namespace, f"{definition}\x1f{idempotency_key}").hex


def start_envelope(
    signer: Signer,
    run_id: str,
    definition: str,
    digest: str,
    context: Mapping[str, Any],
    tenant: str = DEFAULT_TENANT,
    requested_by: str = "",
) -> Envelope:
    """A start, signed (by a client key: for its own tenant, whatever ``tenant`` says); ``requested_by``:
    who it is started for (a server's token), named in the run's history."""
    return signer.sign(
        Envelope(
            kind=Kind.START,
            message_id=f"start-{run_id}",
            run_id=run_id,
            digest=digest,
            tenant=tenant,
            issued_at_ms=int(time.time() * 1000),
            body=bodies.start(definition, digest, context, requested_by),
        )
    )


def status_document(record: Mapping[str, str]) -> dict[str, Any]:
    """The documented ``saga status --json`` shape, from a run's record."""
    snapshot = snapshot_from_record(record, {})
    return {
        "run_id": snapshot.run_id,
        "state": snapshot.status.value,
        "intent": snapshot.intent.value if snapshot.intent else None,
        "reason": snapshot.reason,
        "definition": record.get("definition"),
        "version": record.get("version"),
        "digest": snapshot.digest,
        "shard": snapshot.shard,
        "output": snapshot.output,
        "created_at": int(record["created_at"]) if "created_at" in record else None,
        "finished_at": int(record["finished_at"]) if "finished_at" in record else None,
        "stages": {
            name: {"state": rec.status.value, "attempt": rec.attempt}
            for name, rec in sorted(snapshot.stages.items())
        },
    }


def tenant_of(record: Mapping[str, str]) -> str:
    """The tenant a run (or a refused start) is of: runs before tenants were all ``default``'s."""
    return record.get("tenant") or DEFAULT_TENANT


def visible(record: Mapping[str, str], tenant: str | None) -> bool:
    """Whether a caller of ``tenant`` (None: every tenant) may see ``record``."""
    return tenant is None or tenant_of(record) == tenant


def refused_document(run_id: str, record: Mapping[str, str]) -> dict[str, Any]:
    """``saga status --json`` of a run id whose start the shard refused: the same keys, no run."""
    return {
        "run_id": run_id,
        "state": REFUSED,
        "intent": None,
        "reason": record.get("reason"),
        "definition": record.get("definition"),
        "version": record.get("version"),
        "digest": record.get("digest"),
        "shard": None,
        "output": None,
        "created_at": None,
        "finished_at": int(record["at"]) if "at" in record else None,
        "stages": {},
    }


def is_final(state: str) -> bool:
    return state == REFUSED or RunStatus(state) in TERMINAL_RUN_STATUSES


def _text(mapping: Mapping[Any, Any]) -> dict[str, str]:
    return {
        (k.decode() if isinstance(k, bytes) else str(k)): (v.decode() if isinstance(v, bytes) else str(v))
        for k, v in mapping.items()
    }


ACTIVE_PLAN_TTL_S = 2.0


@dataclass(frozen=True)
class ActivePlan:
    """What a start needs of a definition's active version: its digest, shard class and plan (whose
    context schema and inputs a start is checked against before it is sent)."""

    digest: str
    shard_class: str
    plan: Plan | None = field(default=None, compare=False)
    version: str = ""


class ActivePlans:
    """A short-lived cache of definition -> its versions and routing (which version is active, the
    canary), and a lasting one of plans by digest (immutable). It saves two Redis reads per start, and
    lets a service keep starting runs while Redis is briefly unreachable (the start message waits in the
    broker; the shard needs Redis only to create the run). An activation reaches new starts within
    ``ttl_s``."""

    def __init__(self, ttl_s: float = ACTIVE_PLAN_TTL_S) -> None:
        self.ttl_s = ttl_s
        self._entries: dict[str, tuple[float, DefinitionState]] = {}
        self.plans: dict[str, ActivePlan] = {}

    def fresh(self, definition: str, now: float) -> DefinitionState | None:
        entry = self._entries.get(definition)
        return entry[1] if entry and now - entry[0] < self.ttl_s else None

    def last_known(self, definition: str) -> DefinitionState | None:
        entry = self._entries.get(definition)
        return entry[1] if entry else None

    def put(self, definition: str, state: DefinitionState, now: float) -> DefinitionState:
        self._entries[definition] = (now, state)
        return state

    def pick(
        self, state: DefinitionState, run_id: str, version: str | None
    ) -> tuple[VersionRecord, ActivePlan | None]:
        """The version run ``run_id`` uses (raises NotStartable), and its plan if it was read before."""
        record = choose(state, run_id, version)
        return record, self.plans.get(record.digest)

    def remember(self, definition: str, record: VersionRecord, body: Any) -> ActivePlan:
        """The plan of ``record`` from its stored ``body``, kept for good (plans are immutable)."""
        plan = active_plan_from(definition, record.digest, body, version=record.version)
        self.plans[record.digest] = plan
        return plan


def state_from(definition: str, raw: Any, names: Iterable[str] = ()) -> DefinitionState:
    """The definition's stored state, or DefinitionNotFound (``names``: the published definitions, for a
    suggestion) when no version of it was ever published."""
    state = parse_state(definition, raw)
    if not state.versions:
        raise DefinitionNotFound(definition, names)
    return state


def active_plan_from(
    definition: str, digest: Any, raw_plan: Any, published: Iterable[str] = (), version: str = ""
) -> ActivePlan:
    """Interpret the two Redis reads (the chosen version's digest, its stored plan) or say what to do;
    ``published`` (the published definitions) is read only when ``digest`` is None, for a suggestion."""
    if digest is None:
        raise DefinitionNotFound(definition, published)
    text = digest.decode() if isinstance(digest, bytes) else str(digest)
    if raw_plan is None:
        raise ActivePlanMissing(definition, text)
    plan = json.loads(raw_plan)["plan"]
    return ActivePlan(text, str(plan["class"]), typed_plan(plan), version)


def checked_start(
    signer: Signer,
    settings: Settings,
    plan: ActivePlan,
    definition: str,
    run_id: str,
    context: Any,
    tenant: str = DEFAULT_TENANT,
    requested_by: str = "",
) -> Envelope:
    """The signed start, once it passed the checks the shard would make: a context that fits the
    definition, and a message (and tasks) that fit ``SAGA_MAX_MESSAGE_BYTES``. Raises StartRefused."""
    if not isinstance(context, Mapping):
        raise StartRefused(definition, [f"the context must be a JSON object, not {type(context).__name__}"])
    try:  # checked as the shard will read it: JSON (no NaN), a tuple as a list
        context = json.loads(json.dumps(context, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise StartRefused(definition, [f"the context: it is not valid JSON ({exc})"]) from exc
    limits = settings.limits()
    # the tasks will name the run, and a shard of the class that is not known yet: the longest one
    identity = RunSnapshot(run_id, f"{plan.shard_class}.99999", plan.digest, RunStatus.PENDING, context)
    problems = start_problems(plan.plan, plan.digest, context, limits, identity) if plan.plan else []
    if problems:
        raise StartRefused(definition, problems)
    envelope = start_envelope(signer, run_id, definition, plan.digest, context, tenant, requested_by)
    size = len(encode(envelope))
    if size > limits.max_message_bytes:
        raise StartRefused(
            definition,
            [
                f"the start message would be {size:,} bytes, over the {limits.max_message_bytes:,}-byte "
                "limit (SAGA_MAX_MESSAGE_BYTES); pass large data by reference"
            ],
        )
    return envelope


def unreachable_without_cache(definition: str, exc: Exception) -> SagaError:
    return ActivePlanUnknown(definition, exc)


def context_digest(context: Mapping[str, Any]) -> str:
    """The digest an idempotency key is claimed with: of the context's canonical JSON."""
    text = json.dumps(context, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return f"sha256:{hashlib.sha256(text.encode()).hexdigest()}"


def check_claim(envelope: Envelope, key: str, claimed: Any) -> None:
    """Raise :class:`IdempotencyConflict` unless ``claimed`` (what the key's claim held before this start:
    None if this start made it) is the digest of ``envelope``'s context."""
    if claimed is None:
        return
    held = claimed.decode() if isinstance(claimed, bytes) else str(claimed)
    digest = context_digest(envelope.body["context"])
    if held != digest:
        definition = str(envelope.body["definition"])
        raise IdempotencyConflict(definition, key, envelope.run_id, held, digest)


#: Give a claim back only if it still holds this start's digest (a start that could not be sent must not
#: block its key for the retention period; one made by another start stays).
UNCLAIM = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"


def published_names(names: Iterable[Any]) -> list[str]:
    """The published definitions, from the members of their names set."""
    return sorted(n.decode() if isinstance(n, bytes) else str(n) for n in names)


class Client:
    """Async client. Use ``async with Client(settings) as client:``."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.signer = signer_for(settings)
        self._stop_reloading: Callable[[], Awaitable[None]] | None = None
        self.redis = redis_client(settings)
        self._plans = ActivePlans()
        self._connection: aio_pika.abc.AbstractRobustConnection | None = None
        self._publisher: Publisher | None = None
        self._ends: RunEnds | None = None  # made by the first wait

    async def __aenter__(self) -> Client:
        self._connection = connection = await connect_robust(self.settings.amqp_url)
        try:
            first = await untracked_channel(connection)
        except BaseException:
            await connection.close()
            raise
        # the shared publisher: confirms, mandatory, a few retries of broker trouble, and a fresh channel
        # after a negative confirm (a quorum queue that lost its leader)
        self._publisher = Publisher(
            first, self.signer, self.settings.names(), renew_with=lambda: untracked_channel(connection)
        )
        self._stop_reloading = start_reloading(self.signer, self.settings, on_hangup=False)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._stop_reloading is not None:
            await self._stop_reloading()
        if self._ends is not None:
            await self._ends.close()
        if self._publisher is not None:
            await self._publisher.close()
        if self._connection is not None:
            await self._connection.close()
        await self.redis.aclose()

    async def _plan_of(self, definition: str, run_id: str, version: str | None = None) -> ActivePlan:
        """The plan a new run ``run_id`` of ``definition`` uses (``version``, or the active version or
        the canary by run id). Raises NotStartable for a version no run may be created from."""
        prefix = self.settings.key_prefix
        state = self._plans.fresh(definition, time.monotonic())
        if state is None:
            try:
                raw = await self.redis.get(definition_key(prefix, definition))
            except REDIS_ERRORS as exc:
                state = self._plans.last_known(definition)
                if state is None:
                    raise unreachable_without_cache(definition, exc) from exc
            else:
                if raw is None:
                    raise DefinitionNotFound(definition, await self._published())
                state = self._plans.put(definition, state_from(definition, raw), time.monotonic())
        record, plan = self._plans.pick(state, run_id, version)
        if plan is None:
            try:
                body = await self.redis.get(plan_key(prefix, record.digest))
            except REDIS_ERRORS as exc:
                raise unreachable_without_cache(definition, exc) from exc
            plan = self._plans.remember(definition, record, body)
        return plan

    async def _published(self) -> list[str]:
        """The published definitions (for a suggestion: none if Redis fails now)."""
        try:
            names = await self.redis.smembers(names_key(self.settings.key_prefix))  # type: ignore[misc]
            return published_names(names)
        except REDIS_ERRORS:
            return []

    async def _claim(self, envelope: Envelope, key: str | None) -> tuple[str, str] | None:
        """Claim an idempotency key with the context's digest before the start is sent (SET NX GET, with
        the run retention as TTL), so the key never quietly gives a run started with another context.
        With Redis unreachable the start goes on unchecked, as starts do then. Returns the claim this
        start made (key name, digest), to give back if the start cannot be sent."""
        if key is None:
            return None
        name = claim_key(self.settings.key_prefix, envelope.run_id)
        digest = context_digest(envelope.body["context"])
        try:
            held = await self.redis.set(name, digest, nx=True, px=self.settings.retention_ms, get=True)
        except REDIS_ERRORS:
            return None
        check_claim(envelope, key, held)
        return (name, digest) if held is None else None

    async def _unclaim(self, claim: tuple[str, str] | None) -> None:
        if claim is not None:
            with contextlib.suppress(*REDIS_ERRORS):  # then it blocks the key until it expires
                await self.redis.eval(UNCLAIM, 1, *claim)  # type: ignore[misc]

    async def start(
        self,
        definition: str,
        context: Mapping[str, Any],
        idempotency_key: str | None = None,
        version: str | None = None,
        tenant: str | None = None,
        requested_by: str = "",
    ) -> str:
        """Start a run of ``definition``: of ``version`` (any approved, not retired one) or, without it,
        of the active version (or the canary, for the canary's share of run ids); returns its run id at
        once. The run is ``tenant``'s (the control-plane server's callers'), else this client's key's
        (a client key's tenant always wins), else ``default``. Raises, before sending anything:
        StartRefused for a context the definition refuses or a start too large to be sent,
        DefinitionNotFound for a definition never published, NotStartable for a version no run may be
        created from (the message lists those that may), and IdempotencyConflict when
        ``idempotency_key`` already started a run with another context."""
        owner = self.signer.bound_tenant() or tenant or DEFAULT_TENANT  # a client key's tenant always wins
        run_id = run_id_for(definition, idempotency_key, owner)
        plan = await self._plan_of(definition, run_id, version)
        envelope = checked_start(
            self.signer, self.settings, plan, definition, run_id, context, owner, requested_by
        )
        claim = await self._claim(envelope, idempotency_key)
        try:
            await self._publish(envelope, self.settings.names().start_exchange(plan.shard_class), run_id)
        except BaseException:
            await self._unclaim(claim)
            raise
        return run_id

    async def _publish(self, envelope: Envelope, exchange_name: str, routing_key: str) -> None:
        """Publish with a confirm and ``mandatory``: returns once the broker has it, raises if it cannot
        be routed."""
        if self._publisher is None:
            raise SagaError("the client is not connected; use 'async with Client(settings) as client'")
        await self._publisher.publish_envelope(envelope, exchange_name, routing_key)

    async def cancel(
        self, run_id: str, reason: str = "", requested_by: str = "", tenant: str | None = None
    ) -> str:
        """Ask the run's shard to cancel the run: a failed intent with reason ``cancelled``, its active
        stages asked to stop, then its compensations and finalisers. Raises CancelRefused, sending
        nothing, for a run that has ended or already has an intent (one that gets it meanwhile is left as
        it is: the request is recorded as late in its history). Returns the request's id once the broker
        has it. A run of another tenant than ``tenant`` (else this client's key's) is not found."""
        document = await self._document(run_id, tenant)
        if document is not None and (
            document["intent"] is not None or RunStatus(document["state"]) in TERMINAL_RUN_STATUSES
        ):
            raise CancelRefused(run_id, document["state"], document["intent"], document["reason"])
        return await self._request(Kind.CANCEL_RUN, run_id, reason, requested_by, tenant)

    async def redrive(
        self,
        run_id: str,
        reason: str = "",
        requested_by: str = "",
        *,
        undo_lost: bool = False,
        tenant: str | None = None,
    ) -> str:
        """Ask the run's shard to resume a failed run in a new epoch, on its pinned plan: completed
        stages keep their results, failed, cancelled, timed-out and compensated ones run again. A run
        that is not failed raises RedriveRefused, nothing sent. One whose start would not pass the door
        (a context its definition refuses, a task too large), or that a poison message failed with an
        undo in flight (unless ``undo_lost``: that undo will never report), is left as it is (the
        refusal is recorded in its history). Returns the request's id once the broker has it;
        :meth:`answer` tells what became of it. A run of another tenant than ``tenant`` (else this
        client's key's) is not found."""
        document = await self._document(run_id, tenant)
        state = document["state"] if document is not None else RunStatus.PENDING.value
        if state != RunStatus.FAILED.value:
            raise RedriveRefused(run_id, state)
        return await self._request(Kind.REDRIVE, run_id, reason, requested_by, tenant, undo_lost=undo_lost)

    async def _request(
        self, kind: Kind, run_id: str, reason: str, requested_by: str, tenant: str | None, **extra: bool
    ) -> str:
        shard = await self.redis.get(index_key(self.settings.key_prefix, run_id))
        if shard is None:
            raise RunNotFound(run_id)
        shard_map = await shardmap_store.load(self.redis, self.settings.key_prefix)
        if shard_map is not None and str(shard) not in shard_map.served:
            raise ShardRetired(run_id, str(shard), kind.value)
        # the run's tenant: a caller scoped to a tenant acts only on a run it can see is that tenant's (not
        # on one not created yet); an operator acts for any (a client's key signs its own tenant in, and
        # the shard refuses a request for another tenant's run)
        run_key = ShardKeys(self.settings.key_prefix, str(shard)).run(run_id)
        owner = await self.redis.hget(run_key, "tenant")  # type: ignore[misc]
        scope = tenant or tenant_scope(self.signer, self.settings)
        if scope is not None and (owner or DEFAULT_TENANT) != scope:
            raise RunNotFound(run_id)
        if scope is not None and not await self.redis.exists(run_key):
            raise RunNotFound(run_id)
        envelope = self.signer.sign(
            Envelope(
                kind=kind,
                message_id=f"{kind.value}-{uuid.uuid4().hex}",  # each request is its own
                run_id=run_id,
                shard=str(shard),
                tenant=str(scope or owner or DEFAULT_TENANT),
                issued_at_ms=int(time.time() * 1000),
                body=bodies.request(reason, requested_by, **extra),
            )
        )
        await self._publish(envelope, self.settings.names().runs_exchange, str(shard))
        return envelope.message_id

    async def answer(self, run_id: str, request_id: str, timeout_s: float = 30.0) -> RequestAnswer:
        """What the run's shard did with request ``request_id`` (from :meth:`redrive`), read from the
        run's history: applied (``run.redriven``), refused with the reason, or poisoned. Raises
        NoAnswer if nothing is recorded within ``timeout_s`` (the request still waits in the queue)."""
        shard = await self.redis.get(index_key(self.settings.key_prefix, run_id))
        if shard is None:
            raise RunNotFound(run_id)
        stream = ShardKeys(self.settings.key_prefix, str(shard)).history(run_id)
        deadline = time.monotonic() + timeout_s
        after, poll_s = "-", 0.01
        while time.monotonic() < deadline:
            rows = await self.redis.xrange(stream, min=after)
            for entry_id, fields in rows:
                after = f"({entry_id.decode() if isinstance(entry_id, bytes) else entry_id}"
                found = answer_of(_text(fields), request_id)
                if found is not None:
                    return found
            await asyncio.sleep(poll_s)
            poll_s = min(poll_s * 1.5, 0.2)
        raise NoAnswer(run_id, request_id, str(shard), timeout_s)

    async def status(self, run_id: str, tenant: str | None = None) -> dict[str, Any]:
        document = await self._document(run_id, tenant)
        if document is None:
            raise RunNotFound(run_id)
        return document

    async def _document(self, run_id: str, tenant: str | None = None) -> dict[str, Any] | None:
        """The run's status document; None while its id is claimed and the run not created yet. Raises
        RunNotFound for an id nobody claimed, and for a run of another tenant than ``tenant`` (else
        this client's key's; None: any) whose existence is not this caller's to know."""
        prefix = self.settings.key_prefix
        scope = tenant or tenant_scope(self.signer, self.settings)
        shard = await self.redis.get(index_key(prefix, run_id))
        record = await self.redis.hgetall(ShardKeys(prefix, str(shard)).run(run_id)) if shard else {}  # type: ignore[misc]
        if record:
            if not visible(_text(record), scope):
                raise RunNotFound(run_id)
            return status_document(opened(_text(record), Sealer(lambda: self.signer.ring)))
        refused = await self.redis.hgetall(refused_key(prefix, run_id))  # type: ignore[misc]
        if refused:
            if not visible(_text(refused), scope):
                raise RunNotFound(run_id)
            return refused_document(run_id, _text(refused))
        if shard is None:
            raise RunNotFound(run_id)
        return None

    async def wait(self, run_id: str, timeout_s: float = 60.0, poll_s: float = 0.01) -> RunResult:
        """Wait until the run is completed or failed (finalisers included), or its start was refused; a
        run of another tenant than this client's key's is not found (RunNotFound), however it ended."""
        result = await self._wait(run_id, timeout_s, poll_s)
        if tenant_scope(self.signer, self.settings) is not None:
            await self._document(run_id)  # raises RunNotFound for another tenant's run
        return _opened_result(result, self.signer)

    async def _wait(self, run_id: str, timeout_s: float, poll_s: float) -> RunResult:
        """Wait until the run is completed or failed (finalisers included), or its start was refused.
        The run's end is announced (``run_ends.py``), so this returns as soon as it comes; the run is
        also read every ``poll_s``, growing to 1 s (0.1 s where nothing is announced: a Redis Cluster),
        for an announcement lost with its subscription."""
        deadline = time.monotonic() + timeout_s
        state = "pending"
        ends = self._run_ends()
        async with ends.watching(run_id) as watch:
            while True:
                ending, watch.ending = watch.ending, None
                watch.ended.clear()
                if (announced := _ended(run_id, None, ending)) is not None:  # no need to read the run
                    return announced
                try:
                    document = await self.status(run_id)
                except RunNotFound:
                    document = None  # not created yet: the start is still in flight
                if (read := _ended(run_id, document, None)) is not None:
                    return read
                state = document["state"] if document is not None else state
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WaitTimeout(run_id, state, timeout_s)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(poll_s, left)):
                        await watch.ended.wait()
                # announcements can stop meanwhile (a subscription refused): then it reads as often as
                # where nothing is announced
                poll_s = _next_poll(poll_s, ends.announced)

    def _run_ends(self) -> RunEnds:
        if self._ends is None:
            self._ends = RunEnds(self.redis, self.settings.key_prefix)
        return self._ends


def _opened_result(result: RunResult, signer: Signer) -> RunResult:
    """``result`` with its output's values sealed at rest opened, where this client holds the data key
    (SAGA_ENCRYPT_SENSITIVE); else as it is."""
    if result.output is None or signer.ring.data_secret() is None:
        return result
    try:
        return dataclasses.replace(
            result, output=Sealer(lambda: signer.ring).unseal(result.output, result.run_id)
        )
    except SealError:
        return result


def _ended(run_id: str, document: Mapping[str, Any] | None, ending: Ending | None) -> RunResult | None:
    """What a wait returns once the run has ended, as its end was announced or as a read found it; None
    while it goes on."""
    if ending is not None:
        return RunResult(run_id, ending.state, ending.output, ending.reason)
    if document is not None and is_final(document["state"]):
        return RunResult(run_id, document["state"], document["output"], document["reason"])
    return None


def _next_poll(poll_s: float, announced: bool) -> float:
    """A wait's next interval between reads of its run: growing, to a second where the run's end is
    announced to it (the reads only stand in for a lost announcement), a tenth of one where it is not."""
    return min(poll_s * 1.5, POLL_ANNOUNCED_S if announced else POLL_UNANNOUNCED_S)


def _next_of(pubsub: Any, kind: str, seconds: float) -> dict[str, Any] | None:
    """The next message of ``kind`` on ``pubsub`` (a subscription's confirmation, an announcement),
    blocking until it comes or for ``seconds``."""
    until = time.monotonic() + seconds
    while (left := until - time.monotonic()) > 0:
        message = pubsub.get_message(timeout=left)
        if message is not None and message.get("type") == kind:
            return cast(dict[str, Any], message)
    return None


class SyncClient:
    """Blocking client on pika, for scripts and services without an event loop."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.signer = signer_for(settings)
        self._ring = RingFollower(self.signer, settings)  # no event loop: checked before each signing
        self.redis = sync_client(settings.redis_url, decode_responses=True)
        self._plans = ActivePlans()
        self._connection = pika.BlockingConnection(blocking_parameters(settings.amqp_url))
        self._channel = self._confirming_channel()

    def _confirming_channel(self) -> BlockingChannel:
        channel = self._connection.channel()
        channel.confirm_delivery()  # basic_publish now raises on nack or (mandatory) return
        return channel

    def _publish(self, exchange: str, routing_key: str, envelope: Envelope) -> None:
        """Publish with a confirm and ``mandatory``. A negative confirm gets a fresh channel and another
        try, as :meth:`Publisher._renew` explains; an unroutable message raises at once."""
        for attempt in range(1, PUBLISH_ATTEMPTS + 1):
            try:
                self._channel.basic_publish(
                    exchange,
                    routing_key,
                    encode(envelope),
                    pika.BasicProperties(message_id=envelope.message_id, delivery_mode=2),
                    mandatory=True,
                )
                return
            except pika.exceptions.NackError:
                if attempt == PUBLISH_ATTEMPTS:
                    raise
                stale, self._channel = self._channel, self._confirming_channel()
                with contextlib.suppress(pika.exceptions.AMQPError):
                    stale.close()
                time.sleep(0.2 * attempt)  # a quorum queue electing a leader takes a moment

    def close(self) -> None:
        if self._connection.is_open:
            self._connection.close()
        self.redis.close()

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(
        self,
        definition: str,
        context: Mapping[str, Any],
        idempotency_key: str | None = None,
        version: str | None = None,
    ) -> str:
        """As :meth:`Client.start`, blocking."""
        self._ring.check()
        owner = self.signer.bound_tenant() or DEFAULT_TENANT
        run_id = run_id_for(definition, idempotency_key, owner)
        plan = self._plan_of(definition, run_id, version)
        envelope = checked_start(self.signer, self.settings, plan, definition, run_id, context, owner)
        claim = self._claim(envelope, idempotency_key)
        try:
            self._publish(self.settings.names().start_exchange(plan.shard_class), run_id, envelope)
        except BaseException:
            if claim is not None:
                with contextlib.suppress(*REDIS_ERRORS):
                    self.redis.eval(UNCLAIM, 1, *claim)
            raise
        return run_id

    def _claim(self, envelope: Envelope, key: str | None) -> tuple[str, str] | None:
        """As :meth:`Client._claim`, blocking."""
        if key is None:
            return None
        name = claim_key(self.settings.key_prefix, envelope.run_id)
        digest = context_digest(envelope.body["context"])
        try:
            held = self.redis.set(name, digest, nx=True, px=self.settings.retention_ms, get=True)
        except REDIS_ERRORS:
            return None
        check_claim(envelope, key, held)
        return (name, digest) if held is None else None

    def _plan_of(self, definition: str, run_id: str, version: str | None = None) -> ActivePlan:
        """As :meth:`Client._plan_of`, blocking."""
        prefix = self.settings.key_prefix
        state = self._plans.fresh(definition, time.monotonic())
        if state is None:
            try:
                raw = self.redis.get(definition_key(prefix, definition))
            except REDIS_ERRORS as exc:
                state = self._plans.last_known(definition)
                if state is None:
                    raise unreachable_without_cache(definition, exc) from exc
            else:
                if raw is None:
                    try:
                        names = published_names(self.redis.smembers(names_key(prefix)))  # type: ignore[arg-type]
                    except REDIS_ERRORS:
                        names = []
                    raise DefinitionNotFound(definition, names)
                state = self._plans.put(definition, state_from(definition, raw), time.monotonic())
        record, plan = self._plans.pick(state, run_id, version)
        if plan is None:
            try:
                body = self.redis.get(plan_key(prefix, record.digest))
            except REDIS_ERRORS as exc:
                raise unreachable_without_cache(definition, exc) from exc
            plan = self._plans.remember(definition, record, body)
        return plan

    def status(self, run_id: str) -> dict[str, Any]:
        """As :meth:`Client.status`, blocking (for this client's key's tenant)."""
        prefix = self.settings.key_prefix
        scope = tenant_scope(self.signer, self.settings)
        shard = self.redis.get(index_key(prefix, run_id))
        record = self.redis.hgetall(ShardKeys(prefix, str(shard)).run(run_id)) if shard else {}
        if record and visible(_text(record), scope):  # type: ignore[arg-type]
            return status_document(opened(_text(record), Sealer(lambda: self.signer.ring)))  # type: ignore[arg-type]
        refused = self.redis.hgetall(refused_key(prefix, run_id))
        if refused and not record and visible(_text(refused), scope):  # type: ignore[arg-type]
            return refused_document(run_id, _text(refused))  # type: ignore[arg-type]
        raise RunNotFound(run_id)

    def wait(self, run_id: str, timeout_s: float = 60.0, poll_s: float = 0.01) -> RunResult:
        """:meth:`Client.wait`, blocking (a run of another tenant than this client's key's is not found)."""
        result = self._wait(run_id, timeout_s, poll_s)
        if tenant_scope(self.signer, self.settings) is not None:
            self.status(run_id)  # raises RunNotFound for another tenant's run
        return _opened_result(result, self.signer)

    def _wait(self, run_id: str, timeout_s: float, poll_s: float) -> RunResult:
        """:meth:`Client.wait`, blocking: subscribed to the run's end (on a connection of its own) before
        it first reads the run, and reading it again at least every ``poll_s`` (growing to 1 s; 0.1 s
        where nothing is announced)."""
        deadline = time.monotonic() + timeout_s
        state = "pending"
        with contextlib.ExitStack() as stack:
            pubsub = None
            if announces_run_ends(self.redis):
                pubsub = stack.enter_context(self.redis.pubsub())  # type: ignore[no-untyped-call]
                try:
                    pubsub.subscribe(finished_channel(self.settings.key_prefix, run_id))
                    _next_of(pubsub, "subscribe", CONFIRM_TIMEOUT_S)  # before the first read of the run
                except ResponseError as exc:  # refused (a user without channel rights): read the run
                    log.warning("could not subscribe to the end of run %s (%s); reading it", run_id, exc)
                    pubsub = None
            ending: Ending | None = None
            while True:
                if (announced_end := _ended(run_id, None, ending)) is not None:  # no need to read the run
                    return announced_end
                try:
                    document: dict[str, Any] | None = self.status(run_id)
                except RunNotFound:
                    document = None
                if (read := _ended(run_id, document, None)) is not None:
                    return read
                state = document["state"] if document is not None else state
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WaitTimeout(run_id, state, timeout_s)
                if pubsub is None:
                    time.sleep(min(poll_s, left))
                else:
                    message = _next_of(pubsub, "message", min(poll_s, left))
                    ending = parse_ending(message.get("data")) if message is not None else None
                poll_s = _next_poll(poll_s, pubsub is not None)

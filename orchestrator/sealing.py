"""Sensitive values sealed at rest (``SAGA_ENCRYPT_SENSITIVE``): what a run keeps in Redis of a value its
schemas mark sensitive (``orchestrator/redaction.py``) is encrypted, and only the processes holding the
key ring's ``data`` key read it back.

A sealed value is a JSON string, ``$saga-sealed:v1:<key id>:<base64 of nonce and ciphertext>``: the
AES-256-GCM encryption of the value's JSON under a key derived from the ``data`` key, the key id bound as
associated data. It takes the value's place wherever the value is written: the run's context, its
results, its output, a map item's result, an outbox entry's body. The orchestrator seals a transition's
writes after the engine decided (the engine always sees values as they are) and unseals what it reads
back (records, a bag's results, an outbox entry it re-publishes: workers get the real value); views and
clients holding the key unseal before they show (and then mark, as any sensitive value).

Which values: those at places the run's plan marks sensitive (its context schema, its contracts' output
and input schemas), then every equal scalar anywhere in what is written, so that a value copied by a
binding (a task's input, the run's output) is sealed too. A value sealed where it was not sensitive reads
back as it was written: sealing never changes what a run computes.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from orchestrator.engine.model import RUN, Decision, RunSnapshot, Write
from orchestrator.engine.plan import Bag, Plan
from orchestrator.errors import SagaError
from orchestrator.keys.ring import KeyState, Ring, Scope
from orchestrator.redaction import marks_any, sensitive_values
from orchestrator.wire.outgoing import Outgoing

PREFIX = "$saga-sealed:v1:"
_NONCE_BYTES = 12
_JSON_FIELDS = ("context", "output", "result")  # of a run's or a stage's record: JSON texts that hold values


class SealError(SagaError):
    """A value cannot be sealed or unsealed: no ``data`` key, or not the one it was sealed with."""

    code = "sealing_failed"


def _derived(secret: bytes) -> bytes:
    return hashlib.sha256(b"saga-sealing-v1\x00" + secret).digest()


@dataclass(frozen=True)
class Sealer:
    """Seals with the active ``data`` key of ``ring()`` and unseals with any ``data`` key it holds (a ring
    is read at each call: it may have been reloaded)."""

    ring: Callable[[], Ring]

    def _key(self, key_id: str | None = None) -> tuple[str, AESGCM]:
        ring = self.ring()
        for key in ring.keys:
            if key.scope is not Scope.DATA or key.secret is None:
                continue
            if (key_id is None and key.state is KeyState.ACTIVE) or key.key_id == key_id:
                return key.key_id, AESGCM(_derived(key.secret))
        wanted = f"data key {key_id!r}" if key_id else "an active data key"
        raise SealError(
            f"{wanted} is not in this process's key ring: sensitive values sealed at rest "
            "(SAGA_ENCRYPT_SENSITIVE) need it; add it ('saga keys add ID --scope data --activate') and give "
            "this process its secret"
        )

    def has_keys(self) -> bool:
        """Whether this process holds any ``data`` key (else nothing sealed can be opened here)."""
        return any(k.scope is Scope.DATA and k.secret is not None for k in self.ring().keys)

    def check(self) -> None:
        """Raise SealError unless this process can seal (for a start-up check)."""
        self._key()

    def seal(self, value: Any, run_id: str) -> str:
        """``value`` sealed for run ``run_id`` (bound in: it opens for that run only)."""
        key_id, cipher = self._key()
        nonce = os.urandom(_NONCE_BYTES)
        sealed = cipher.encrypt(nonce, json.dumps(value).encode(), _bound(key_id, run_id))
        return f"{PREFIX}{key_id}:{base64.b64encode(nonce + sealed).decode()}"

    def open(self, text: str, run_id: str) -> Any:
        """The value ``text`` sealed for run ``run_id``; raises SealError for one sealed under a key this
        process lacks, for another run (copied), or altered."""
        key_id, _, encoded = text[len(PREFIX) :].partition(":")
        _, cipher = self._key(key_id)
        try:
            raw = base64.b64decode(encoded, validate=True)
            plain = cipher.decrypt(raw[:_NONCE_BYTES], raw[_NONCE_BYTES:], _bound(key_id, run_id))
            return json.loads(plain)
        except (InvalidTag, ValueError) as exc:
            raise SealError(
                f"a value of run {run_id} sealed under data key {key_id!r} does not open: it was sealed for "
                "another run, or altered"
            ) from exc

    def seal_equal(self, document: Any, secrets: frozenset[str], run_id: str) -> Any:
        """``document`` with every scalar equal to one of ``secrets`` sealed for ``run_id``."""
        if isinstance(document, Mapping):
            return {k: self.seal_equal(v, secrets, run_id) for k, v in document.items()}
        if isinstance(document, list):
            return [self.seal_equal(v, secrets, run_id) for v in document]
        if document is None or isinstance(document, bool):
            return document
        if _text(document) in secrets:
            return self.seal(document, run_id)
        return document

    def unseal(self, document: Any, run_id: str) -> Any:
        """``document`` with every value sealed for ``run_id`` opened."""
        if isinstance(document, Mapping):
            return {k: self.unseal(v, run_id) for k, v in document.items()}
        if isinstance(document, list):
            return [self.unseal(v, run_id) for v in document]
        if isinstance(document, str) and document.startswith(PREFIX):
            return self.open(document, run_id)
        return document

    def seal_text(self, text: str, secrets: frozenset[str], run_id: str) -> str:
        """A JSON text with ``secrets`` sealed (parsed whatever it looks like: a value may be escaped)."""
        return json.dumps(self.seal_equal(json.loads(text), secrets, run_id), separators=(",", ":"))

    def unseal_text(self, text: str, run_id: str) -> str:
        if PREFIX not in text:
            return text
        try:
            parsed = json.loads(text)
        except ValueError as exc:
            raise SealError(f"a field of run {run_id} holding a sealed value is not JSON") from exc
        return json.dumps(self.unseal(parsed, run_id), separators=(",", ":"))

    def unseal_record(self, record: Mapping[str, str], run_id: str) -> dict[str, str]:
        """A run's record (its hash) with the values sealed in its JSON fields (context, output, each
        stage's result) opened; free text is never opened."""
        return {
            field: self.unseal_text(value, run_id) if _holds_values(field) and PREFIX in value else value
            for field, value in record.items()
        }

    def sealed(self, plan: Plan, snapshot: RunSnapshot | None, decision: Decision, run_id: str) -> Decision:
        """``decision`` as it is written to Redis: its sensitive values sealed for ``run_id``."""
        secrets = decision_secrets(plan, snapshot, decision)
        if not secrets:
            return decision
        writes = tuple(self._write(w, secrets, run_id) for w in decision.writes)
        arrival = decision.arrival
        if arrival is not None and arrival.result is not None:
            arrival = replace(arrival, result=self.seal_text(arrival.result, secrets, run_id))
        outgoing = tuple(self._message(m, secrets, run_id) for m in decision.outgoing)
        return replace(decision, writes=writes, arrival=arrival, outgoing=outgoing)

    def _write(self, write: Write, secrets: frozenset[str], run_id: str) -> Write:
        fields = {
            name: self.seal_text(value, secrets, run_id) if name in _JSON_FIELDS else value
            for name, value in write.fields.items()
        }
        return replace(write, fields=fields)

    def _message(self, message: Outgoing, secrets: frozenset[str], run_id: str) -> Outgoing:
        body = self.seal_equal(message.body, secrets, run_id)
        return message if body == message.body else replace(message, body=body)


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _bound(key_id: str, run_id: str) -> bytes:
    """What a sealed value is bound to: its key, and its run (a value copied into another run's fields
    does not open there)."""
    return f"{key_id}\x00{run_id}".encode()


def _holds_values(field: str) -> bool:
    """Whether a run record's field is JSON that may hold a run's values (never free text)."""
    return field in ("context", "output") or (field.startswith("s:") and field.endswith(":result"))


def plan_marks(plan: Plan) -> bool:
    """Whether ``plan`` marks anything sensitive (else nothing of its runs is ever sealed)."""
    schemas = [plan.context] + [s for c in plan.contracts.values() for s in (c.input_schema, c.output_schema)]
    return any(marks_any(s) for s in schemas if s is not None)


def decision_secrets(plan: Plan, snapshot: RunSnapshot | None, decision: Decision) -> frozenset[str]:
    """The sensitive values of a run as this transition leaves it: in its context, its results (those it
    had, those the transition writes, a map item's), and the inputs of the tasks it sends."""
    context = snapshot.context if snapshot is not None else _written(decision, "context")
    found = sensitive_values(context, plan.context)
    results: dict[str, Any] = {}
    if snapshot is not None:
        results = {name: rec.result for name, rec in snapshot.stages.items() if rec.result is not None}
    for write in decision.writes:
        if write.key.kind == "stage" and "result" in write.fields:
            results[write.key.name] = json.loads(write.fields["result"])
    for name, result in results.items():
        found += _result_values(plan, name, result)
    arrival = decision.arrival
    if arrival is not None and arrival.result is not None:
        found += _result_values(plan, arrival.key.name, [json.loads(arrival.result)])
    for message in decision.outgoing:
        contract = plan.contracts.get(str(message.body.get("contract", "")))
        if contract is not None and "input" in message.body:
            found += sensitive_values(message.body["input"], contract.input_schema)
    return frozenset(t for v in found if (t := _text(v)))  # an empty text would seal every empty string


def _written(decision: Decision, field: str) -> Any:
    for write in decision.writes:
        if write.key == RUN and field in write.fields:
            return json.loads(write.fields[field])
    return None


def _result_values(plan: Plan, stage: str, result: Any) -> list[Any]:
    work = plan.work(stage)
    contract = plan.contracts.get(work.contract) if work is not None else None
    if contract is None or not marks_any(contract.output_schema):
        return []
    items = result if isinstance(work, Bag) and isinstance(result, list) else [result]
    return [v for item in items for v in sensitive_values(item, contract.output_schema)]

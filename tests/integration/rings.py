"""Key rings for the tests that run a stack on scoped keys: each key active, its secret in a file of its
own beside the ring file."""

from __future__ import annotations

from pathlib import Path

from orchestrator.keys.ring import KeyState, Scope
from orchestrator.keys.ringfile import KeyEntry, RingFile, write_ring_file, write_secret_file


def active(key_id: str, scope: Scope, **more: object) -> KeyEntry:
    """An active key whose secret is ``<key_id>.key`` beside the ring file (``more``: other fields)."""
    fields: dict[str, object] = {"id": key_id, "scope": scope, "state": KeyState.ACTIVE}
    return KeyEntry.model_validate({**fields, "secret_file": f"{key_id}.key", **more})


def write_ring(path: Path, entries: list[KeyEntry]) -> Path:
    """The ring file at ``path`` with ``entries``, and a new secret for each key that has a file."""
    for entry in entries:
        if entry.secret_file:
            write_secret_file(path.parent / entry.secret_file)
    write_ring_file(path, RingFile(keys=entries))
    return path

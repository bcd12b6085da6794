"""Where a message's time goes: timestamps of its hops and of each processing step, for the bench's
latency breakdown (``bench/latency.py``).

Off unless ``SAGA_TRACE_DIR`` (the ``trace_dir`` setting) names a folder: then each process appends one
JSON object a line to a file of its own there (``<role>-<pid>.jsonl``), so no two processes ever write
the same file. Three shapes:

- an event: ``{"e": "sent" | "confirmed" | "received", "t": ns, "m": message id, ...}``: a message
  handed to the broker, confirmed by it, or delivered to a consumer;
- what a decoded message is: ``{"e": "decoded", "t": ns, "m": id, "k": kind, "r": run, "st": stage}``;
- a span: ``{"s": step, "t0": ns, "t1": ns, "ms": [message ids]}``: one processing step of the messages
  of a batch (decode and verify, snapshot read, engine, Lua call, publish and confirm, mark-sent, ack...).

Times are ``time.time_ns()``, the one clock every process on a machine shares, so a hop is the
receiver's ``received`` minus the sender's ``sent``. Off, every call site costs one attribute test.
Lines are buffered and written at most every 64 KiB or on :func:`flush` (at exit too).
"""

from __future__ import annotations

import atexit
import json
import os
import time
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from orchestrator.bus.envelope import Envelope


_UNTIMED: AbstractContextManager[None] = nullcontext()  # reentrant and stateless: one serves every span


class Tracer:
    def __init__(self) -> None:
        self._file: IO[str] | None = None
        self.enabled = False

    def configure(self, folder: str | None, role: str) -> None:
        """Trace into ``folder`` as ``role`` (orchestrator, worker, client; None or "": off)."""
        self.flush()
        if not folder:
            self._file, self.enabled = None, False
            return
        Path(folder).mkdir(parents=True, exist_ok=True)
        self._file = open(Path(folder) / f"{role}-{os.getpid()}.jsonl", "a", buffering=1 << 16)  # noqa: SIM115
        self.enabled = True

    def event(self, what: str, message_id: str, **ids: Any) -> None:
        if self._file is not None:
            self._write({"e": what, "t": time.time_ns(), "m": message_id, **ids})

    def decoded(self, envelope: Envelope | None) -> None:
        """What a delivered message is (its kind, run, stage and item), once it is decoded."""
        if self._file is not None and envelope is not None:
            kind = envelope.kind.value
            self.event("decoded", envelope.message_id, k=kind, r=envelope.run_id, st=envelope.stage)

    def span(self, step: str, message_ids: Iterable[str] = ()) -> AbstractContextManager[None]:
        """Time the ``with`` body as ``step`` of the messages ``message_ids``, which is read when the body
        ends (ids learnt inside it count). Off, one shared context manager that does nothing: a span sits
        on every message's path, where making a generator per call was a measurable cost."""
        if self._file is None:
            return _UNTIMED
        return self._timed(step, message_ids)

    @contextmanager
    def _timed(self, step: str, message_ids: Iterable[str]) -> Iterator[None]:
        started = time.time_ns()
        try:
            yield
        finally:
            self._write({"s": step, "t0": started, "t1": time.time_ns(), "ms": list(message_ids)})

    def _write(self, record: dict[str, Any]) -> None:
        assert self._file is not None
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()


TRACE = Tracer()
atexit.register(TRACE.flush)

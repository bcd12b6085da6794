"""The tracer of ``orchestrator/trace.py``: off, it writes nothing; on, one JSON object a line per event
and span, in a file of the process's own, and a span is recorded even when its body raises."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from orchestrator.trace import Tracer


def test_off_it_writes_nothing_anywhere(tmp_path: Path) -> None:
    tracer = Tracer()
    tracer.configure(None, "orchestrator")
    tracer.event("sent", "m-1")
    with tracer.span("engine", ["m-1"]):
        pass
    tracer.flush()
    assert not tracer.enabled and list(tmp_path.iterdir()) == []


def test_on_events_and_spans_are_lines_of_the_process_own_file(tmp_path: Path) -> None:
    tracer = Tracer()
    tracer.configure(str(tmp_path / "traces"), "worker")
    tracer.event("received", "m-1")
    with tracer.span("handler", ["m-1"]):
        pass
    with pytest.raises(RuntimeError), tracer.span("decode", ["m-2"]):
        raise RuntimeError("bad message")
    tracer.configure(None, "worker")  # off again: flushed
    (path,) = (tmp_path / "traces").iterdir()
    assert path.name == f"worker-{os.getpid()}.jsonl"
    event, handler, decode = (json.loads(line) for line in path.read_text().splitlines())
    assert event["e"] == "received" and event["m"] == "m-1" and isinstance(event["t"], int)
    assert handler["s"] == "handler" and handler["ms"] == ["m-1"] and handler["t0"] <= handler["t1"]
    assert decode["s"] == "decode" and decode["ms"] == ["m-2"]

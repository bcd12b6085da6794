"""Process logging (``SAGA_LOG_FORMAT``): readable lines, or one JSON object per line, each carrying the
ids of the run, stage, attempt, shard and message being handled.

The code that handles a delivery binds its ids with :func:`bind` or :func:`log_context` (``contextvars``,
so they follow the asyncio task and the tasks it starts); :class:`ContextFilter` copies them onto every
record, and the formatters show them: JSON as fields (``run_id``, ``stage``, ``attempt``, ``shard``,
``message_id``, only those known), text as a ``[run=... stage=...]`` suffix. :func:`configure` installs
both for a process.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar, Token
from datetime import UTC, datetime
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import click
from pythonjsonlogger.json import JsonFormatter as _JsonFormatter

if TYPE_CHECKING:
    from orchestrator.bus.envelope import Envelope
    from orchestrator.settings import Settings

#: The ids a record may carry, in the order the text suffix shows them (with its short names).
IDS = {"run_id": "run", "stage": "stage", "attempt": "attempt", "shard": "shard", "message_id": "message"}
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# Never mutated: each binding sets a new mapping, so a task started inside one keeps what it inherited.
_bound: ContextVar[Mapping[str, Any]] = ContextVar("saga_log_ids", default=MappingProxyType({}))


def bound() -> Mapping[str, Any]:
    """The ids bound in the current context."""
    return _bound.get()


def bind(**ids: Any) -> Token[Mapping[str, Any]]:
    """Bind ids (``run_id``, ``stage``, ``attempt``, ``shard``, ``message_id``) on top of those already
    bound, for the rest of the current context; ``None`` and ``""`` leave an id as it was. Meant for the
    start of a task of its own (``asyncio.create_task`` copies the context, so the binding ends with the
    task); elsewhere use :func:`log_context`."""
    unknown = ids.keys() - IDS.keys()
    if unknown:
        raise TypeError(f"takes only {', '.join(IDS)}, not {', '.join(sorted(unknown))}")
    known = {k: v for k, v in ids.items() if v is not None and v != ""}
    return _bound.set(MappingProxyType({**_bound.get(), **known}))


@contextmanager
def log_context(**ids: Any) -> Iterator[None]:
    """:func:`bind` for the records logged inside the block only."""
    token = bind(**ids)
    try:
        yield
    finally:
        _bound.reset(token)


def envelope_ids(envelope: Envelope | None) -> dict[str, Any]:
    """The ids of a message, for :func:`bind` or :func:`log_context` (none for ``None``; a start names no
    shard, so the one bound stays)."""
    if envelope is None:
        return {}
    return {
        "run_id": envelope.run_id,
        "stage": envelope.stage,
        "attempt": envelope.attempt,
        "shard": envelope.shard,
        "message_id": envelope.message_id,
    }


class ContextFilter(logging.Filter):
    """Copies the bound ids onto each record (never over an id the call passed in ``extra``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in _bound.get().items():
            if key not in record.__dict__:
                setattr(record, key, value)
        return True


class TextFormatter(logging.Formatter):
    """Today's line, ``TIME LEVEL LOGGER: MESSAGE``, with ``[run=... stage=...]`` when ids are known."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        line = super().formatMessage(record)
        known = [f"{short}={record.__dict__[key]}" for key, short in IDS.items() if key in record.__dict__]
        return f"{line} [{' '.join(known)}]" if known else line


class JsonFormatter(_JsonFormatter):
    """One JSON object per record: ``time`` (ISO 8601, UTC), ``level``, ``logger``, ``message``, the
    known ids, any other ``extra``, and ``exc_info`` (the formatted traceback) when there is one."""

    def __init__(self) -> None:
        super().__init__(
            "%(levelname)s %(name)s %(message)s",
            rename_fields={"levelname": "level", "name": "logger"},
            json_ensure_ascii=False,
        )

    def add_fields(
        self, log_record: dict[str, Any], record: logging.LogRecord, message_dict: dict[str, Any]
    ) -> None:
        log_record["time"] = iso_utc(record.created)  # first: the line reads in time order
        super().add_fields(log_record, record, message_dict)


def iso_utc(created: float) -> str:
    """``2025-01-31T12:00:00.123Z``: a record's time, in UTC."""
    moment = datetime.fromtimestamp(created, tz=UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def configure(settings: Settings, verbose: bool) -> None:
    """Log to stderr in ``settings.log_format`` (unset: text), at INFO with ``verbose``, else WARNING."""
    json_format = settings.log_format == "json"
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if json_format else TextFormatter())
    handler.addFilter(ContextFilter())
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, handlers=[handler], force=True)
    # Python's warnings go to stderr on their own; in JSON every line must be a JSON object
    logging.captureWarnings(json_format)


def announce(settings: Settings, logger: logging.Logger, message: str) -> None:
    """A process's start-up line, shown at any level: as a plain line on stderr (text), or as an INFO
    record whatever the level (JSON), so a JSON log holds nothing but JSON."""
    if settings.log_format != "json":
        click.echo(message, err=True)
        return
    record = logger.makeRecord(logger.name, logging.INFO, "(announce)", 0, message, (), None)
    logger.handle(record)  # handle, not info(): the level (WARNING without -v) must not drop it

"""One error shape for every ``saga`` command.

Text: ``error: MESSAGE`` on stderr (click's own usage errors keep click's form, with the usage line; an
invalid definition prints its problems, one ``FILE:LINE: path: message`` line each). When the command's
arguments hold ``--json``: ``{"error": {"code": CODE, "message": MESSAGE, "ids": {...}}}`` on stdout,
and nothing on stderr. Exit codes: 1 refused, failed or not found; 2 usage or configuration; 3 a timeout,
where a command says so.

Codes are stable identifiers: a :class:`~orchestrator.errors.SagaError` brings its class's ``code`` and
``ids``; click's usage errors are ``usage``; the CLI's own failures (a broker it cannot reach, a setting
it cannot read) raise :class:`CliError` with theirs. Nothing here is per command: the ``saga`` group is a
:class:`SagaGroup`, which renders whatever a command raises, so a command added later gets all of this
by raising.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from typing import IO, Any, NoReturn

import aiormq
import click
import pamqp.exceptions
import redis.exceptions

from orchestrator.durability import DurabilityRefused
from orchestrator.errors import ContractError, ContractLoadError, DefinitionError, SagaError

USAGE = "usage"
JSON_FLAG = "--json"
EXIT_REFUSED, EXIT_USAGE, EXIT_TIMEOUT = 1, 2, 3
#: SagaErrors that are configuration errors (exit 2) rather than refusals.
CONFIGURATION_ERRORS: tuple[type[SagaError], ...] = (ContractError, ContractLoadError, DurabilityRefused)
_JSON_META = "saga.cli.json"


class CliError(click.ClickException):
    """A command's failure with a stable ``code`` and the ``ids`` involved; raise it (or :func:`fail`)."""

    def __init__(
        self, code: str, message: str, ids: Mapping[str, Any] | None = None, exit_code: int = EXIT_REFUSED
    ) -> None:
        super().__init__(message)
        self.code = code
        self.ids = dict(ids or {})
        self.exit_code = exit_code  # type: ignore[misc]  # click's is per class; ours is per error

    def document(self) -> dict[str, Any]:
        return {"error": {"code": self.code, "message": self.format_message(), "ids": self.ids}}

    def show(self, file: IO[Any] | None = None) -> None:
        click.echo(f"error: {self.format_message()}", err=True)


class CodedUsageError(click.UsageError):
    """A usage or configuration error (exit 2, shown with the usage line) whose code is not ``usage``."""

    def __init__(
        self, code: str, message: str, ids: Mapping[str, Any] | None = None, ctx: click.Context | None = None
    ) -> None:
        super().__init__(message, ctx)
        self.code = code
        self.ids = dict(ids or {})


def fail(
    code: str, message: str, ids: Mapping[str, Any] | None = None, exit_code: int = EXIT_REFUSED
) -> NoReturn:
    """End the command with this error, shown as the rest are."""
    raise CliError(code, message, ids, exit_code)


def error_of(exc: SagaError | click.ClickException) -> CliError:
    """``exc`` as the error document describes it."""
    if isinstance(exc, CliError):
        return exc
    if isinstance(exc, SagaError):
        exit_code = EXIT_USAGE if isinstance(exc, CONFIGURATION_ERRORS) else EXIT_REFUSED
        # an error that says how the command ends (a wait that timed out: 3) overrides the default
        exit_code = int(getattr(exc, "exit_code", exit_code))
        return CliError(exc.code, str(exc), _jsonable(exc.ids), exit_code)
    if isinstance(exc, CodedUsageError):
        return CliError(exc.code, exc.format_message(), _jsonable(exc.ids), exc.exit_code)
    code = USAGE if isinstance(exc, click.UsageError) else "error"
    return CliError(code, exc.format_message(), {}, exc.exit_code)


def _jsonable(ids: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v if isinstance(v, str | int | float | bool | list) else str(v) for k, v in ids.items()}


class _AsJson(click.ClickException):
    """The error document on stdout, for click to show before it exits with the error's code."""

    def __init__(self, error: CliError) -> None:
        super().__init__(error.format_message())
        self.error = error
        self.exit_code = error.exit_code  # type: ignore[misc]  # as CliError's

    def show(self, file: IO[Any] | None = None) -> None:
        click.echo(json.dumps(self.error.document(), indent=2, sort_keys=True, ensure_ascii=False))


class _Problems(CliError):
    """An invalid definition in text form: its problems, one line each, as ``saga validate`` prints them."""

    def __init__(self, exc: DefinitionError) -> None:
        super().__init__(exc.code, str(exc))
        self.problems = exc.problems

    def show(self, file: IO[Any] | None = None) -> None:
        for problem in self.problems:
            click.echo(str(problem), err=True)


def asks_json(args: list[str]) -> bool:
    """Whether a command line asks for JSON (``--json`` before any ``--``)."""
    return JSON_FLAG in (args[: args.index("--")] if "--" in args else args)


class SagaGroup(click.Group):
    """The ``saga`` group: every failure of every subcommand shown in the one shape this module describes."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta[_JSON_META] = asks_json(args)
        try:
            return super().parse_args(ctx, args)
        except click.ClickException as exc:
            raise _rendered(exc, as_json=ctx.meta[_JSON_META]) from exc

    def invoke(self, ctx: click.Context) -> Any:
        as_json = bool(ctx.meta.get(_JSON_META))
        try:
            return super().invoke(ctx)
        except (SagaError, click.ClickException) as exc:
            raise _rendered(exc, as_json=as_json) from exc
        except BrokenPipeError:  # the reader of our output went away (`saga runs | head`): not a service
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())  # so that flushing stdout at exit raises nothing more
            sys.exit(1)
        except SERVICE_ERRORS as exc:  # a command that let a broken connection through
            raise _rendered(unreachable(exc), as_json=as_json) from exc
        except Exception as exc:
            if not as_json:
                raise  # a bug: its traceback is what a report needs
            error = CliError("internal_error", f"{type(exc).__name__}: {exc} (a bug: please report it)")
            raise _AsJson(error) from exc


#: What a command may meet when RabbitMQ or Redis is unreachable, stalls or fails midway.
SERVICE_ERRORS: tuple[type[BaseException], ...] = (
    aiormq.exceptions.AMQPError,
    pamqp.exceptions.PAMQPException,
    redis.exceptions.RedisError,
    redis.exceptions.RedisClusterException,
    OSError,
    TimeoutError,
)


def unreachable(exc: BaseException) -> CliError:
    """A service that cannot be reached or failed midway: a configuration error (exit 2) naming the
    setting to check."""
    if isinstance(exc, redis.exceptions.RedisError | redis.exceptions.RedisClusterException):
        code, which, setting = "redis_unreachable", "Redis", "SAGA_REDIS_URL"
    elif isinstance(exc, aiormq.exceptions.AMQPError | pamqp.exceptions.PAMQPException):
        code, which, setting = "broker_unreachable", "RabbitMQ", "SAGA_AMQP_URL"
    else:
        code, which, setting = "unreachable", "RabbitMQ or Redis", "SAGA_AMQP_URL / SAGA_REDIS_URL"
    detail = str(exc) or type(exc).__name__
    return CliError(
        code, f"cannot reach {which} or it failed: {detail}; check {setting}", exit_code=EXIT_USAGE
    )


def _rendered(exc: SagaError | click.ClickException, *, as_json: bool) -> click.ClickException:
    if as_json:
        return exc if isinstance(exc, _AsJson) else _AsJson(error_of(exc))
    if isinstance(exc, click.ClickException):
        return exc  # click's own form (usage line, "Error: ..."), or a CliError's "error: ..."
    if isinstance(exc, DefinitionError):
        return _Problems(exc)
    return error_of(exc)

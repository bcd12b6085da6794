"""Options several ``saga`` commands share, in a module of their own so that every command module
(``orchestrator.cli``, ``orchestrator.cli_runtime``...) can use them without importing the others."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])


def registry_options(fn: F) -> F:
    """``--contracts MODULE`` (repeatable) and ``--registry FILE``: the contract registry a command that
    compiles definitions uses; the command gets them as ``modules`` and ``registry_file``."""
    fn = click.option(
        "--contracts",
        "modules",
        multiple=True,
        metavar="MODULE",
        help="Python module whose @action/@worker handlers are the contract registry (repeatable; "
        "default: $SAGA_CONTRACTS or workers.demo). It must be importable: installed, or run with "
        "PYTHONPATH=. from the directory holding it.",
    )(fn)
    fn = click.option(
        "--registry",
        "registry_file",
        type=click.Path(exists=True, dir_okay=False),
        metavar="FILE",
        help="A registry serialised by 'saga contracts export' instead of modules.",
    )(fn)
    return fn


def metrics_options(fn: F) -> F:
    """``--metrics-port PORT`` and ``--metrics-host HOST``: serve Prometheus metrics on ``/metrics``
    (``orchestrator/metrics.py``) and the probes ``/healthz`` and ``/readyz`` (``orchestrator/health.py``);
    the command gets them as ``metrics_port`` and ``metrics_host``."""
    fn = click.option(
        "--metrics-host",
        default="127.0.0.1",
        show_default=True,
        metavar="HOST",
        help="Address the metrics server binds (0.0.0.0: every interface, as in a container).",
    )(fn)
    fn = click.option(
        "--metrics-port",
        type=click.IntRange(0, 65535),
        default=None,
        metavar="PORT",
        help="Serve Prometheus metrics on http://HOST:PORT/metrics, and /healthz (200 while the process "
        "runs) and /readyz (200 while Redis answers, RabbitMQ is connected and the process consumes; "
        "else 503 naming what is not). Default: no such server.",
    )(fn)
    return fn

"""The worker SDK: declare a handler and its contract in one place.

::

    @worker("thumbnail.render", version=3, input=RenderInput, output=RenderOutput, queue="rendering")
    def render(payload: RenderInput) -> RenderOutput: ...

The decorator leaves the function callable as it was and attaches a :class:`Handler` (the contract, the
pydantic models and the function) under ``__saga_handler__`` and the contract under ``__saga_contract__``,
which is how ``saga --contracts MODULE`` and the registry find it. The runtime that consumes task queues
and calls handlers builds on these attributes.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from orchestrator.contracts import (
    ACTIONS_QUEUE,
    CONTRACT_ATTRIBUTE,
    PARALLEL_QUEUE,
    Contract,
    ContractKind,
    strip_annotations,
)
from orchestrator.errors import ContractError

HANDLER_ATTRIBUTE = "__saga_handler__"


class PermanentFailure(Exception):
    """Raise from a handler for a failure no retry can fix (bad data, a refused request): the stage fails
    at once instead of using its retry policy. Any other exception is reported as retryable."""


F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Handler:
    """A decorated function with the contract it implements."""

    contract: Contract
    input_model: type[BaseModel]
    output_model: type[BaseModel]
    function: Callable[..., Any]

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.function)


def action(
    name: str,
    *,
    version: int,
    input: type[BaseModel],  # mirrors the DSL field name
    output: type[BaseModel],
    queue: str = ACTIONS_QUEUE,
    description: str | None = None,
) -> Callable[[F], F]:
    """Declare an action: a short side-effecting call (default queue ``tasks.actions``)."""
    return _declare(
        ContractKind.ACTION,
        name=name,
        version=version,
        input_model=input,
        output_model=output,
        queue=queue,
        description=description,
    )


def worker(
    name: str,
    *,
    version: int,
    input: type[BaseModel],  # mirrors the DSL field name
    output: type[BaseModel],
    queue: str = PARALLEL_QUEUE,
    description: str | None = None,
) -> Callable[[F], F]:
    """Declare a worker: a unit of work for a pool (default queue ``tasks.parallel``)."""
    return _declare(
        ContractKind.WORKER,
        name=name,
        version=version,
        input_model=input,
        output_model=output,
        queue=queue,
        description=description,
    )


def _declare(
    kind: ContractKind,
    *,
    name: str,
    version: int,
    input_model: type[BaseModel],
    output_model: type[BaseModel],
    queue: str,
    description: str | None,
) -> Callable[[F], F]:
    for role, model in (("input", input_model), ("output", output_model)):
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            raise ContractError(f"{name}@{version}: {role}= must be a pydantic model class, got {model!r}")
    try:
        contract = Contract(
            name=name,
            version=version,
            kind=kind,
            queue=queue,
            input_schema=strip_annotations(input_model.model_json_schema()),
            output_schema=strip_annotations(output_model.model_json_schema()),
            description=description,
        )
    except ValidationError as exc:
        raise ContractError(f"invalid contract declaration {name}@{version}: {exc}") from exc

    def attach(function: F) -> F:
        handler = Handler(contract, input_model, output_model, function)
        setattr(function, HANDLER_ATTRIBUTE, handler)
        setattr(function, CONTRACT_ATTRIBUTE, contract)
        return function

    return attach


def handlers_of(module: object) -> list[Handler]:
    """Every handler the SDK decorated in ``module``, in a stable order."""
    found = [
        getattr(obj, HANDLER_ATTRIBUTE)
        for obj in vars(module).values()
        if isinstance(getattr(obj, HANDLER_ATTRIBUTE, None), Handler)
    ]
    return sorted(found, key=lambda h: h.contract.ref)

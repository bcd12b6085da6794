"""The worker SDK: declare a handler and its contract in one place.

::

    @worker("thumbnail.render", version=4, input=RenderInput, output=RenderOutput, queue="rendering")
    def render(payload: RenderInput) -> RenderOutput: ...

The decorator leaves the function callable as it was and attaches a :class:`Handler` (the contract, the
pydantic models and the function) under ``__saga_handler__`` and the contract under ``__saga_contract__``,
which is how ``saga --contracts MODULE`` and the registry find it. The runtime that consumes task queues
and calls handlers builds on these attributes.

Rolling upgrades. Runs pin the contract versions of their plan, so while runs pinned to an older version
are in flight, some worker must still serve it (invariant 14: such a task waits for one, it never fails
for lack of a handler). A handler may serve several versions:

* ``also_serves=[3]``: the same function, input and output models serve ``@3`` too (the models fit both;
  the registry refuses it if ``@3`` was declared elsewhere with other schemas);
* :func:`adapter`: ``@3`` declared with its own models and bridged to the current handler: its input is
  upgraded to the current input model, the handler runs, its output is downgraded and checked against
  ``@3``'s output model. A conversion that fails is a :class:`ContractViolation` (no retry mends it)::

    render_v3 = adapter("thumbnail.render", from_version=3, to=render, input=RenderInputV3,
                        output=RenderOutputV3, upgrade_input=v3_to_v4, downgrade_output=v4_to_v3)

Every version a function serves is under ``__saga_handlers__`` / ``__saga_contracts__`` (the first one is
the ``__saga_handler__`` / ``__saga_contract__``); the worker consumes the contract queue of each.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, Field, ValidationError

from orchestrator.contracts import (
    ACTIONS_QUEUE,
    CONTRACT_ATTRIBUTE,
    CONTRACTS_ATTRIBUTE,
    PARALLEL_QUEUE,
    Contract,
    ContractKind,
    strip_annotations,
)
from orchestrator.errors import ContractError
from orchestrator.redaction import SENSITIVE

HANDLER_ATTRIBUTE = "__saga_handler__"
HANDLERS_ATTRIBUTE = "__saga_handlers__"


#: Marks a contract field sensitive: ``card: Annotated[str, Sensitive]``. Its value is never shown (run
#: status, history, logs, the API and console, dead letters): a marker with a short keyed hash stands in
#: for it (``orchestrator/redaction.py``). Handlers get the real value.
Sensitive = Field(json_schema_extra={SENSITIVE: True})


class PermanentFailure(Exception):
    """Raise from a handler for a failure no retry can fix (bad data, a refused request): the stage fails
    at once instead of using its retry policy. Any other exception is reported as retryable."""


class ContractViolation(PermanentFailure):
    """Raised when an adapter cannot bridge a task: its ``upgrade_input`` or ``downgrade_output`` raised,
    or gave a value that does not fit the contract it converts to. Permanent: the same task converts the
    same way every time."""


F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Handler:
    """A decorated function with the contract it implements. For an adapter, ``function`` is the bridge
    the SDK built and ``adapts_to`` the ref of the handler it calls."""

    contract: Contract
    input_model: type[BaseModel]
    output_model: type[BaseModel]
    function: Callable[..., Any]
    adapts_to: str | None = None

    # cached: read for every task, and inspect's signature is not cheap
    @functools.cached_property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.function)

    @functools.cached_property
    def wants_context(self) -> bool:
        """Whether the function takes the task's context as its second argument."""
        return wants_context(self.function)


def wants_context(function: Callable[..., Any]) -> bool:
    return len(inspect.signature(function).parameters) >= 2


def action(
    name: str,
    *,
    version: int,
    input: type[BaseModel],  # mirrors the DSL field name
    output: type[BaseModel],
    queue: str = ACTIONS_QUEUE,
    description: str | None = None,
    also_serves: Iterable[int] = (),
) -> Callable[[F], F]:
    """Declare an action: a short side-effecting call (default queue ``tasks.actions``). ``also_serves``:
    older versions the same models fit, served by the same function."""
    return _declare(
        ContractKind.ACTION,
        name=name,
        versions=_versions(name, version, also_serves),
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
    also_serves: Iterable[int] = (),
) -> Callable[[F], F]:
    """Declare a worker: a unit of work for a pool (default queue ``tasks.parallel``). ``also_serves``:
    older versions the same models fit, served by the same function."""
    return _declare(
        ContractKind.WORKER,
        name=name,
        versions=_versions(name, version, also_serves),
        input_model=input,
        output_model=output,
        queue=queue,
        description=description,
    )


def adapter(
    name: str,
    *,
    from_version: int,
    to: Callable[..., Any],
    input: type[BaseModel],  # mirrors the DSL field name
    output: type[BaseModel],
    upgrade_input: Callable[[Any], Any],
    downgrade_output: Callable[[Any], Any],
    queue: str | None = None,
    description: str | None = None,
) -> Callable[..., Any]:
    """Serve ``name@from_version`` (declared with its own ``input`` and ``output`` models) through the
    handler ``to`` (a function declared with ``@worker`` / ``@action``): ``upgrade_input(old_input)``
    gives ``to``'s input, ``downgrade_output(new_output)`` gives the old output. Either may return a model
    or a dict; both are checked against the model they convert to. Kind and queue are ``to``'s unless
    ``queue`` is given. Returns the bridge function: assign it to a module attribute, so the registry and
    ``saga worker --app`` find it."""
    target = getattr(to, HANDLER_ATTRIBUTE, None)
    ref = f"{name}@{from_version}"
    if not isinstance(target, Handler):
        raise ContractError(
            f"adapter {ref}: to= must be a function declared with @worker or @action, got {to!r}"
        )
    for role, convert in (("upgrade_input", upgrade_input), ("downgrade_output", downgrade_output)):
        if not callable(convert):
            raise ContractError(f"adapter {ref}: {role}= must be a function, got {convert!r}")
    served = [h.contract.ref for h in getattr(to, HANDLERS_ATTRIBUTE, (target,))]
    if ref in served:
        raise ContractError(
            f"adapter {ref}: {_where(to)} already serves {ref} itself; declare it once (an adapter, or "
            "also_serves when the same models fit)"
        )
    contract = _contract(
        target.contract.kind, name, from_version, input, output, queue or target.contract.queue, description
    )
    bridge = _bridge(contract.ref, target, input, output, upgrade_input, downgrade_output)
    _attach(bridge, (Handler(contract, input, output, bridge, adapts_to=target.contract.ref),))
    return bridge


def _versions(name: str, version: int, also_serves: Iterable[int]) -> tuple[int, ...]:
    listed = isinstance(also_serves, Iterable) and not isinstance(also_serves, (str, bytes))
    extra = tuple(also_serves) if listed else ()
    if not listed or not all(isinstance(v, int) and not isinstance(v, bool) for v in extra):
        raise ContractError(
            f"{name}@{version}: also_serves= must be a list of versions (ints), got {also_serves!r}"
        )
    if version in extra or len(set(extra)) != len(extra):
        raise ContractError(f"{name}@{version}: also_serves={list(extra)} repeats a version")
    return (version, *extra)


def _contract(
    kind: ContractKind,
    name: str,
    version: int,
    input_model: type[BaseModel],
    output_model: type[BaseModel],
    queue: str,
    description: str | None,
) -> Contract:
    for role, model in (("input", input_model), ("output", output_model)):
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            raise ContractError(f"{name}@{version}: {role}= must be a pydantic model class, got {model!r}")
    try:
        return Contract(
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


def _declare(
    kind: ContractKind,
    *,
    name: str,
    versions: tuple[int, ...],
    input_model: type[BaseModel],
    output_model: type[BaseModel],
    queue: str,
    description: str | None,
) -> Callable[[F], F]:
    contracts = [
        _contract(kind, name, version, input_model, output_model, queue, description) for version in versions
    ]

    def attach(function: F) -> F:
        _attach(function, tuple(Handler(c, input_model, output_model, function) for c in contracts))
        return function

    return attach


def _attach(function: Callable[..., Any], handlers: tuple[Handler, ...]) -> None:
    setattr(function, HANDLER_ATTRIBUTE, handlers[0])
    setattr(function, HANDLERS_ATTRIBUTE, handlers)
    setattr(function, CONTRACT_ATTRIBUTE, handlers[0].contract)
    setattr(function, CONTRACTS_ATTRIBUTE, tuple(h.contract for h in handlers))


def _bridge(
    ref: str,
    target: Handler,
    input_model: type[BaseModel],
    output_model: type[BaseModel],
    upgrade_input: Callable[[Any], Any],
    downgrade_output: Callable[[Any], Any],
) -> Callable[..., Any]:
    """The function that serves ``ref`` through ``target``: async when the target is (so a cancellation
    reaches it), else plain (the runtime runs it in its thread pool, as it would the target)."""
    to_ref = target.contract.ref

    def upgrade(payload: BaseModel) -> BaseModel:
        what = f"adapter {ref} -> {to_ref}: upgrade_input"
        return _fitted(target.input_model, _convert(upgrade_input, payload, what), what, f"{to_ref}'s input")

    def downgrade(result: Any) -> BaseModel:
        new = _fitted(target.output_model, result, f"the {to_ref} handler", f"{to_ref}'s output")
        what = f"adapter {ref} <- {to_ref}: downgrade_output"
        return _fitted(output_model, _convert(downgrade_output, new, what), what, f"{ref}'s output")

    def arguments(payload: BaseModel, context: Any) -> tuple[Any, ...]:
        return (upgrade(payload), context) if target.wants_context else (upgrade(payload),)

    if target.is_async:

        async def bridge_async(payload: BaseModel, context: Any = None) -> BaseModel:
            return downgrade(await target.function(*arguments(payload, context)))

        bridge: Callable[..., Any] = bridge_async
    else:

        def bridge_sync(payload: BaseModel, context: Any = None) -> BaseModel:
            return downgrade(target.function(*arguments(payload, context)))

        bridge = bridge_sync
    bridge.__module__ = target.function.__module__
    old = ref.rpartition("@")[2]
    bridge.__name__ = f"{target.function.__name__}_from_v{old}"
    bridge.__qualname__ = f"{target.function.__qualname__}_from_v{old}"
    bridge.__doc__ = f"{ref}, served by {to_ref} ({target.function.__qualname__}) through an adapter."
    return bridge


def _convert(convert: Callable[[Any], Any], value: BaseModel, what: str) -> Any:
    try:
        return convert(value)
    except Exception as exc:  # any failure of the user's conversion is a contract violation, said so
        raise ContractViolation(f"{what} failed: {type(exc).__name__}: {exc}") from exc


def _fitted(model: type[BaseModel], value: Any, what: str, fits: str) -> BaseModel:
    """``value`` as ``model`` (``fits`` names it in the error): a model of another class is checked by
    its fields."""
    if isinstance(value, model):
        return value
    data = value.model_dump() if isinstance(value, BaseModel) else value
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '(root)'}: {e['msg']}"
            for e in exc.errors(include_url=False)
        )
        raise ContractViolation(f"{what} gave a value that does not fit {fits}: {problems}") from exc


def _where(function: Callable[..., Any]) -> str:
    return f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', repr(function))}"


def handlers_of(module: object) -> list[Handler]:
    """Every handler the SDK declared in ``module`` (each version a function serves, adapters included),
    in a stable order."""
    found: dict[tuple[str, int], Handler] = {}
    for obj in vars(module).values():
        many = getattr(obj, HANDLERS_ATTRIBUTE, None)
        one = getattr(obj, HANDLER_ATTRIBUTE, None)
        declared = many if isinstance(many, tuple) else (one,)
        for handler in declared:
            if isinstance(handler, Handler):  # a function bound to two names is listed once
                found[(handler.contract.ref, id(handler.function))] = handler
    return sorted(found.values(), key=lambda h: h.contract.ref)

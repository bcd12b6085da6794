"""Errors raised by saga-orchestrator.

Every error a user can hit derives from :class:`SagaError` and says what is wrong and what to do, with the
ids involved kept as attributes. Each class has a stable ``code`` (``run_not_found``, ``start_refused``...)
and names its id attributes in ``id_fields``: the CLI's ``--json`` error document (and any API) is
``{"error": {"code": error.code, "message": str(error), "ids": error.ids}}``. The tree here; the clients,
dead-letter commands and stores add their own leaves under :class:`SagaError`::

    SagaError
    ├── DefinitionError          a definition failed to load or compile (carries every Problem)
    ├── ContractError            a contract declaration or registry is invalid
    │   └── ContractNotFound     a name@version is not in the registry
    ├── ContractLoadError        a --contracts module could not be imported
    └── BindingError             a ${...} binding could not be resolved at run time
        ├── BindingMissing       the referenced value does not exist
        ├── BindingNull          the value exists but is null where a value is required
        ├── BindingWrongType     the value exists but has the wrong type
        └── BindingEvaluationError  the expression failed for another reason (division by zero, ...)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar


class SagaError(Exception):
    """Raised for any error saga-orchestrator reports to a user; catch this to catch them all."""

    #: A stable identifier of the error's class, for programs: never reworded once released.
    code: ClassVar[str] = "error"
    #: The attributes that hold the ids involved (run, definition, queue...), in :attr:`ids`.
    id_fields: ClassVar[tuple[str, ...]] = ()

    @property
    def ids(self) -> dict[str, Any]:
        """The ids involved, by name (those not known are left out)."""
        found = {name: getattr(self, name, None) for name in self.id_fields}
        return {name: value for name, value in found.items() if value is not None}


@dataclass(frozen=True, order=True)
class Problem:
    """One thing wrong with a definition, located as precisely as the source allows."""

    file: str
    line: int
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.path}: {self.message}"


class DefinitionError(SagaError):
    """Raised when a definition cannot be loaded or compiled; ``problems`` lists every issue found."""

    code = "definition_invalid"

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = sorted(problems)
        count = len(self.problems)
        lines = "\n".join(str(p) for p in self.problems)
        super().__init__(f"{count} problem{'s' if count != 1 else ''} in definition:\n{lines}")


class ContractError(SagaError):
    """Raised when a contract declaration is invalid or two declarations of one name@version disagree."""

    code = "contract_invalid"


class ContractNotFound(ContractError):
    """Raised when a name@version is looked up that no loaded contract module declares."""

    code = "contract_not_found"
    id_fields = ("ref",)

    def __init__(self, ref: str, known: list[str]) -> None:
        self.ref = ref
        hint = ", ".join(known) if known else "none are loaded"
        super().__init__(
            f"contract {ref!r} is not registered (registered: {hint}); "
            "declare it with @action/@worker in a module passed with --contracts"
        )


class ContractLoadError(SagaError):
    """Raised when a contracts module named with --contracts (or SAGA_CONTRACTS) cannot be imported, or
    declares no handlers."""

    code = "contracts_not_loaded"
    id_fields = ("module",)

    def __init__(self, module: str, reason: str, *, imported: bool = False) -> None:
        self.module = module
        hint = (
            "declare its handlers with workers.sdk's @action/@worker"
            if imported
            else "the module must be importable: installed (pip install -e . in its project), or run with "
            "PYTHONPATH=. from the directory holding it"
        )
        super().__init__(f"cannot load contracts from module {module!r}: {reason}; {hint}")


class BindingError(SagaError):
    """Raised when a ``${...}`` binding cannot produce the value its target needs at run time."""

    code = "binding_failed"
    id_fields = ("target",)

    def __init__(self, target: str, expression: str, detail: str) -> None:
        self.target = target
        self.expression = expression
        self.detail = detail
        shown = f"${{{expression}}}: " if expression else ""
        super().__init__(f"{target}: {shown}{detail}")


class BindingMissing(BindingError):
    """Raised when the value a binding references does not exist (no such key, index or stage result)."""


class BindingNull(BindingError):
    """Raised when the referenced value exists but is null and the target does not accept null."""


class BindingWrongType(BindingError):
    """Raised when the referenced value exists but its type does not fit the target's schema."""


class BindingEvaluationError(BindingError):
    """Raised when an expression fails for a reason other than missing, null or wrong type."""

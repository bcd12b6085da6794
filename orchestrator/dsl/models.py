"""The workflow DSL as typed models: the shape layer of the compiler.

A definition is validated strictly (no coercion: ``version: 2.3`` is a float and is refused; quote it) and
with ``extra="forbid"`` everywhere, so a misspelt field is an error, not a silently ignored line. Stage
shapes are a discriminated union on ``type``. Only shape is checked here; references, graph rules, bounds
and contracts are the later layers (``orchestrator.compiler``).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue

NAME_PATTERN = r"^[a-z][a-z0-9_-]{0,63}$"
CONTRACT_REF_PATTERN = r"^[a-z][a-z0-9_.-]{0,127}@[1-9][0-9]{0,5}$"
QUEUE_PATTERN = r"^[a-z][a-z0-9_.-]{0,127}$"
CLASS_PATTERN = r"^[a-z][a-z0-9_-]{0,31}$"

StageName = Annotated[str, Field(pattern=NAME_PATTERN)]
ContractRef = Annotated[str, Field(pattern=CONTRACT_REF_PATTERN)]
Target = Annotated[str, Field(min_length=1, max_length=64)]
PositiveMs = Annotated[int, Field(ge=1)]


class Terminal(StrEnum):
    """Terminal intents a route may reach. Each is an *intent*: finalisers run before it is exposed."""

    COMPLETED = "completed"
    FAILED = "failed"


class BranchOutcome(StrEnum):
    """States in which a fork branch can arrive at its join."""

    COMPLETED = "completed"
    FAILED = "failed"
    TIMED_OUT = "timed-out"
    CANCELLED = "cancelled"
    SKIPPED = "skipped"


# Enums are read from YAML strings, which strict mode would refuse; everything else stays strict.
TerminalName = Annotated[Terminal, Field(strict=False)]
BranchOutcomeName = Annotated[BranchOutcome, Field(strict=False)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, populate_by_name=True)


class RetryPolicy(_Model):
    """How often a failed attempt is retried, and how long to wait between attempts (exponential)."""

    max_attempts: int = Field(1, ge=1, description="1 means no retry")
    initial_backoff_ms: int = Field(1_000, ge=0)
    backoff_multiplier: float = Field(2.0, ge=1.0, le=10.0)
    max_backoff_ms: int = Field(60_000, ge=0)
    jitter: float = Field(0.1, ge=0.0, le=1.0, description="fraction of each delay drawn at random")


class _StageBase(_Model):
    name: StageName
    description: str | None = None


class _WorkStage(_StageBase):
    """Fields shared by stages that dispatch work to a contract (action, worker, map)."""

    input: dict[str, JsonValue] = Field(default_factory=dict)
    queue: str | None = Field(None, pattern=QUEUE_PATTERN)
    retry: RetryPolicy = Field(default_factory=RetryPolicy)
    queue_deadline_ms: PositiveMs | None = None
    execution_deadline_ms: PositiveMs | None = None
    heartbeat_timeout_ms: PositiveMs | None = None
    compensate: ContractRef | None = None
    on_success: Target
    on_failure: Target = Terminal.FAILED.value


class ActionStage(_WorkStage):
    """A short, side-effecting call to an action contract (``tasks.actions`` unless a queue is named)."""

    type: Literal["action"]
    action: ContractRef

    @property
    def contract_ref(self) -> str:
        return self.action


class WorkerStage(_WorkStage):
    """A unit of work for a worker pool, on the contract's queue or the one named here."""

    type: Literal["worker"]
    worker: ContractRef

    @property
    def contract_ref(self) -> str:
        return self.worker


#: The most item tasks one message may carry (``items_per_message``).
MAX_ITEMS_PER_MESSAGE = 100


class MapStage(_WorkStage):
    """004's bag of parallel tasks: one worker per item of a bound list, joined by one barrier.

    ``items`` is a ``${...}`` binding that yields a list; ``input`` may use ``item`` and ``index``. The
    stage's result is the list of item results, in item order.
    """

    type: Literal["map"]
    worker: ContractRef
    items: str = Field(min_length=1)
    max_items: int = Field(ge=1)
    # How many item tasks travel in one broker message: cheap items spend less on the transport, at the
    # price of coarser sharing between workers (one worker takes the message's items together).
    items_per_message: int = Field(1, ge=1, le=MAX_ITEMS_PER_MESSAGE)

    @property
    def contract_ref(self) -> str:
        return self.worker


class DecisionBranch(_Model):
    when: str = Field(min_length=1)
    next: Target


class DecisionStage(_StageBase):
    """Routes to the first branch whose CEL ``when`` is true; the last branch must be ``when: "true"``."""

    type: Literal["decision"]
    branches: list[DecisionBranch] = Field(min_length=1)
    on_evaluation_error: Target = Terminal.FAILED.value


class ForkStage(_StageBase):
    """Starts every listed branch at once; a single join downstream waits for them."""

    type: Literal["fork"]
    branches: list[StageName] = Field(min_length=2)


class JoinStage(_StageBase):
    """Waits for the ``required`` branches of one fork, then releases ``on_success`` exactly once."""

    type: Literal["join"]
    required: list[StageName] = Field(min_length=1)
    acceptable_terminal_states: list[BranchOutcomeName] = Field(
        default_factory=lambda: [BranchOutcome.COMPLETED], min_length=1
    )
    on_success: Target
    on_failure: Target = Terminal.FAILED.value


Stage = Annotated[
    ActionStage | WorkerStage | MapStage | DecisionStage | ForkStage | JoinStage,
    Field(discriminator="type"),
]
STAGE_MODELS: dict[str, type[_StageBase]] = {
    "action": ActionStage,
    "worker": WorkerStage,
    "map": MapStage,
    "decision": DecisionStage,
    "fork": ForkStage,
    "join": JoinStage,
}
STAGE_TYPES = tuple(STAGE_MODELS)
WorkStage = ActionStage | WorkerStage | MapStage


class TerminalPolicy(_Model):
    """The seed's terminal policy. Each field has one supported value today; naming them keeps plans
    explicit and leaves room for more."""

    fork_branch_failure: Literal["request-cancellation-and-fence"] = "request-cancellation-and-fence"
    late_callbacks: Literal["reject-and-record"] = "reject-and-record"
    finalisers: Literal["declared-order"] = "declared-order"
    finaliser_failure_terminal: Literal["failed"] = "failed"


class Definition(_Model):
    """A workflow definition as written in ``definitions/*.yaml``."""

    name: StageName
    version: str = Field(min_length=1, max_length=64)
    description: str | None = None
    shard_class: str = Field("fast", alias="class", pattern=CLASS_PATTERN)
    entry: StageName
    context: dict[str, JsonValue] | None = Field(
        None, description="JSON Schema the start context must satisfy"
    )
    output: JsonValue = Field(None, description="binding evaluated at completion: the run's result")
    run_deadline_ms: PositiveMs | None = None
    stages: list[Stage] = Field(min_length=1)
    terminal_policy: TerminalPolicy = Field(default_factory=TerminalPolicy)
    finalisers: list[ContractRef] = Field(default_factory=list)
    terminals: list[TerminalName] = Field(
        default_factory=lambda: [Terminal.COMPLETED, Terminal.FAILED], min_length=1
    )

"""Rolling upgrades in the worker SDK: one handler serving several contract versions (``also_serves``),
adapters bridging an older version to the current handler, what the registry makes of both, and how the
runtime reports an adapter whose conversion fails."""

from __future__ import annotations

import asyncio
import types
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from pydantic import BaseModel

from orchestrator.bus.envelope import Envelope, Signer
from orchestrator.contracts import CONTRACT_ATTRIBUTE, CONTRACTS_ATTRIBUTE, ContractKind, Registry
from orchestrator.errors import ContractError
from orchestrator.wire.bodies import TaskBody
from orchestrator.wire.kinds import Kind
from workers.runtime import TaskContext, Turn, WorkerRuntime, worker_info
from workers.sdk import (
    HANDLER_ATTRIBUTE,
    HANDLERS_ATTRIBUTE,
    ContractViolation,
    Handler,
    PermanentFailure,
    adapter,
    handlers_of,
    worker,
)


class InV3(BaseModel):
    modelId: str  # noqa: N815
    size: int


class OutV3(BaseModel):
    uri: str
    size: int


class InV4(BaseModel):
    modelId: str  # noqa: N815
    width: int
    height: int


class OutV4(BaseModel):
    uri: str
    width: int
    height: int
    format: str


def context(contract: str = "render@3") -> TaskContext:
    return TaskContext("r-1", "render", 1, None, "1.1", contract, "key")


@worker("render", version=4, input=InV4, output=OutV4, queue="rendering")
def render_v4(payload: InV4, ctx: TaskContext) -> OutV4:
    return OutV4(
        uri=f"{payload.modelId}-{ctx.contract}", width=payload.width, height=payload.height, format="webp"
    )


def square(old: InV3) -> InV4:
    return InV4(modelId=old.modelId, width=old.size, height=old.size)


def one_size(new: OutV4) -> dict[str, Any]:
    return {"uri": new.uri, "size": new.width}


render_v3 = adapter(
    "render",
    from_version=3,
    to=render_v4,
    input=InV3,
    output=OutV3,
    upgrade_input=square,
    downgrade_output=one_size,
)


def module(**attributes: Any) -> types.ModuleType:
    found = types.ModuleType("fake_app")
    vars(found).update(attributes)
    return found


# ---- one handler, several versions ---------------------------------------------------------------


def test_also_serves_declares_each_version_with_the_same_models() -> None:
    @worker("crop", version=2, input=InV3, output=OutV3, queue="rendering", also_serves=[1])
    def crop(payload: InV3) -> OutV3:
        return OutV3(uri=payload.modelId, size=payload.size)

    handlers: tuple[Handler, ...] = getattr(crop, HANDLERS_ATTRIBUTE)
    assert [h.contract.ref for h in handlers] == ["crop@2", "crop@1"]
    assert getattr(crop, HANDLER_ATTRIBUTE) is handlers[0]  # the declared version comes first
    assert getattr(crop, CONTRACT_ATTRIBUTE).ref == "crop@2"
    assert [c.ref for c in getattr(crop, CONTRACTS_ATTRIBUTE)] == ["crop@2", "crop@1"]
    assert handlers[0].contract.input_schema == handlers[1].contract.input_schema
    assert {h.contract.queue for h in handlers} == {"rendering"}
    assert all(h.function is crop for h in handlers)
    assert crop(InV3(modelId="m", size=3)) == OutV3(uri="m", size=3)  # still a plain function

    # And handlers_of and the registry see both versions
    assert [h.contract.ref for h in handlers_of(module(crop=crop))] == ["crop@1", "crop@2"]
    assert Registry([*getattr(crop, CONTRACTS_ATTRIBUTE)]).refs() == ["crop@1", "crop@2"]


@pytest.mark.parametrize("also", [[2], [1, 1], "1", [True]], ids=["itself", "twice", "string", "bool"])
def test_also_serves_refuses_what_is_not_a_list_of_other_versions(also: Any) -> None:
    with pytest.raises(ContractError, match=r"crop@2: also_serves="):
        worker("crop", version=2, input=InV3, output=OutV3, also_serves=also)


def test_registry_from_modules_collects_every_version_and_adapter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "fake_render_app", module(render_v4=render_v4, render_v3=render_v3))
    registry = Registry.from_modules(["fake_render_app"])
    assert registry.refs() == ["render@3", "render@4"]
    old = registry.require("render@3")
    assert old.input_schema["required"] == ["modelId", "size"]  # @3's own models, not @4's
    assert (old.kind, old.queue) == (ContractKind.WORKER, "rendering")  # the target's, by default


# ---- adapters ------------------------------------------------------------------------------------


def test_an_adapter_bridges_the_old_version_to_the_current_handler() -> None:
    handler: Handler = getattr(render_v3, HANDLER_ATTRIBUTE)
    assert handler.contract.ref == "render@3"
    assert handler.adapts_to == "render@4"
    assert (handler.input_model, handler.output_model) == (InV3, OutV3)
    assert handler.wants_context and not handler.is_async  # a plain target: the runtime's thread pool

    # When it runs a @3 task: the @4 handler gets the upgraded input (and the task's context)
    out = render_v3(InV3(modelId="m-1", size=64), context())
    # Then the @4 output comes back as a @3 output
    assert out == OutV3(uri="m-1-render@3", size=64)


def test_an_adapter_of_an_async_handler_is_async_and_passes_no_context_to_one_that_wants_none() -> None:
    @worker("render", version=4, input=InV4, output=OutV4)
    async def render_async(payload: InV4) -> OutV4:
        await asyncio.sleep(0)
        return OutV4(uri=payload.modelId, width=payload.width, height=payload.height, format="png")

    bridge = adapter(
        "render",
        from_version=3,
        to=render_async,
        input=InV3,
        output=OutV3,
        upgrade_input=square,
        downgrade_output=one_size,
    )
    assert getattr(bridge, HANDLER_ATTRIBUTE).is_async
    assert asyncio.run(bridge(InV3(modelId="m", size=8), context())) == OutV3(uri="m", size=8)


def bridge_with(**overrides: Any) -> Any:
    options: dict[str, Any] = {"upgrade_input": square, "downgrade_output": one_size, **overrides}
    return adapter("render", from_version=3, to=render_v4, input=InV3, output=OutV3, **options)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            {"downgrade_output": lambda new: {"uri": new.uri}},
            r"adapter render@3 <- render@4: downgrade_output gave a value that does not fit render@3's "
            r"output: size: Field required",
        ),
        (
            {"downgrade_output": lambda new: new},  # forgot to convert: @4's fields lack 'size'
            r"does not fit render@3's output: size: Field required",
        ),
        (
            {"downgrade_output": lambda new: 1 / 0},
            r"adapter render@3 <- render@4: downgrade_output failed: ZeroDivisionError",
        ),
        (
            {"upgrade_input": lambda old: {"modelId": old.modelId}},
            r"adapter render@3 -> render@4: upgrade_input gave a value that does not fit render@4's input: "
            r"width: Field required; height: Field required",
        ),
        (
            {"upgrade_input": lambda old: old.missing},
            r"adapter render@3 -> render@4: upgrade_input failed: AttributeError",
        ),
    ],
    ids=[
        "output-missing-field",
        "output-not-converted",
        "downgrade-raises",
        "input-missing",
        "upgrade-raises",
    ],
)
def test_a_failing_conversion_is_a_permanent_contract_violation(
    overrides: dict[str, Any], expected: str
) -> None:
    with pytest.raises(ContractViolation, match=expected) as caught:
        bridge_with(**overrides)(InV3(modelId="m", size=4), context())
    assert isinstance(caught.value, PermanentFailure)


def test_the_handlers_own_failure_passes_through_an_adapter_unchanged() -> None:
    @worker("flaky", version=2, input=InV4, output=OutV4)
    def flaky(payload: InV4) -> OutV4:
        raise ConnectionError("renderer busy")

    bridge = adapter(
        "flaky",
        from_version=1,
        to=flaky,
        input=InV3,
        output=OutV3,
        upgrade_input=square,
        downgrade_output=one_size,
    )
    with pytest.raises(ConnectionError, match="renderer busy"):  # retryable, as from the handler itself
        bridge(InV3(modelId="m", size=4))


def test_adapter_declarations_that_cannot_work_are_refused() -> None:
    with pytest.raises(
        ContractError, match=r"adapter render@3: to= must be a function declared with @worker"
    ):
        adapter(
            "render",
            from_version=3,
            to=square,
            input=InV3,
            output=OutV3,
            upgrade_input=square,
            downgrade_output=one_size,
        )
    with pytest.raises(ContractError, match=r"adapter render@3: downgrade_output= must be a function"):
        bridge_with(downgrade_output="one_size")

    @worker("render", version=4, input=InV4, output=OutV4, also_serves=[3])
    def both(payload: InV4) -> OutV4: ...

    with pytest.raises(ContractError, match=r"already serves render@3 itself"):
        adapter(
            "render",
            from_version=3,
            to=both,
            input=InV3,
            output=OutV3,
            upgrade_input=square,
            downgrade_output=one_size,
        )


def test_an_adapter_and_a_handler_of_the_old_version_must_declare_the_same_contract() -> None:
    @worker("render", version=3, input=InV3, output=OutV3, queue="rendering", description="the old one")
    def old_render(payload: InV3) -> OutV3: ...

    # the same models (a description only one of them has is documentation): one contract
    same = Registry([*getattr(old_render, CONTRACTS_ATTRIBUTE), *getattr(render_v3, CONTRACTS_ATTRIBUTE)])
    assert same.require("render@3").description == "the old one"

    # other models under the same version: refused, saying what differs and what to do
    @worker("render", version=3, input=InV4, output=OutV3, queue="rendering")
    def changed(payload: InV4) -> OutV3: ...

    with pytest.raises(ContractError) as caught:
        Registry([*getattr(changed, CONTRACTS_ATTRIBUTE), *getattr(render_v3, CONTRACTS_ATTRIBUTE)])
    message = str(caught.value)
    assert "render@3 is declared twice" in message and "input_schema differs" in message
    assert "new version" in message


# ---- the runtime ----------------------------------------------------------------------------------


def task(contract: str, payload: dict[str, Any]) -> Envelope:
    return Envelope(
        kind=Kind.TASK,
        message_id="t-1",
        run_id="r-1",
        shard="fast.0",
        stage="render",
        attempt=1,
        fence="1.1",
        contract=contract,
        body={"input": payload},
    )


def execute(handlers: dict[str, Handler], envelope: Envelope) -> Any:
    async def go() -> Any:
        runtime = WorkerRuntime(
            connection=None,  # type: ignore[arg-type]  # _execute needs no broker
            handlers=handlers,
            serving=[],
            signer=Signer.from_settings(("k:secret",)),
        )
        with ThreadPoolExecutor(max_workers=1) as pool:
            task = TaskBody.of(envelope.body, envelope.message_id)
            return await runtime._execute(envelope, task, pool, Turn(runtime, None, False))

    return asyncio.run(go())


def test_the_runtime_runs_an_old_version_task_through_the_adapter() -> None:
    handlers = {h.contract.ref: h for h in handlers_of(module(render_v4=render_v4, render_v3=render_v3))}
    outcome = execute(handlers, task("render@3", {"modelId": "m", "size": 16}))
    assert outcome.ok and outcome.value == {"uri": "m-render@3", "size": 16}
    native = execute(handlers, task("render@4", {"modelId": "m", "width": 1, "height": 2}))
    assert native.ok and native.value == {"uri": "m-render@4", "width": 1, "height": 2, "format": "webp"}


def test_the_runtime_reports_a_bad_adapter_output_as_a_permanent_failure() -> None:
    bad = bridge_with(downgrade_output=lambda new: {"uri": new.uri, "size": "large"})
    outcome = execute(
        {"render@3": getattr(bad, HANDLER_ATTRIBUTE)}, task("render@3", {"modelId": "m", "size": 16})
    )
    assert not outcome.ok and not outcome.retryable
    assert outcome.value.startswith("ContractViolation: adapter render@3 <- render@4: downgrade_output gave")
    assert "size: Input should be a valid integer" in outcome.value


def test_the_worker_registry_entry_names_the_adapters() -> None:
    handlers = {h.contract.ref: h for h in handlers_of(module(render_v4=render_v4, render_v3=render_v3))}
    serving = [("rendering", "render@3"), ("rendering", "render@4"), ("tasks.parallel", "render@4")]
    info = worker_info(handlers, serving, ("fake_render_app",))
    assert info.contracts == ["render@3", "render@4"]
    assert info.queues == ["rendering", "tasks.parallel"]
    assert dict(info.adapters) == {"render@3": "render@4"}
    assert info.apps == ("fake_render_app",)

"""The worker SDK's ``@action``/``@worker`` decorators, the contract registry, and contracts in plans."""

from __future__ import annotations

import json
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

import workers.demo
from orchestrator.compiler import compile_text
from orchestrator.contracts import (
    ACTIONS_QUEUE,
    CONTRACT_ATTRIBUTE,
    PARALLEL_QUEUE,
    Contract,
    ContractKind,
    Registry,
    split_ref,
    strip_annotations,
)
from orchestrator.errors import ContractError, ContractLoadError, ContractNotFound, SagaError
from tests.conftest import DEFINITIONS, DEMO_REGISTRY, compile_yaml
from workers.sdk import HANDLER_ATTRIBUTE, Handler, action, handlers_of, worker


class Ping(BaseModel):
    text: str


class Pong(BaseModel):
    text: str
    length: int


class PongV2(BaseModel):
    text: str
    length: int
    loud: bool


def contract(name: str = "ping.send", version: int = 1, **overrides: Any) -> Contract:
    values: dict[str, Any] = {
        "name": name,
        "version": version,
        "kind": ContractKind.ACTION,
        "queue": ACTIONS_QUEUE,
        "input_schema": Ping.model_json_schema(),
        "output_schema": Pong.model_json_schema(),
    }
    values.update(overrides)
    return Contract(**values)


ModuleWriter = Callable[[str, str], str]


@pytest.fixture
def write_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleWriter]:
    """Write ``<name>.py`` into tmp_path (on sys.path) and forget the imported modules afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    written: list[str] = []

    def write(name: str, source: str) -> str:
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source), encoding="utf-8")
        written.append(name)
        return name

    yield write
    for name in written:
        sys.modules.pop(name, None)


# ---- the decorators ---------------------------------------------------------------------------------


def test_action_attaches_a_contract_with_json_schemas_and_the_actions_queue() -> None:
    @action("ping.send", version=2, input=Ping, output=Pong, description="send a ping")
    def send(payload: Ping) -> Pong:
        return Pong(text=payload.text, length=len(payload.text))

    declared = getattr(send, CONTRACT_ATTRIBUTE)
    assert isinstance(declared, Contract)
    assert declared.ref == "ping.send@2"
    assert declared.kind is ContractKind.ACTION
    assert declared.queue == ACTIONS_QUEUE == "tasks.actions"
    # documentation keywords are stripped: rewording a docstring must not change the contract
    assert declared.input_schema == strip_annotations(Ping.model_json_schema())
    assert declared.output_schema == strip_annotations(Pong.model_json_schema())
    assert "title" not in json.dumps(declared.input_schema)
    assert declared.description == "send a ping"
    json.dumps(declared.input_schema)  # plain JSON

    handler = getattr(send, HANDLER_ATTRIBUTE)
    assert isinstance(handler, Handler)
    assert handler.contract is declared
    assert (handler.input_model, handler.output_model) == (Ping, Pong)
    assert handler.function is send
    assert not handler.is_async

    # the function is left as it was: same object, still callable
    assert send.__name__ == "send"
    assert send(Ping(text="abc")) == Pong(text="abc", length=3)


def test_worker_defaults_to_the_parallel_queue() -> None:
    @worker("ping.crunch", version=1, input=Ping, output=Pong)
    def crunch(payload: Ping) -> Pong:
        return Pong(text=payload.text, length=0)

    declared = getattr(crunch, CONTRACT_ATTRIBUTE)
    assert declared.kind is ContractKind.WORKER
    assert declared.queue == PARALLEL_QUEUE == "tasks.parallel"
    assert crunch(Ping(text="x")).length == 0


@pytest.mark.parametrize("decorator", [action, worker])
def test_the_default_queue_can_be_overridden(decorator: Any) -> None:
    @decorator("ping.special", version=1, input=Ping, output=Pong, queue="special-pool.v2")
    def special(payload: Ping) -> Pong:
        raise NotImplementedError

    assert getattr(special, CONTRACT_ATTRIBUTE).queue == "special-pool.v2"


def test_async_handlers_are_recognised() -> None:
    @action("ping.later", version=1, input=Ping, output=Pong)
    async def later(payload: Ping) -> Pong:
        return Pong(text=payload.text, length=1)

    assert getattr(later, HANDLER_ATTRIBUTE).is_async


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("input", dict),
        ("input", Ping(text="an instance")),
        ("input", None),
        ("output", int),
        ("output", "Pong"),
    ],
)
@pytest.mark.parametrize("decorator", [action, worker])
def test_non_pydantic_models_are_refused(decorator: Any, field: str, value: Any) -> None:
    models: dict[str, Any] = {"input": Ping, "output": Pong, field: value}
    with pytest.raises(ContractError, match=rf"ping\.send@1: {field}= must be a pydantic model class"):
        decorator("ping.send", version=1, **models)


@pytest.mark.parametrize(
    ("name", "version"),
    [
        ("Ping.Send", 1),
        ("", 1),
        ("1ping", 1),
        ("ping send", 1),
        ("ping@send", 1),
        ("p" * 129, 1),
        ("ping.send", 0),
        ("ping.send", -1),
        ("ping.send", 1_000_000),
    ],
)
def test_invalid_names_and_versions_are_refused(name: str, version: int) -> None:
    with pytest.raises(ContractError, match="invalid contract declaration"):
        action(name, version=version, input=Ping, output=Pong)


@pytest.mark.parametrize("queue", ["", "Bad Queue", "UPPER", "queue!", "q" * 129])
def test_invalid_queue_names_are_refused(queue: str) -> None:
    with pytest.raises(ContractError, match=r"invalid contract declaration ping\.send@1"):
        worker("ping.send", version=1, input=Ping, output=Pong, queue=queue)


def test_contract_errors_are_saga_errors() -> None:
    assert issubclass(ContractError, SagaError)
    assert issubclass(ContractNotFound, ContractError)
    assert issubclass(ContractLoadError, SagaError)


def test_handlers_of_lists_decorated_functions_sorted_by_ref() -> None:
    refs = [h.contract.ref for h in handlers_of(workers.demo)]
    assert refs == DEMO_REGISTRY.refs()
    assert len(refs) == 11


# ---- the registry -----------------------------------------------------------------------------------


def test_registry_is_keyed_and_sorted_by_ref() -> None:
    registry = Registry([contract("zeta.op"), contract("alpha.op", 3), contract("alpha.op", 12)])
    assert registry.refs() == ["alpha.op@12", "alpha.op@3", "zeta.op@1"]  # sorted as strings
    assert len(registry) == 3
    assert "alpha.op@3" in registry
    assert "alpha.op@4" not in registry
    assert registry.get("zeta.op@1") == contract("zeta.op")
    assert registry.get("zeta.op@2") is None
    assert registry.require("alpha.op@3").version == 3
    assert split_ref("alpha.op@12") == ("alpha.op", 12)


def test_identical_duplicate_declarations_are_accepted() -> None:
    registry = Registry([contract(), contract(), contract("other.op")])
    assert registry.refs() == ["other.op@1", "ping.send@1"]


@pytest.mark.parametrize(
    "changed",
    [
        {"output_schema": PongV2.model_json_schema()},
        {"input_schema": Pong.model_json_schema()},
        {"queue": "elsewhere"},
        {"kind": ContractKind.WORKER},
    ],
    ids=["output-schema", "input-schema", "queue", "kind"],
)
def test_the_same_ref_declared_differently_is_refused(changed: dict[str, Any]) -> None:
    with pytest.raises(ContractError) as caught:
        Registry([contract(), contract(**changed)])
    message = str(caught.value)
    assert "ping.send@1" in message
    assert "declared twice" in message
    assert "new version" in message  # tells the author to bump the version


def test_a_changed_contract_under_a_new_version_is_accepted() -> None:
    registry = Registry([contract(version=1), contract(version=2, output_schema=PongV2.model_json_schema())])
    assert registry.refs() == ["ping.send@1", "ping.send@2"]


def test_contract_not_found_lists_the_registered_refs() -> None:
    with pytest.raises(ContractNotFound) as caught:
        DEMO_REGISTRY.require("thumbnail.render@9")
    assert caught.value.ref == "thumbnail.render@9"
    message = str(caught.value)
    assert "'thumbnail.render@9' is not registered" in message
    for ref in DEMO_REGISTRY.refs():
        assert ref in message
    assert "--contracts" in message


def test_contract_not_found_in_an_empty_registry() -> None:
    with pytest.raises(ContractNotFound, match="none are loaded"):
        Registry().require("ping.send@1")


@pytest.mark.parametrize(
    "registry",
    [DEMO_REGISTRY, Registry(), Registry([contract(description="described"), contract("b.op", 4)])],
    ids=["demo", "empty", "custom"],
)
def test_json_round_trip(registry: Registry) -> None:
    text = registry.to_json()
    data = json.loads(text)
    assert list(data) == ["contracts"]
    assert [f"{c['name']}@{c['version']}" for c in data["contracts"]] == registry.refs()
    again = Registry.from_json(text)
    assert again.contracts() == registry.contracts()
    assert again.to_json() == text


def test_from_json_validates_contracts() -> None:
    data = json.loads(Registry([contract()]).to_json())
    data["contracts"][0]["queue"] = "Not A Queue"
    with pytest.raises(ValueError, match="queue"):
        Registry.from_json(json.dumps(data))


def test_from_modules_collects_the_demo_handlers() -> None:
    registry = Registry.from_modules(["workers.demo"])
    assert registry.contracts() == DEMO_REGISTRY.contracts()
    assert {c.kind for c in registry.contracts()} == {ContractKind.ACTION, ContractKind.WORKER}


def test_from_modules_collects_handlers_from_several_modules(write_module: ModuleWriter) -> None:
    name = write_module(
        "saga_test_extra_handlers",
        """
        from pydantic import BaseModel

        from workers.sdk import action, worker


        class In(BaseModel):
            x: int


        class Out(BaseModel):
            y: int


        @action("extra.add", version=1, input=In, output=Out)
        def add(payload: In) -> Out:
            return Out(y=payload.x + 1)


        @worker("extra.mul", version=2, input=In, output=Out, queue="math")
        def mul(payload: In) -> Out:
            return Out(y=payload.x * 2)


        def not_a_handler() -> None:
            pass
        """,
    )
    registry = Registry.from_modules([name, "workers.demo", name])  # a repeat is an identical duplicate
    assert registry.refs() == sorted([*DEMO_REGISTRY.refs(), "extra.add@1", "extra.mul@2"])
    assert registry.require("extra.mul@2").queue == "math"
    assert registry.require("extra.add@1").queue == ACTIONS_QUEUE


def test_from_modules_without_handlers_names_the_module(write_module: ModuleWriter) -> None:
    name = write_module("saga_test_no_handlers", '"""Nothing declared here."""\n\nVALUE = 1\n')
    with pytest.raises(ContractLoadError) as caught:
        Registry.from_modules(["workers.demo", name])
    assert caught.value.module == name
    assert f"module {name!r}" in str(caught.value)
    assert "declares no @action or @worker handlers" in str(caught.value)


def test_from_modules_that_fails_to_import_names_the_module(write_module: ModuleWriter) -> None:
    name = write_module("saga_test_broken_handlers", "raise RuntimeError('boom at import')\n")
    with pytest.raises(ContractLoadError) as caught:
        Registry.from_modules([name])
    assert caught.value.module == name
    assert "RuntimeError: boom at import" in str(caught.value)


def test_from_modules_with_a_missing_module_names_it() -> None:
    with pytest.raises(ContractLoadError) as caught:
        Registry.from_modules(["saga_test_no_such_module_anywhere"])
    assert caught.value.module == "saga_test_no_such_module_anywhere"
    assert "ModuleNotFoundError" in str(caught.value)


def test_from_modules_refuses_conflicting_declarations(write_module: ModuleWriter) -> None:
    name = write_module(
        "saga_test_conflicting_handlers",
        """
        from workers.demo.models import ModelRef, RenderOutput
        from workers.sdk import action


        @action("cache.lookup", version=1, input=ModelRef, output=RenderOutput)
        def lookup(payload: ModelRef) -> RenderOutput:
            return RenderOutput(thumbnailUri="x")
        """,
    )
    with pytest.raises(ContractError, match=r"cache\.lookup@1 .*new version"):
        Registry.from_modules(["workers.demo", name])


# ---- contracts in compiled plans --------------------------------------------------------------------

WORKER_STAGE = """\
name: queues
version: "1"
entry: render
stages:
  - name: render
    type: worker
    worker: thumbnail.render@3
    {queue}
    input: {{ modelId: "m-1" }}
    on_success: completed
"""


def test_the_contract_default_queue_is_used_when_a_stage_names_none() -> None:
    plan = compile_yaml(WORKER_STAGE.format(queue="")).plan
    assert plan["stages"]["render"]["queue"] == "rendering"


def test_a_stage_queue_overrides_the_contract_default_queue() -> None:
    plan = compile_yaml(WORKER_STAGE.format(queue="queue: tasks.gpu-renderers")).plan
    assert plan["stages"]["render"]["queue"] == "tasks.gpu-renderers"
    # the contract itself is unchanged in the plan
    assert plan["contracts"]["thumbnail.render@3"]["queue"] == "rendering"


def test_queue_override_changes_the_digest() -> None:
    default = compile_yaml(WORKER_STAGE.format(queue=""))
    explicit_default = compile_yaml(WORKER_STAGE.format(queue="queue: rendering"))
    other = compile_yaml(WORKER_STAGE.format(queue="queue: tasks.gpu-renderers"))
    assert default.digest == explicit_default.digest  # defaults are filled in: same meaning, same digest
    assert default.digest != other.digest


def test_thumbnail_batch_runs_its_map_on_the_parallel_queue() -> None:
    plan = compile_text((DEFINITIONS / "thumbnail-batch.yaml").read_bytes(), "x.yaml", DEMO_REGISTRY).plan
    assert plan["stages"]["render-all"]["queue"] == "tasks.parallel"
    assert plan["contracts"]["thumbnail.render@3"]["queue"] == "rendering"


def _plan(definition: str) -> dict[str, Any]:
    return compile_text((DEFINITIONS / definition).read_bytes(), definition, DEMO_REGISTRY).plan


def test_model_ingest_plan_holds_exactly_the_contracts_it_uses() -> None:
    plan = _plan("model-ingest.yaml")
    assert list(plan["contracts"]) == [
        "audit.run-terminal@1",
        "cache.lookup@1",
        "catalogue.publish@2",
        "metadata.extract@2",
        "semantic.analyse@4",
        "thumbnail.discard@1",
        "thumbnail.render@3",
    ]
    for ref, data in plan["contracts"].items():
        assert data == DEMO_REGISTRY.require(ref).model_dump(mode="json", exclude={"description"})
    # the stage queues come from these contracts unless overridden
    assert {name: s["queue"] for name, s in plan["stages"].items() if "queue" in s} == {
        "cache-lookup": "tasks.actions",
        "render-thumbnail": "rendering",
        "semantic-analysis": "analysis",
        "technical-metadata": "metadata",
        "publish": "tasks.actions",
    }


@pytest.mark.parametrize(
    ("definition", "refs"),
    [
        ("ingest-triage.yaml", []),
        (
            "catalogue-reindex.yaml",
            ["audit.run-terminal@1", "index.rebuild@1", "index.snapshot@1", "index.swap@1"],
        ),
        ("thumbnail-batch.yaml", ["audit.run-terminal@1", "thumbnail.render@3"]),
    ],
)
def test_other_plans_hold_exactly_the_contracts_they_use(definition: str, refs: list[str]) -> None:
    assert list(_plan(definition)["contracts"]) == refs


def test_a_compensation_contract_is_part_of_the_plan() -> None:
    plan = compile_yaml(
        """\
        name: publish-once
        version: "1"
        entry: publish
        stages:
          - name: publish
            type: action
            action: catalogue.publish@2
            compensate: catalogue.unpublish@1
            input: { modelId: "m-1" }
            on_success: completed
        """
    ).plan
    assert list(plan["contracts"]) == ["catalogue.publish@2", "catalogue.unpublish@1"]


def test_contract_descriptions_do_not_change_the_digest() -> None:
    text = (DEFINITIONS / "model-ingest.yaml").read_bytes()
    redescribed = Registry(
        c.model_copy(update={"description": f"reworded: {c.ref}"}) for c in DEMO_REGISTRY.contracts()
    )
    a = compile_text(text, "a.yaml", DEMO_REGISTRY)
    b = compile_text(text, "a.yaml", redescribed)
    assert a.digest == b.digest
    assert all("description" not in c for c in a.plan["contracts"].values())


def test_strip_annotations_keeps_a_property_named_like_an_annotation() -> None:
    schema = {
        "title": "T",
        "description": "doc",
        "type": "object",
        "properties": {"title": {"type": "string", "title": "Title"}, "description": {"type": "integer"}},
        "$defs": {"X": {"title": "X", "enum": ["title"]}},
    }
    assert strip_annotations(schema) == {
        "type": "object",
        "properties": {"title": {"type": "string"}, "description": {"type": "integer"}},
        "$defs": {"X": {"enum": ["title"]}},
    }

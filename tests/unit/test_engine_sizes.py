"""Size amplification: every message a run causes fits what its reader accepts, or the run fails with the
reason at the first step that would send one that does not.

A message that grows from the one before it (a context bound twice into an input, a result bound into the
next input, a compensation carrying a stage's input and result, a bag's results in the run's output) must
never be committed when its reader would refuse it unread: the run would wait for an answer that cannot
come. Hypothesis drives every example definition with contexts near a small message limit (multi-byte
characters included, as sizes are UTF-8 bytes) and failures in any stage, and checks each published
message against the limit both as the engine measured it and as the publisher really encodes it.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from orchestrator.bus.envelope import Signer, signed_message
from orchestrator.bus.publisher import message_bytes
from orchestrator.client import ActivePlan, StartRefused, checked_start
from orchestrator.engine import door
from orchestrator.engine.model import Nudge, RunSnapshot, RunStatus, StageStatus
from orchestrator.settings import Settings
from orchestrator.wire import bodies, sizes
from tests.conftest import compile_yaml
from tests.unit.engine_sim import Sim, report
from tests.unit.redrive_cases import compiled, drive, in_order

LIMITS = sizes.Limits(max_message_bytes=16_384)  # the smallest the settings allow
SIGNER = Signer.from_settings(("a-long-key-id-of-sixty-four-characters-which-is-the-most-allowed-x:s",))


def sized(max_chars: int) -> st.SearchStrategy[str]:
    """Text of 1 to ``max_chars`` letters of one to four UTF-8 bytes each."""
    letters = st.sampled_from("aé€😀")
    return st.integers(1, max_chars).flatmap(lambda n: st.text(letters, min_size=n, max_size=n))


CONTEXTS: dict[str, st.SearchStrategy[dict[str, Any]]] = {
    "model-ingest": st.builds(lambda m: {"modelId": m}, sized(6000)),
    "thumbnail-batch": st.builds(lambda ids: {"modelIds": ids}, st.lists(sized(1800), max_size=12)),
    "catalogue-reindex": st.builds(lambda i: {"index": i}, sized(6000)),
    "ingest-triage": st.builds(lambda f: {"sizeMb": 1, "format": f}, sized(6000)),
}


def fits_a_start(context: dict[str, Any]) -> bool:
    """What the shard's envelope check would let in: a start of at most the limit."""
    body = {"definition": "x" * 64, "digest": "sha256:" + "0" * 64, "context": context}
    return sizes.body_bytes(body) <= LIMITS.max_body_bytes


def run(name: str, context: dict[str, Any], failing: frozenset[str] = frozenset()) -> Sim:
    plan = compiled(name)
    sim = Sim(plan.plan, plan.digest, fail_stages=failing, limits=LIMITS)
    sim.start(context)
    drive(sim, in_order)
    return sim


def check_every_message_fits(sim: Sim, since: int = 0) -> None:
    """Every message published by the ``since``-th handled event and after fits ``LIMITS``."""
    for handled in sim.handled[since:]:
        for message in handled.published:
            assert sizes.body_bytes(message.body) <= LIMITS.max_body_bytes, message.message_id
            wire = message_bytes(message, SIGNER, 1_700_000_000_000)
            assert len(wire) <= LIMITS.max_message_bytes, (message.message_id, len(wire))


def refusals(sim: Sim) -> list[str]:
    """Every 'cannot be sent' the run recorded (a stage, compensation or finaliser that failed for it)."""
    return [json.dumps(h["detail"]) for h in sim.history if "cannot be sent" in json.dumps(h["detail"])]


@settings(max_examples=120, deadline=None)
@given(data=st.data(), name=st.sampled_from(sorted(CONTEXTS)))
def test_every_message_a_run_sends_fits_or_the_run_fails_at_the_step_with_the_reason(
    data: st.DataObject, name: str
) -> None:
    context = data.draw(CONTEXTS[name], label="context")
    assume(fits_a_start(context))
    work = [n for n, s in compiled(name).plan["stages"].items() if s["type"] in ("action", "worker", "map")]
    failing = frozenset(data.draw(st.sets(st.sampled_from(work)) if work else st.just(set()), label="fail"))
    sim = run(name, context, failing)

    # Then the run ended (nothing waits for a message that was never sent) ...
    assert sim.status in ("completed", "failed")
    assert not sim.store.timers and not sim.pending
    # ... and every message it sent fits, as measured and as encoded
    check_every_message_fits(sim)
    # a task that could not be sent failed its step with the reason, and the run says so
    stages_refused = [h for h in sim.history if h["detail"].get("reason") == "size"]
    if stages_refused:
        assert sim.status == "failed" and "cannot be sent" in sim.record["reason"]
    # a finished event too large carries no output, but says where to read it
    (event,) = sim.finished
    if event.body.get("output_omitted"):
        assert event.body["output"] is None and sim.output is not None


@settings(max_examples=60, deadline=None)
@given(model=sized(6000))
def test_a_start_whose_context_bound_inputs_cannot_fit_is_refused_at_the_door(model: str) -> None:
    context = {"modelId": model}
    assume(fits_a_start(context))
    plan = compiled("model-ingest")
    problems = door.start_problems(plan.typed, plan.digest, context, LIMITS)
    sim = run("model-ingest", context)
    settings_ = Settings(max_message_bytes=LIMITS.max_message_bytes)
    active = ActivePlan(plan.digest, "fast", plan.typed)
    # the client measures the tasks as they would be on the longest shard id of the class (the shard is
    # not known yet), so near the limit it may refuse a start the shard would take: never the reverse
    longest = RunSnapshot("run-1", "fast.99999", plan.digest, RunStatus.PENDING, context)
    client_problems = door.start_problems(plan.typed, plan.digest, context, LIMITS, longest)
    assert not problems or client_problems
    if problems:
        # the shard: the run fails at start with the reason, and no task is ever sent
        assert sim.status == "failed" and not sim.entries("stage.dispatched")
        assert all(p.startswith("stage ") and "cannot be sent" in p for p in problems)
        # the same stage, refused for its size (the byte count may differ by the run id's length: the door
        # measures with its own placeholder identity)
        stage = problems[0].split(": the task cannot be sent")[0]
        assert f"{stage}: the task cannot be sent" in sim.record["reason"]
    else:
        assert not any(h["detail"].get("reason") == "size" for h in sim.history[:3])
    if client_problems:
        # the client: refused before anything is published, with the problems it measured
        try:
            checked_start(SIGNER, settings_, active, "model-ingest", "run-1", context)
        except StartRefused as exc:
            assert exc.problems == client_problems
        else:
            raise AssertionError("the client sent a start the shard refuses")
    else:
        checked_start(SIGNER, settings_, active, "model-ingest", "run-1", context)
    check_every_message_fits(sim)


def test_a_compensation_too_large_to_send_fails_with_the_reason_and_the_rest_go_on() -> None:
    # render's input and result both carry the model id: the undo task carries both, about twice it
    model = "é" * 3800
    sim = run("model-ingest", {"modelId": model}, frozenset({"semantic-analysis"}))
    assert sim.record["s:render-thumbnail:status"] == "completed"  # not undone: its undo never left
    (failed,) = [h for h in sim.history if h["kind"] == "compensation.failed"]
    assert "its task cannot be sent" in failed["detail"]["error"]
    assert sim.record["compensation_failed"] == "1"
    assert sim.entries("finaliser.completed") and sim.status == "failed"
    check_every_message_fits(sim)


def test_a_result_too_large_to_send_is_reported_as_a_failure_that_says_so() -> None:
    big = bodies.result(True, {"blob": "€" * 6000}, LIMITS)
    assert big["ok"] is False and big["retryable"] is False
    assert big["error"].startswith("the result cannot be sent: its message would be 18,")
    small = bodies.result(True, {"blob": "€" * 100}, LIMITS)
    assert small == {"ok": True, "result": {"blob": "€" * 100}}
    error = bodies.result(False, "boom " * 100_000, LIMITS)
    assert sizes.body_bytes(error) < sizes.MAX_ERROR_CHARS + 200


def test_a_result_is_measured_as_the_publisher_writes_it() -> None:
    # 1e-05 is 5 bytes to the standard library and 7 ("0.00001") to the publisher's encoder: a body
    # measured the first way would fit here and reach its reader over the limit, refused unread
    floats = [1e-05] * (LIMITS.max_body_bytes // 6 - 10)
    assert len(json.dumps({"ok": True, "result": floats}, separators=(",", ":"))) <= LIMITS.max_body_bytes
    wire = signed_message(
        SIGNER, kind="result", message_id="m", run_id="r", body={"ok": True, "result": floats}
    )
    assert len(wire) > LIMITS.max_message_bytes  # as it would have been sent
    sent = bodies.result(True, floats, LIMITS)
    assert sent["ok"] is False and "over the" in sent["error"]


def test_a_text_without_a_utf8_form_is_refused_as_not_json() -> None:
    # a lone surrogate (what surrogateescape leaves of undecodable bytes) passes json.dumps alone
    sent = bodies.result(True, {"name": "\ud800"}, LIMITS)
    assert sent["ok"] is False and "not valid JSON" in sent["error"]


def test_an_output_too_large_for_the_finished_event_is_left_out_of_it_not_lost() -> None:
    # the output repeats the model id (model id, and the catalogue id made from it): twice the context
    sim = run("model-ingest", {"modelId": "é" * 3800})
    assert sim.status == "completed"
    (event,) = sim.finished
    assert event.body["output"] is None and "saga status" in event.body["output_omitted"]
    assert sim.output == {"modelId": "é" * 3800, "catalogueId": "cat-" + "é" * 3800}
    check_every_message_fits(sim)


def test_a_nudge_does_not_resend_a_task_that_no_longer_fits_it_fails_the_attempt() -> None:
    # Given a task sent under a larger limit, whose reader now refuses it (the limit was lowered)
    plan = compiled("model-ingest")
    sim = Sim(plan.plan, plan.digest)
    sim.start({"modelId": "é" * 8000})
    sim.deliver_at(0)  # the start: cache-lookup is dispatched
    (task,) = [d for d in sim.pending if d.kind == "task"]
    sim.pending.clear()  # ... and parked as oversized by the worker, so nothing will answer
    sim.limits = LIMITS
    # When the reconciler nudges the stranded run
    since = len(sim.handled)
    handled = sim.handle(Nudge("nudge-1"))
    # Then the task is not sent again; the attempt fails with the reason and the run ends
    assert task.task is not None and task.task.message_id not in {m.message_id for m in handled.published}
    assert sim.snapshot().stages["cache-lookup"].status is StageStatus.FAILED
    assert "cannot be sent" in sim.record["reason"]
    drive(sim, in_order)
    assert sim.status == "failed"
    check_every_message_fits(sim, since)


def test_error_texts_are_bounded_wherever_they_are_kept() -> None:
    plan = compiled("model-ingest")
    sim = Sim(plan.plan, plan.digest)
    sim.start({"modelId": "m-1"})
    sim.deliver_at(0)
    (task,) = [d.task for d in sim.pending if d.kind == "task"]
    assert task is not None
    sim.pending.clear()
    huge = "x" * 1_000_000
    sim.handle(
        report(sim.run_id, "cache-lookup", str(task.body["fence"]), False, error=huge, retryable=False)
    )
    drive(sim, in_order)
    assert sim.status == "failed"
    assert len(sim.record["reason"]) < sizes.MAX_ERROR_CHARS + 200
    assert all(len(json.dumps(h["detail"])) < sizes.MAX_ERROR_CHARS + 400 for h in sim.history)
    check_every_message_fits(sim)


def test_the_envelope_margin_covers_the_largest_legal_identity() -> None:
    """ENVELOPE_MARGIN_BYTES is what an envelope adds to its body; measured with every identity field at
    its largest, so a body that fits the measure always fits the wire."""
    body = {"x": "y"}
    wire = signed_message(
        SIGNER,
        kind="result",
        message_id="m" * 200,
        run_id="r" * 128,
        shard="s" * 32 + ".99999",
        stage="compensate:" + "s" * 64,
        attempt=2**31 - 1,
        fence="9" * 9 + ".c" + "9" * 9,
        item=2**31 - 1,
        digest="sha256:" + "0" * 64,
        contract="c" * 64 + "@" + "9" * 9,
        tenant="t" * 64,
        deadline_ms=2**53,
        issued_at_ms=2**53,
        body=body,
    )
    assert len(wire) - sizes.body_bytes(body) <= sizes.ENVELOPE_MARGIN_BYTES


# ---- the door walks what the context decides ---------------------------------------------------------

BY_REFERENCE = """
    name: by-reference
    version: "1.0.0"
    entry: route
    context:
      type: object
      properties: { blob: { type: string } }
      required: [blob]
    stages:
      - name: route
        type: decision
        branches:
          - when: "size(context.blob) > 1000"
            next: store-reference
          - when: "true"
            next: inline
      - name: store-reference
        type: action
        action: cache.lookup@1
        input: { modelId: "ref" }
        on_success: completed
      - name: inline
        type: action
        action: cache.lookup@1
        input: { modelId: "${context.blob}" }
        on_success: completed
"""
AMPLIFY = """
    name: amplify
    version: "1.0.0"
    entry: look
    stages:
      - name: look
        type: action
        action: cache.lookup@1
        input: { modelId: "${context.m}${context.m}${context.m}${context.m}${context.m}${context.m}" }
        on_success: completed
"""


def inline_run(yaml: str, context: dict[str, Any], limits: sizes.Limits = LIMITS) -> tuple[Sim, list[str]]:
    plan = compile_yaml(yaml)
    problems = door.start_problems(plan.typed, plan.digest, context, limits)
    sim = Sim(plan.plan, plan.digest, limits=limits)
    sim.start(context)
    drive(sim, in_order)
    return sim, problems


def test_the_door_follows_decisions_on_the_context_and_checks_only_what_is_reached() -> None:
    # a large blob goes by reference: the inline stage (too big for it) is never reached, nor refused
    sim, problems = inline_run(BY_REFERENCE, {"blob": "b" * 20_000})
    assert problems == [] and sim.status == "completed"
    assert [t.body["stage"] for t in sim.tasks] == ["store-reference"]


def test_the_door_measures_even_a_small_context_that_an_input_repeats() -> None:
    sim, problems = inline_run(AMPLIFY, {"m": "m" * 2_500})  # 2.5 KB, sent six times in one input
    assert problems and problems[0].startswith("stage look: the task cannot be sent")
    assert sim.status == "failed" and not sim.entries("stage.dispatched")
    assert sim.record["reason"].startswith("stage look: the task cannot be sent")


# ---- what one transition sends in all ------------------------------------------------------------------


def test_a_bag_whose_tasks_together_are_over_the_transition_limit_fails_to_start_with_why() -> None:
    limits = sizes.Limits(16_384, 100_000)
    plan = compiled("thumbnail-batch")
    sim = Sim(plan.plan, plan.digest, limits=limits)
    sim.start({"modelIds": [f"{i}-" + "m" * 1000 for i in range(120)]})  # 120 tasks of ~1.5 KB
    drive(sim, in_order)
    assert sim.status == "failed" and not sim.entries("stage.dispatched")
    assert "tasks together are over the 100,000-byte limit" in sim.record["reason"]
    assert "SAGA_MAX_TRANSITION_BYTES" in sim.record["reason"]


def test_a_bag_whose_results_together_are_over_the_transition_limit_fails_at_its_release() -> None:
    # the tasks went out under a larger limit; the results, read back at the release, are over this one
    plan = compiled("thumbnail-batch")
    sim = Sim(plan.plan, plan.digest)
    sim.start({"modelIds": [f"{i}-" + "m" * 250 for i in range(100)]})  # results ~28 KB in all
    sim.deliver_at(0)
    sim.limits = sizes.Limits(16_384, 20_000)
    drive(sim, in_order)
    assert sim.status == "failed"
    assert "item results together are over the 20,000-byte limit" in sim.record["reason"]
    assert not sim.entries("stage.completed", "render-all")


# ---- a nudge re-sends a bag's missing items ------------------------------------------------------------


def test_a_nudge_re_sends_only_the_items_of_a_bag_that_have_not_arrived() -> None:
    plan = compiled("thumbnail-batch")
    sim = Sim(plan.plan, plan.digest)
    sim.start({"modelIds": ["a", "b", "c", "d"]})
    sim.deliver_at(0)
    sim.deliver_task("render-all", 0)
    sim.deliver_task("render-all", 2)
    lost = {d.item for d in sim.pending}
    sim.pending.clear()  # items 1 and 3 vanished with their queue
    handled = sim.handle(Nudge("nudge-1"))
    assert lost == {1, 3} and sorted(m.body["item"] for m in handled.published) == [1, 3]
    drive(sim, in_order)
    assert sim.status == "completed" and len(sim.output["thumbnails"]) == 4


def test_a_nudge_fails_a_bag_whose_missing_item_can_no_longer_be_sent() -> None:
    plan = compiled("thumbnail-batch")
    sim = Sim(plan.plan, plan.digest)
    sim.start({"modelIds": ["a", "b" * 20_000]})
    sim.deliver_at(0)
    sim.deliver_task("render-all", 0)
    sim.pending.clear()
    sim.limits = LIMITS  # the limit was lowered: item 1's task no longer fits
    since = len(sim.handled)
    sim.handle(Nudge("nudge-1"))
    assert sim.record["s:render-all:status"] == "failed"
    assert "the task of item 1 cannot be sent" in sim.record["reason"]
    drive(sim, in_order)
    assert sim.status == "failed"
    check_every_message_fits(sim, since)


# ---- what is not JSON does not travel ------------------------------------------------------------------


def test_a_result_that_is_not_json_is_reported_as_a_failure_that_says_so() -> None:
    body = bodies.result(True, {"score": float("nan")}, LIMITS)
    assert body["ok"] is False and body["retryable"] is False
    assert "not valid JSON" in body["error"]


def test_the_client_refuses_a_context_that_is_not_json() -> None:
    plan = compiled("model-ingest")
    active = ActivePlan(plan.digest, "fast", plan.typed)
    settings_ = Settings(max_message_bytes=LIMITS.max_message_bytes)
    try:
        checked_start(SIGNER, settings_, active, "model-ingest", "run-1", {"modelId": "m", "x": float("inf")})
    except StartRefused as exc:
        assert "not valid JSON" in exc.problems[0]
    else:
        raise AssertionError("a context with Infinity was sent")


GUARDED = """
    name: guarded
    version: "1.0.0"
    entry: look
    stages:
      - name: look
        type: action
        action: cache.lookup@1
        input: { modelId: "m" }
        on_success: route
      - name: route
        type: decision
        branches:
          - when: 'has(stages.look) && stages["look"].result.hit == false'
            next: completed
          - when: "true"
            next: big
      - name: big
        type: action
        action: cache.lookup@1
        input: { modelId: "${context.blob}" }
        on_success: completed
"""


def test_the_door_stops_at_a_decision_that_reads_a_stage_even_behind_has() -> None:
    """``has(stages.look)`` is false before any stage ran, not an error: the door must not take the
    fallback as the route and refuse a start for a stage only a worker's answer could reach."""
    sim, problems = inline_run(GUARDED, {"blob": "b" * 20_000})
    assert problems == [] and sim.status == "completed"
    assert [t.body["stage"] for t in sim.tasks] == ["look"]


def test_the_client_checks_a_context_as_the_shard_will_read_it() -> None:
    """A tuple travels as a JSON list: the client checks the list, or it would refuse (schema) or accept
    (sizes) what the shard decides otherwise."""
    plan = compiled("thumbnail-batch")
    active = ActivePlan(plan.digest, "fast", plan.typed)
    settings_ = Settings(max_transition_bytes=1_048_576)
    checked_start(SIGNER, settings_, active, "thumbnail-batch", "run-1", {"modelIds": ("a", "b")})
    # a window of 1,000 tasks ~1.6 MB: over the transition limit (a bag sends a window at once)
    many = {"modelIds": tuple(f"{i}-" + "m" * 1_100 for i in range(1_500))}
    listed = {"modelIds": list(many["modelIds"])}
    shard = door.start_problems(plan.typed, plan.digest, listed, settings_.limits())
    try:
        checked_start(SIGNER, settings_, active, "thumbnail-batch", "run-1", many)
    except StartRefused as exc:
        assert shard and [p.split(":")[0] for p in exc.problems] == [p.split(":")[0] for p in shard]
    else:
        raise AssertionError("the client accepted what the shard refuses")


def test_a_nudge_that_fails_a_stage_sends_nothing_else_in_that_transition() -> None:
    """The failure may end the run (cancelling the rest): a task re-sent beside it would run for a run
    that already failed. A later nudge re-sends what is left, if the run goes on."""
    plan = compiled("model-ingest")
    sim = Sim(plan.plan, plan.digest)
    sim.start({"modelId": "m" * 50_000})
    sim.deliver_at(0)
    sim.deliver_task("cache-lookup")
    sim.deliver_task("render-thumbnail")
    tasks = {d.stage: d.task for d in sim.pending if d.kind == "task"}
    assert sorted(tasks) == ["semantic-analysis", "technical-metadata"]
    sim.pending.clear()
    # the limit was lowered to between the two tasks' sizes: the first (by name) fits, the second not
    fits = sizes.body_bytes(tasks["semantic-analysis"].body)  # type: ignore[union-attr]
    assert sizes.body_bytes(tasks["technical-metadata"].body) > fits  # type: ignore[union-attr]
    sim.limits = sizes.Limits(fits + sizes.ENVELOPE_MARGIN_BYTES)
    handled = sim.handle(Nudge("nudge-1"))
    published = [(m.kind, m.body.get("stage")) for m in handled.published]
    assert ("task", "semantic-analysis") not in published and ("cancel", "semantic-analysis") in published
    assert sim.record["s:technical-metadata:status"] == "failed"


INFINITE_OUTPUT = """
    name: infinite-output
    version: "1.0.0"
    entry: look
    output:
      ratio: "${1.0 / 0.0}"
    stages:
      - name: look
        type: action
        action: cache.lookup@1
        input: { modelId: "m" }
        on_success: completed
"""


def test_a_value_that_is_not_json_never_travels_the_event_says_why_it_left_it_out() -> None:
    """CEL can compute infinity; JSON cannot carry it (a reader's re-serialisation would break the
    signature), so the finished event leaves the output out and says why, like one too large."""
    sim, _ = inline_run(INFINITE_OUTPUT, {})
    assert sim.status == "completed"
    (event,) = sim.finished
    assert event.body["output"] is None and "not valid JSON" in event.body["output_omitted"]
    assert sizes.too_big({"x": float("nan")}, LIMITS) is not None


DOUBLES_A_RESULT = """
    name: doubles-a-result
    version: "1.0.0"
    entry: a
    stages:
      - name: a
        type: action
        action: cache.lookup@1
        input: { modelId: "${context.m}" }
        on_success: b
      - name: b
        type: action
        action: catalogue.publish@2
        input: { modelId: '${stages["a"].result.modelId}${stages["a"].result.modelId}' }
        on_success: completed
"""


def test_a_task_that_cannot_be_sent_fails_its_stage_at_dispatch_and_says_it_was_the_size() -> None:
    """The door checks what the context alone decides; a task bound from a stage result is measured
    when its stage is dispatched, and the stage fails there, recorded as a size failure."""
    sim, problems = inline_run(DOUBLES_A_RESULT, {"m": "m" * 8_000})
    assert problems == [] and sim.status == "failed"
    (failed,) = sim.entries("stage.failed", "b")
    assert failed["detail"]["reason"] == "size" and "the task cannot be sent" in failed["detail"]["error"]

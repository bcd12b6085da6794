"""The web console in chromium, on a real stack: signing in (an HttpOnly, SameSite=Strict cookie; changing
requests need the console's header), a run's plan graph turning its stages completed live, a failed run's
stage and reason, a re-drive and a cancel from the page by an operator, a viewer who is shown no such
buttons, the runs list updating live, a map's done/total, definitions with graph, diff and lifecycle, dead
letters and shards. Each page's screenshot is kept under .artifacts/console/."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
from playwright.sync_api import Page, expect

from orchestrator.auth.roles import Role
from orchestrator.bus.names import Names
from tests.browser.conftest import Console, off_loop, snapshot
from tests.integration.stack import ROOT, poll
from workers.demo.effects import demo_key

pytestmark = pytest.mark.services

MODEL_INGEST = (ROOT / "definitions" / "model-ingest.yaml").read_text()
# model-ingest's stages in an order each stage completes in after the ones before it (the analyses run in
# parallel: technical-metadata is the faster one in the tests)
PLAN_ORDER = [
    "cache-lookup",
    "cache-route",
    "render-thumbnail",
    "derive-fork",
    "technical-metadata",
    "semantic-analysis",
    "derive-join",
    "publish",
]

# Kept by every page the console loads (a MutationObserver installed before the page's scripts run):
# each change of a plan stage's data-state as [update, stage, state], where update counts the observer's
# calls: the changes one status document makes come in one call.
RECORDER = """
window.__transitions = [];
let update = 0;
new MutationObserver((records) => {
  update += 1;
  for (const r of records) {
    if (r.target.matches && r.target.matches("g.stage[data-stage]")) {
      window.__transitions.push([update, r.target.dataset.stage, r.target.dataset.state]);
    }
  }
}).observe(document, {subtree: true, attributes: true, attributeFilter: ["data-state"]});
"""


def stage(page: Page, name: str) -> Any:
    return page.locator(f'#graph g.stage[data-stage="{name}"]')


def stage_state(console: Console, run_id: str, name: str) -> str | None:
    found = console.state(run_id).get("stages", {}).get(name)
    return found["state"] if found else None


@pytest.fixture(scope="module")
def slow_run(console: Console) -> Iterator[str]:
    """A run whose thumbnail takes a minute to render: running while the tests look at it."""
    run_id = console.start("slow-1", {"thumbnail.render": {"delay_ms": 60_000}})
    poll(
        lambda: stage_state(console, run_id, "render-thumbnail") in ("dispatched", "running"),
        30,
        what="the slow run rendering",
    )
    yield run_id


def test_sign_in_keeps_the_token_in_a_strict_http_only_cookie_and_changes_need_the_console_header(
    console: Console,
) -> None:
    # Given a viewer signed in through the sign-in page
    page = console.sign_in(Role.VIEWER)
    (cookie,) = page.context.cookies()
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/"
    assert page.evaluate("document.cookie") == ""  # the page's scripts cannot read it
    # When the API is asked with the cookie alone
    who = page.request.get("/api/v1/whoami").json()
    # Then it answers as the token, with what its role may do
    assert who == {"name": "viewer-console", "role": "viewer", "tenant": "default", "actions": ["read"]}
    operator = console.sign_in(Role.OPERATOR)
    assert "cancel" in operator.request.get("/api/v1/whoami").json()["actions"]
    # and a changing request without X-Saga-Console is refused before anything else (CSRF defence)
    bare = operator.request.post("/api/v1/runs/nope/cancel", data={})
    assert bare.status == 403 and bare.json()["error"]["code"] == "console_header_missing"
    headed = operator.request.post("/api/v1/runs/nope/cancel", data={}, headers={"X-Saga-Console": "1"})
    assert headed.status == 404  # past authentication: the run is unknown
    # A wrong token is refused on the page, and signing out forgets the cookie
    stranger = console.context().new_page()
    stranger.goto("/console/sign-in")
    stranger.fill("#token", "saga_000000000000_" + "x" * 43)
    stranger.click("#sign-in-form button[type=submit]")
    expect(stranger.locator("#notice")).to_contain_text("unknown or revoked")
    snapshot(stranger, "sign-in")
    page.click("#sign-out")
    page.wait_for_url("**/console/sign-in")
    assert page.context.cookies() == []
    page.goto("/console/shards")
    page.wait_for_url("**/console/sign-in?next=%2Fconsole%2Fshards")


def test_a_viewer_sees_the_running_run_but_no_cancel_redrive_replay_or_lifecycle_buttons(
    console: Console, slow_run: str
) -> None:
    page = console.sign_in(Role.VIEWER)
    page.goto(f"/console/runs/{slow_run}")
    expect(stage(page, "render-thumbnail")).to_have_attribute("data-state", re.compile("dispatched|running"))
    expect(page.locator("#run-state")).to_have_attribute("data-state", "running")
    # not hidden: not in the page at all
    assert page.locator("#run-controls").count() == 0
    assert page.locator("button[data-verb]").count() == 0
    page.goto("/console/definitions/model-ingest")
    expect(page.locator('#versions tr[data-version="2.3.0"]')).to_be_visible()
    assert page.locator("#lifecycle").count() == 0 and page.locator("button[data-verb]").count() == 0
    page.goto("/console/dead-letters")
    expect(page.locator("section.queue").first).to_be_visible()
    assert page.locator("button.replay, button.replay-all").count() == 0


def test_an_operator_cancels_a_running_run_from_its_page_and_it_ends_failed_cancelled(
    console: Console, slow_run: str
) -> None:
    # Given an operator on the page of a running run
    page = console.sign_in(Role.OPERATOR)
    page.goto(f"/console/runs/{slow_run}")
    cancel = page.locator('button[data-verb="cancel"]')
    expect(cancel).to_be_enabled()
    expect(page.locator('button[data-verb="redrive"]')).to_be_disabled()
    # When they cancel it, with a reason
    page.fill("#run-action-reason", "not needed")
    cancel.click()
    page.click("#confirm-action")
    # Then the page shows it end failed, cancelled, and who asked
    expect(page.locator("#run-state")).to_have_attribute("data-state", "failed", timeout=30_000)
    expect(page.locator("#run-reason")).to_contain_text("cancelled: not needed")
    expect(page.locator('#history li[data-kind="cancel.requested"]')).to_contain_text("operator-console")
    expect(cancel).to_be_disabled()
    snapshot(page, "run-cancelled")
    assert console.state(slow_run)["reason"] == "cancelled: not needed"


def test_a_running_run_turns_its_stages_completed_in_order_without_a_reload(console: Console) -> None:
    # Given a run that renders for 2.5 s, then analyses for 1 s
    run_id = console.start(
        "live-1", {"thumbnail.render": {"delay_ms": 2500}, "semantic.analyse": {"delay_ms": 1000}}
    )
    poll(lambda: stage_state(console, run_id, "render-thumbnail"), 20, what="the render dispatched")
    # When a viewer opens its page while it renders
    page = console.sign_in(Role.VIEWER)
    page.add_init_script(RECORDER)
    page.goto(f"/console/runs/{run_id}")
    expect(stage(page, "cache-lookup")).to_have_attribute("data-state", "completed")
    assert stage(page, "render-thumbnail").get_attribute("data-state") in ("dispatched", "running")
    assert stage(page, "publish").get_attribute("data-state") == ""
    page.evaluate("window.__marker = 'the page as loaded'")
    snapshot(page, "run-running")
    # Then the stages turn completed in plan order, on the same page (no reload wiped the marker)
    expect(page.locator("#run-state")).to_have_attribute("data-state", "completed", timeout=30_000)
    assert page.evaluate("window.__marker") == "the page as loaded"
    transitions = page.evaluate("window.__transitions")
    completed = {name: update for update, name, state in reversed(transitions) if state == "completed"}
    at = [completed[name] for name in PLAN_ORDER]
    assert at == sorted(at), transitions  # none completed before one it follows in the plan
    # the page painted what had completed, then rendering, then the slower analysis completed live
    assert completed["cache-lookup"] < completed["render-thumbnail"] < completed["semantic-analysis"]
    assert completed["technical-metadata"] < completed["semantic-analysis"], transitions
    for name in PLAN_ORDER:
        expect(stage(page, name)).to_have_attribute("data-state", "completed")
    reached = page.locator('#graph g.terminal[data-state="reached"]')
    expect(reached).to_have_count(1)
    expect(reached).to_have_attribute("data-terminal", "completed")
    expect(page.locator("#run-output")).to_contain_text("cat-live-1")
    expect(page.locator('#history li[data-kind="run.completed"]')).to_have_count(1)
    expect(page.locator("#live")).to_have_attribute("data-live", "ended")
    snapshot(page, "run-completed")


def test_a_failed_run_shows_the_failed_stage_and_its_reason_and_an_operator_redrives_it(
    console: Console,
) -> None:
    # Given a run whose metadata extraction fails
    run_id = console.start("broken-1", {"metadata.extract": {"fail": True}})
    poll(lambda: console.state(run_id)["state"] == "failed", 30, what="the run failed")
    # When an operator opens it
    page = console.sign_in(Role.OPERATOR)
    page.goto(f"/console/runs/{run_id}")
    # Then the failed stage is marked, the undone one too, and the reason is shown
    expect(stage(page, "technical-metadata")).to_have_attribute("data-state", "failed")
    expect(stage(page, "render-thumbnail")).to_have_attribute("data-state", "compensated")
    expect(page.locator("#run-reason")).to_contain_text("technical-metadata")
    expect(page.locator('#stages tr[data-stage="technical-metadata"]')).to_contain_text(
        "injected failure of metadata.extract"
    )
    expect(page.locator('#graph g.terminal[data-state="reached"]')).to_have_attribute(
        "data-source", "technical-metadata"
    )
    snapshot(page, "run-failed")
    # and once the fault is fixed, re-driving it from the page completes it, live
    console.stack.redis.delete(demo_key(console.stack.prefix, "faults", "broken-1"))
    page.locator('button[data-verb="redrive"]').click()
    page.click("#confirm-action")
    expect(page.locator("#run-state")).to_have_attribute("data-state", "completed", timeout=30_000)
    expect(stage(page, "technical-metadata")).to_have_attribute("data-state", "completed")


def test_the_runs_list_filters_and_shows_new_runs_without_a_reload(console: Console) -> None:
    page = console.sign_in(Role.VIEWER)
    page.goto("/console/runs?definition=thumbnail-batch")
    expect(page.locator("#live")).to_have_attribute("data-live", "live")
    page.evaluate("window.__marker = 'the page as loaded'")
    # When a run of that definition starts (a map over four models)
    started = console.api(
        "POST",
        "/api/v1/runs",
        json={"definition": "thumbnail-batch", "context": {"modelIds": ["b-1", "b-2", "b-3", "b-4"]}},
    )
    assert started.status_code == 202, started.text
    run_id = started.json()["run_id"]
    # Then its row appears, and follows the run to completed
    row = page.locator(f'#runs tr[data-run="{run_id}"]')
    expect(row).to_have_attribute("data-state", "completed", timeout=30_000)
    assert page.evaluate("window.__marker") == "the page as loaded"
    assert set(page.locator("#runs tbody tr td:nth-child(2)").all_inner_texts()) == {"thumbnail-batch"}
    snapshot(page, "runs")
    # and the map stage on the run's page shows its items done out of the total
    row.locator("a").click()
    expect(page.locator('#graph text.progress[data-stage="render-all"]')).to_have_text("4/4")
    expect(page.locator('#stages tr[data-stage="render-all"]')).to_contain_text("4/4 items")
    snapshot(page, "run-map")
    # A state filter keeps only that state
    page.goto("/console/runs?state=failed")
    expect(page.locator("#runs tbody tr").first).to_be_visible()
    assert set(page.locator("#runs tbody tr").evaluate_all("rows => rows.map(r => r.dataset.state)")) == {
        "failed"
    }


def test_definitions_show_versions_graph_diff_and_lifecycle_buttons_for_approvers(console: Console) -> None:
    # Given a version 2.4.0 an author published
    source = MODEL_INGEST.replace('version: "2.3.0"', 'version: "2.4.0"').replace(
        "execution_deadline_ms: 300000", "execution_deadline_ms: 200000"
    )
    assert console.api("POST", "/api/v1/definitions", Role.AUTHOR, json={"source": source}).status_code == 201
    graph = console.api("GET", "/api/v1/definitions/model-ingest/versions/2.4.0/graph", Role.VIEWER)
    assert graph.headers["content-type"].startswith("image/svg+xml") and 'data-stage="publish"' in graph.text
    # When an approver opens the definition
    page = console.sign_in(Role.APPROVER)
    page.goto("/console/definitions")
    page.click('#definitions a:text("model-ingest")')
    new = page.locator('#versions tr[data-version="2.4.0"]')
    expect(new).to_have_attribute("data-state", "published")
    expect(new).to_contain_text("author-console")
    expect(page.locator("#active")).to_have_text("2.3.0")
    expect(page.locator('#graph g.stage[data-stage="render-thumbnail"]')).to_have_count(1)
    # Then the diff shows what changed, and approving from the page is recorded with their name
    page.select_option("#diff-from", "2.3.0")
    page.select_option("#diff-to", "2.4.0")
    page.click("#diff-form button")
    expect(page.locator("#diff")).to_contain_text("render-thumbnail")
    expect(page.locator("#diff")).to_contain_text("200000")
    page.fill("#lifecycle-reason", "looks right")
    new.locator('button[data-verb="approve"]').click()
    expect(new).to_have_attribute("data-state", "approved")
    expect(page.locator("#audit")).to_contain_text("approver-console")
    snapshot(page, "definition")
    page.goto("/console/definitions")
    snapshot(page, "definitions")


def test_dead_letters_offer_replay_to_operators_and_shards_show_their_load(console: Console) -> None:
    # Given a message the shard refuses (not an envelope at all)
    off_loop(lambda: console.stack.publish_raw(Names().runs_exchange, "fast.0", b"not json"))
    page = console.sign_in(Role.OPERATOR)

    def listed() -> bool:
        page.goto("/console/dead-letters")
        page.wait_for_selector("section.queue")
        return page.locator("section.queue tbody tr").count() > 0

    poll(listed, 30, interval_s=0.5, what="the refused message listed")
    snapshot(page, "dead-letters")
    # an operator may replay it (the shard refuses it again: it comes back)
    page.locator("section.queue tbody button.replay").first.click()
    expect(page.locator("#notice")).to_contain_text("replayed 1 message(s)")
    page.goto("/console/shards")
    fast = page.locator('#shards tr[data-shard="fast.0"]')
    expect(fast).to_be_visible()
    expect(page.locator("#map-version")).not_to_have_text("…")
    snapshot(page, "shards")

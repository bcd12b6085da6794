"""The HTTP API on the real services: ``saga server`` as a process, tokens of every role, runs and
definitions through it, 401 and 403 that say what is needed, revocation at once, the token's name in
audit records and run history, and a cursor that pages stably while runs keep starting."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from orchestrator.auth.roles import Role
from orchestrator.auth.tokens import TokenStore
from orchestrator.settings import redis_client
from tests.integration.served import Served, serving
from tests.integration.stack import ROOT, poll

pytestmark = pytest.mark.services

MODEL_INGEST = (ROOT / "definitions" / "model-ingest.yaml").read_text()


Api = Served


@pytest.fixture(scope="module")
def api() -> Iterator[Api]:
    with serving("server") as served:
        yield served


def test_no_token_is_401_and_a_role_that_may_not_is_403_naming_the_role(api: Api) -> None:
    refused = api.call("GET", "/api/v1/definitions", None)
    assert refused.status_code == 401
    assert refused.json()["error"]["code"] == "unauthenticated"
    assert "saga tokens create" in refused.json()["error"]["message"]
    bad = httpx.get(api.base + "/api/v1/runs", headers={"Authorization": "Bearer nope"}, timeout=10)
    assert bad.status_code == 401
    for role in Role:  # every role reads
        assert api.call("GET", "/api/v1/definitions", role).status_code == 200, role
    start = {"definition": "model-ingest", "context": {"modelId": "api-403"}}
    forbidden = api.call("POST", "/api/v1/runs", Role.VIEWER, json=start)
    assert forbidden.status_code == 403
    error = forbidden.json()["error"]
    assert error["code"] == "forbidden" and error["ids"]["needed"] == ["operator", "admin"]
    assert "operator" in error["message"] and "viewer" in error["message"]
    assert (
        api.call("POST", "/api/v1/definitions/model-ingest/retire", Role.OPERATOR, json={}).status_code == 403
    )


def test_an_operator_starts_watches_and_cancels_runs_named_in_history(api: Api) -> None:
    start = {"definition": "model-ingest", "context": {"modelId": "api-1"}, "idempotency_key": "api-1"}
    started = api.call("POST", "/api/v1/runs", Role.OPERATOR, json=start)
    assert started.status_code == 202, started.text
    run_id = started.json()["run_id"]
    assert api.call("POST", "/api/v1/runs", Role.OPERATOR, json=start).json()["run_id"] == run_id
    done = poll(
        lambda: (
            (r := api.call("GET", f"/api/v1/runs/{run_id}", Role.VIEWER).json())["state"] == "completed" and r
        ),
        60,
        what="the run completed",
    )
    assert done["output"] == {"modelId": "api-1", "catalogueId": "cat-api-1"}
    # the second start (same key, same run) is refused by the shard as a duplicate and recorded; it may
    # be taken after any of the run's steps, even after its end, since starts wait in their own queue
    events = poll(
        lambda: (
            (e := api.call("GET", f"/api/v1/runs/{run_id}/history", Role.VIEWER).json()["events"])
            and any(event["kind"] == "callback.rejected" for event in e)
            and e
        ),
        30,
        what="the second start recorded as a duplicate",
    )
    refused = [event for event in events if event["kind"] == "callback.rejected"]
    assert [(event["reason"], event["message_id"].startswith("start-")) for event in refused] == [
        ("duplicate", True)
    ], refused
    lived = [event["kind"] for event in events if event["kind"] != "callback.rejected"]
    assert lived[0] == "run.started" and lived[-1] == "run.completed", lived
    # a run that has ended cannot be cancelled: 409 with its state
    ended = api.call("POST", f"/api/v1/runs/{run_id}/cancel", Role.OPERATOR, json={"reason": "late"})
    assert ended.status_code == 409 and ended.json()["error"]["code"] == "cancel_refused"
    # a slow one can, and its history names the token
    api.stack.world.set_fault("api-slow", "thumbnail.render", delay_ms=5000)
    slow = api.call(
        "POST",
        "/api/v1/runs",
        Role.OPERATOR,
        json={**start, "context": {"modelId": "api-slow"}, "idempotency_key": "slow"},
    )
    slow_id = slow.json()["run_id"]
    poll(
        lambda: api.call("GET", f"/api/v1/runs/{slow_id}", Role.VIEWER).json().get("state") == "running",
        30,
        what="the slow run running",
    )
    cancel = api.call("POST", f"/api/v1/runs/{slow_id}/cancel", Role.OPERATOR, json={"reason": "not needed"})
    assert cancel.status_code == 202, cancel.text
    poll(
        lambda: api.call("GET", f"/api/v1/runs/{slow_id}", Role.VIEWER).json()["state"] == "failed",
        60,
        what="the cancelled run ended",
    )
    events = api.call("GET", f"/api/v1/runs/{slow_id}/history", Role.VIEWER).json()["events"]
    (requested,) = [e for e in events if e["kind"] == "cancel.requested"]
    assert requested["by"] == "operator-token"
    assert api.call("GET", "/api/v1/runs/nope", Role.VIEWER).status_code == 404


def test_an_author_publishes_an_approver_activates_and_the_audit_names_their_tokens(api: Api) -> None:
    source = MODEL_INGEST.replace('version: "2.3.0"', 'version: "2.9.0"').replace(
        "execution_deadline_ms: 300000", "execution_deadline_ms: 250000"
    )
    published = api.call("POST", "/api/v1/definitions", Role.AUTHOR, json={"source": source})
    assert published.status_code == 201, published.text
    assert published.json()["version"] == "2.9.0"
    conflict = api.call(
        "POST", "/api/v1/definitions", Role.AUTHOR, json={"source": source.replace("250000", "240000")}
    )
    assert conflict.status_code == 409 and conflict.json()["error"]["code"] == "version_exists"
    invalid = api.call(
        "POST", "/api/v1/definitions", Role.AUTHOR, json={"source": "name: [", "file": "x.yaml"}
    )
    assert invalid.status_code == 422 and invalid.json()["error"]["code"] == "definition_invalid"
    assert (
        api.call(
            "POST", "/api/v1/definitions/model-ingest/approve", Role.AUTHOR, json={"version": "2.9.0"}
        ).status_code
        == 403
    )
    approved = api.call(
        "POST", "/api/v1/definitions/model-ingest/approve", Role.APPROVER, json={"version": "2.9.0"}
    )
    assert approved.status_code == 200, approved.text
    refused = api.call(
        "POST", "/api/v1/definitions/model-ingest/retire", Role.APPROVER, json={"version": "2.3.0"}
    )
    assert refused.status_code == 409 and refused.json()["error"]["ids"]["reason"] == "version_active"
    shown = api.call("GET", "/api/v1/definitions/model-ingest", Role.VIEWER).json()
    actors = {(a["action"], a["version"]): a["actor"] for a in shown["audit"]}
    assert actors[("publish", "2.9.0")] == "author-token" and actors[("approve", "2.9.0")] == "approver-token"
    diff = api.call(
        "GET", "/api/v1/definitions/model-ingest/diff", Role.VIEWER, params={"v1": "2.3.0", "v2": "2.9.0"}
    )
    assert diff.json()["stages_changed"]["render-thumbnail"][0]["after"] == 250000
    unknown = api.call(
        "GET", "/api/v1/definitions/model-ingest/diff", Role.VIEWER, params={"v1": "2.3.0", "v2": "9.9.9"}
    )
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "version_not_found"
    assert "2.9.0" in unknown.json()["error"]["message"]  # it names the versions there are
    retired = api.call(
        "POST", "/api/v1/definitions/model-ingest/retire", Role.APPROVER, json={"version": "2.9.0"}
    )
    assert retired.status_code == 200


def test_listing_pages_with_a_stable_cursor_while_runs_keep_starting(api: Api) -> None:
    for i in range(12):
        api.call(
            "POST",
            "/api/v1/runs",
            Role.OPERATOR,
            json={"definition": "model-ingest", "context": {"modelId": f"page-{i}"}},
        )
    seen: list[str] = []
    cursor = None
    while True:
        params: dict[str, Any] = {"limit": 5, "definition": "model-ingest"}
        if cursor:
            params["cursor"] = cursor
        page = api.call("GET", "/api/v1/runs", Role.VIEWER, params=params).json()
        seen += [r["run_id"] for r in page["runs"]]
        # runs started meanwhile are newer than the cursor: they never shift a later page
        api.call(
            "POST",
            "/api/v1/runs",
            Role.OPERATOR,
            json={"definition": "model-ingest", "context": {"modelId": f"late-{len(seen)}"}},
        )
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert len(seen) == len(set(seen)) and len(seen) >= 12


def test_a_revoked_token_is_refused_at_once_and_openapi_is_served(api: Api) -> None:
    async def revoke() -> None:
        client = redis_client(api.stack.settings)
        try:
            await TokenStore(client, api.stack.prefix).revoke("viewer-token", actor="tests")
        finally:
            await client.aclose()

    assert api.call("GET", "/api/v1/runs", Role.VIEWER).status_code == 200
    asyncio.run(revoke())
    assert api.call("GET", "/api/v1/runs", Role.VIEWER).status_code == 401
    document = httpx.get(api.base + "/api/v1/openapi.json", timeout=10).json()
    assert "/api/v1/runs" in document["paths"] and "/api/v1/definitions/{name}/{verb}" in document["paths"]
    assert httpx.get(api.base + "/healthz", timeout=10).json() == {"status": "ok"}


def test_shards_dead_letters_and_tokens_have_their_api_twins(api: Api) -> None:
    # (reads as the author: the viewer's token was revoked by the test before)
    shards = api.call("GET", "/api/v1/shards", Role.AUTHOR).json()
    assert {s["shard"] for s in shards["shards"]} >= {"fast.0", "slow.0"} and shards["version"] >= 1
    assert api.call("POST", "/api/v1/shards/fast.0/drain", Role.APPROVER).status_code == 403
    unknown = api.call("POST", "/api/v1/shards/fast.99/drain", Role.OPERATOR)
    assert unknown.status_code in (404, 409) and "fast.99" in unknown.json()["error"]["message"]
    letters = api.call("GET", "/api/v1/dead-letters", Role.AUTHOR).json()
    assert all({"queue", "exists", "count", "messages"} <= set(q) for q in letters["queues"])
    assert any(q["queue"].endswith(".rejected") for q in letters["queues"])
    missing = api.call("GET", "/api/v1/dead-letters/no-such-id", Role.AUTHOR)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "message_not_found"
    assert api.call("POST", "/api/v1/dead-letters/replay", Role.AUTHOR, json={}).status_code == 403
    # purge: an operator's, naming a dead-letter queue or all of them, never by default
    assert api.call("POST", "/api/v1/dead-letters/purge", Role.AUTHOR, json={"all": True}).status_code == 403
    unnamed = api.call("POST", "/api/v1/dead-letters/purge", Role.OPERATOR, json={})
    assert unnamed.status_code == 422 and "'all': true" in unnamed.json()["error"]["message"]
    live = api.call("POST", "/api/v1/dead-letters/purge", Role.OPERATOR, json={"queue": "saga.shard.fast.0"})
    assert live.status_code == 400 and live.json()["error"]["code"] == "not_a_dead_letter_queue", live.text
    everything = api.call("POST", "/api/v1/dead-letters/purge", Role.OPERATOR, json={"all": True})
    assert everything.status_code == 200 and all(
        {"queue", "exists", "purged"} == set(q) for q in everything.json()["queues"]
    )
    for held in (q for q in everything.json()["queues"] if q["purged"]):  # each named in the log
        assert f"purged by operator-token: {held['purged']} from {held['queue']}" in api.stack.log("server")
    # tokens: an admin's, and nobody else's
    assert api.call("GET", "/api/v1/tokens", Role.OPERATOR).status_code == 403
    made = api.call("POST", "/api/v1/tokens", Role.ADMIN, json={"name": "ci-bot", "role": "viewer"})
    assert made.status_code == 201, made.text
    secret = made.json()["token"]
    assert (
        httpx.get(
            api.base + "/api/v1/runs", headers={"Authorization": f"Bearer {secret}"}, timeout=10
        ).status_code
        == 200
    )
    listed = api.call("GET", "/api/v1/tokens", Role.ADMIN)
    assert "ci-bot" in {t["name"] for t in listed.json()} and secret not in listed.text
    taken = api.call("POST", "/api/v1/tokens", Role.ADMIN, json={"name": "ci-bot", "role": "viewer"})
    assert taken.status_code == 409
    assert api.call("POST", "/api/v1/tokens/ci-bot/revoke", Role.ADMIN).status_code == 200
    assert (
        httpx.get(
            api.base + "/api/v1/runs", headers={"Authorization": f"Bearer {secret}"}, timeout=10
        ).status_code
        == 401
    )

"""``saga --server``: the CLI through the control-plane API. ``saga server`` runs beside an orchestrator and
a worker; the CLI processes get the server's URL and a token, and RabbitMQ and Redis URLs that lead
nowhere, so whatever they print came through the API. Their ``--json`` output is the direct path's."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator.auth.roles import Role
from tests.integration.own_redis import free_port
from tests.integration.served import Served, serving
from tests.integration.stack import ROOT, poll
from workers.demo.effects import demo_key

pytestmark = pytest.mark.services

#: Where the CLI's own RabbitMQ and Redis settings lead: nowhere (port 1 refuses at once).
NOWHERE = {
    "SAGA_REDIS_URL": "redis://127.0.0.1:1/0",
    "SAGA_AMQP_URL": "amqp://guest:guest@127.0.0.1:1/",
    "SAGA_REDIS_TIMEOUT_S": "0.5",
}


class Remote:
    """The CLI through a served stack: ``saga`` subprocesses given its URL and a token."""

    def __init__(self, served: Served) -> None:
        self.served = served
        self.stack = served.stack
        self.url = served.base
        self.tokens = served.tokens

    def saga(self, *args: str, role: Role = Role.OPERATOR) -> subprocess.CompletedProcess[str]:
        """``saga ARGS`` through the server, as ``role``'s token, unable to reach the services itself."""
        env = {**NOWHERE, "SAGA_SERVER_URL": self.url, "SAGA_TOKEN": self.tokens[role]}
        return self.stack.saga(*args, extra_env=env, timeout_s=60)

    def saga_json(self, *args: str, role: Role = Role.OPERATOR) -> Any:
        done = self.saga(*args, "--json", role=role)
        assert done.returncode == 0, (done.stdout, done.stderr)
        return json.loads(done.stdout)

    def api(self, method: str, path: str, **kwargs: Any) -> Any:
        answer = self.served.call(method, f"/api/v1{path}", Role.OPERATOR, **kwargs)
        assert answer.status_code < 300, answer.text
        return answer.json()

    def start(self, model_id: str) -> str:
        body = {"definition": "model-ingest", "context": {"modelId": model_id}}
        return str(self.api("POST", "/runs", json=body)["run_id"])

    def state(self, run_id: str) -> str | None:
        answer = self.served.call("GET", f"/api/v1/runs/{run_id}", Role.VIEWER)
        return answer.json()["state"] if answer.status_code == 200 else None


@pytest.fixture(scope="module")
def remote() -> Iterator[Remote]:
    with serving("cli-remote") as served:  # an orchestrator and a worker
        yield Remote(served)


def test_start_wait_status_and_history_go_through_the_api_and_print_what_the_direct_path_prints(
    remote: Remote,
) -> None:
    # Given a CLI that reaches only the server
    # When it starts a run and waits for it
    done = remote.saga_json("start", "model-ingest", "--context", '{"modelId": "rm-1"}', "--wait", "60")
    # Then the run completed, and the answer has the direct path's keys
    assert set(done) == {"run_id", "state", "output", "reason"}
    assert done["state"] == "completed" and done["output"]["catalogueId"] == "cat-rm-1"
    run_id = done["run_id"]
    status = remote.saga_json("status", run_id, role=Role.VIEWER)
    assert status["state"] == "completed" and status["order"][0] == "cache-lookup"
    # the same document as the direct path's (a finished run has no stage waiting for anything)
    direct = remote.stack.saga("status", run_id, "--json")
    assert direct.returncode == 0 and json.loads(direct.stdout) == status
    text = remote.saga("status", run_id, role=Role.VIEWER)
    assert text.returncode == 0 and text.stdout.startswith(f"{run_id}  model-ingest 2.3.0  completed")
    history = remote.saga_json("history", run_id, role=Role.VIEWER)
    assert history["run_id"] == run_id
    assert history["events"][0]["kind"] == "run.started" and history["events"][-1]["kind"] == "run.completed"
    waited = remote.saga_json("wait", run_id, role=Role.VIEWER)
    assert waited == {**{k: done[k] for k in ("run_id", "state", "output", "reason")}, "timed_out": False}
    # a run that is not there: the direct path's error, exit 1
    missing = remote.saga("status", "0" * 32, "--json", role=Role.VIEWER)
    assert missing.returncode == 1
    assert json.loads(missing.stdout)["error"]["code"] == "run_not_found"


def test_runs_page_with_the_cursor(remote: Remote) -> None:
    started = {remote.start(f"rm-page-{i}") for i in range(5)}
    poll(
        lambda: all(remote.state(r) for r in started), 30, what="the runs created on their shards"
    )  # a listing shows created runs
    first = remote.saga_json("runs", "--definition", "model-ingest", "--limit", "2", role=Role.VIEWER)
    assert len(first["runs"]) == 2 and first["next_cursor"]
    second = remote.saga_json(
        "runs", "--definition", "model-ingest", "--limit", "2", "--cursor", first["next_cursor"]
    )
    assert len(second["runs"]) == 2
    assert not {r["run_id"] for r in first["runs"]} & {r["run_id"] for r in second["runs"]}
    newest = [r["created_at"] for r in first["runs"] + second["runs"]]
    assert newest == sorted(newest, reverse=True)
    # the direct path gives the same page after the same cursor, in the same shape
    cursor = first["next_cursor"]
    done = remote.stack.saga(
        "runs", "--definition", "model-ingest", "--limit", "2", "--cursor", cursor, "--json"
    )
    assert done.returncode == 0, done.stderr
    direct = json.loads(done.stdout)
    assert [r["run_id"] for r in direct["runs"]] == [r["run_id"] for r in second["runs"]]
    assert direct["next_cursor"] == second["next_cursor"]
    assert [set(r) for r in direct["runs"]] == [set(r) for r in second["runs"]]


def test_cancel_and_redrive_through_the_api_name_the_token_in_history(remote: Remote) -> None:
    # Given a slow run
    remote.stack.world.set_fault("rm-slow", "thumbnail.render", delay_ms=5000)
    slow = remote.start("rm-slow")
    poll(lambda: remote.state(slow) == "running", 30, what="the slow run running")
    # When the CLI cancels it and waits
    cancelled = remote.saga_json("cancel", slow, "--reason", "not needed", "--wait", "30")
    # Then it ended failed, and its history names the operator's token
    assert cancelled["requested"] is True and cancelled["state"] == "failed"
    events = remote.saga_json("history", slow)["events"]
    (requested,) = [e for e in events if e["kind"] == "cancel.requested"]
    assert requested["by"] == "operator-token"
    # a run that has ended cannot be cancelled: exit 1, as the direct path
    again = remote.saga("cancel", slow)
    assert again.returncode == 1 and "cancel" in again.stderr
    # Given a run that failed, whose fault is then gone
    remote.stack.world.set_fault("rm-broken", "thumbnail.render", fail=True)
    broken = remote.start("rm-broken")
    poll(lambda: remote.state(broken) == "failed", 45, what="the broken run failed")
    remote.stack.redis.delete(demo_key(remote.stack.prefix, "faults", "rm-broken"))
    # When the CLI re-drives it, it reports the orchestrator's answer and the new epoch's end
    report = remote.saga_json("redrive", broken, "--wait", "30")
    (run,) = report["runs"]
    assert run["redriven"] and run["epoch"] == 2 and run["state"] == "completed", run
    redriven = [e for e in remote.saga_json("history", broken)["events"] if e["kind"] == "run.redriven"]
    assert redriven[0]["by"] == "operator-token"
    # a run that is not failed is refused with its state, as the direct path reports it
    refused = remote.saga("redrive", broken, "--json")
    assert refused.returncode == 1
    (run,) = json.loads(refused.stdout)["runs"]
    assert run["request"] is None and "completed" in run["refused"]


def test_definitions_publish_approve_and_list_through_the_api(remote: Remote, tmp_path: Path) -> None:
    source = (ROOT / "definitions" / "model-ingest.yaml").read_text()
    changed = source.replace('version: "2.3.0"', 'version: "2.8.0"').replace(
        "execution_deadline_ms: 300000", "execution_deadline_ms: 260000"
    )
    path = tmp_path / "model-ingest.yaml"
    path.write_text(changed)
    (row,) = remote.saga_json("definitions", "publish", str(path), role=Role.AUTHOR)
    assert row == {
        "file": str(path),
        "definition": "model-ingest",
        "version": "2.8.0",
        "digest": row["digest"],
        "state": "published",
        "changed": True,
    }
    # an author may not approve: exit 2, the role needed named
    denied = remote.saga("definitions", "approve", "model-ingest", "--version", "2.8.0", role=Role.AUTHOR)
    assert denied.returncode == 2 and "approver" in denied.stderr
    approved = remote.saga_json(
        "definitions", "approve", "model-ingest", "--version", "2.8.0", role=Role.APPROVER
    )
    assert approved["changed"] and approved["records"][0]["actor"] == "approver-token"
    listed = remote.saga_json("definitions", "list", "model-ingest", role=Role.VIEWER)
    mine = next(r for r in listed if r["version"] == "2.8.0")
    assert mine["state"] == "approved" and mine["published_by"] == "author-token"
    text = remote.saga("definitions", "diff", "model-ingest", "2.3.0", "2.8.0", role=Role.VIEWER)
    assert text.returncode == 0 and "260000" in text.stdout


def test_dead_letters_shards_and_tokens_through_the_api(remote: Remote) -> None:
    letters = remote.saga_json("dead-letters", "list", role=Role.VIEWER)
    assert letters["queues"] and all(
        {"queue", "exists", "count", "messages"} == set(q) for q in letters["queues"]
    )
    shards = remote.saga_json("shards", "list", role=Role.VIEWER)
    assert shards["version"] >= 1 and {s["shard"] for s in shards["shards"]} >= {"fast.0", "slow.0"}
    tokens = remote.saga_json("tokens", "list", role=Role.ADMIN)
    assert {t["name"] for t in tokens} >= {f"{role.value}-token" for role in Role}
    assert not any(secret in json.dumps(tokens) for secret in remote.tokens.values())
    # only an admin lists tokens
    denied = remote.saga("tokens", "list", role=Role.OPERATOR)
    assert denied.returncode == 2 and "admin" in denied.stderr


def test_refusals_say_what_is_wrong(remote: Remote) -> None:
    # a viewer's start is refused before anything starts, naming the role needed
    denied = remote.saga(
        "start", "model-ingest", "--context", '{"modelId": "rm-no"}', "--json", role=Role.VIEWER
    )
    assert denied.returncode == 2
    error = json.loads(denied.stdout)["error"]
    assert error["code"] == "forbidden" and "operator" in error["message"] and "viewer" in error["message"]
    # a server that cannot be reached: exit 2, naming the setting
    env = {**NOWHERE, "SAGA_SERVER_URL": f"http://127.0.0.1:{free_port()}", "SAGA_TOKEN": "x"}
    unreachable = remote.stack.saga("runs", extra_env=env)
    assert unreachable.returncode == 2 and "SAGA_SERVER_URL" in unreachable.stderr
    # no token: a usage error naming SAGA_TOKEN
    no_token = remote.stack.saga("--server", remote.url, "runs", extra_env={**NOWHERE, "SAGA_TOKEN": ""})
    assert no_token.returncode == 2 and "SAGA_TOKEN" in no_token.stderr
    # a command with no API twin refuses the server
    direct_only = remote.saga("reconcile")
    assert direct_only.returncode == 2 and "goes to RabbitMQ/Redis directly" in direct_only.stderr


def test_dead_letters_purge_through_the_api(remote: Remote) -> None:
    # Given a letter on the rejected queue
    rejected = remote.stack.settings.names().rejected_queue
    remote.stack.publish_raw("", rejected, b"not a message")
    poll(lambda: remote.stack.queue_depths().get(rejected) == 1, 10, what="the letter on the rejected queue")
    # A purge without --yes is refused before any request; one by a role that may not is refused by the API
    assert remote.saga("dead-letters", "purge", "--queue", rejected).returncode == 2
    denied = remote.saga("dead-letters", "purge", "--yes", "--queue", rejected, role=Role.APPROVER)
    assert denied.returncode == 2 and "operator" in denied.stderr
    assert remote.stack.queue_depths()[rejected] == 1
    # The operator's purge says how many went, as the direct path does, and they are gone
    done = remote.saga_json("dead-letters", "purge", "--yes", "--queue", rejected)
    assert done == {"queues": [{"queue": rejected, "exists": True, "purged": 1}]}
    # and the server's log names who purged what
    assert f"dead letters purged by operator-token: 1 from {rejected}" in remote.stack.log("server")
    poll(lambda: remote.stack.queue_depths()[rejected] == 0, 15, what="the rejected queue empty")

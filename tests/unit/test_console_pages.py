"""The web console's pure parts (``orchestrator/server/console.py``, ``console_api.py``, the cookie rules of
``server/auth.py``): templates escape what they are filled with, sign-in goes back to local paths only,
what each role is shown, the server-sent event format, and which requests need the console's header."""

from __future__ import annotations

import json

import pytest
from starlette.requests import Request

from orchestrator.auth.roles import Identity, Role
from orchestrator.server.auth import require_console_header
from orchestrator.server.console import STATIC_DIR, TEMPLATE_DIR, Html, fill, local_path
from orchestrator.server.console_api import event, granted
from orchestrator.server.errors import ApiError


def request(method: str, headers: dict[str, str] | None = None) -> Request:
    raw = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    return Request({"type": "http", "method": method, "path": "/", "headers": raw, "query_string": b""})


def test_templates_escape_values_and_insert_only_marked_markup_as_it_is() -> None:
    page = fill("message.html", heading='<script>alert("x")</script>', message=Html("<b>kept</b>"))
    assert "<script>" not in page and "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in page
    assert "<b>kept</b>" in page


@pytest.mark.parametrize(
    ("target", "goes_to"),
    [
        ("/console/runs/abc?x=1", "/console/runs/abc?x=1"),
        ("//evil.example/x", "/console/runs"),
        ("https://evil.example/", "/console/runs"),
        ("/\\evil.example", "/console/runs"),
        (None, "/console/runs"),
    ],
)
def test_sign_in_returns_to_a_path_on_this_server_only(target: str | None, goes_to: str) -> None:
    assert local_path(target) == goes_to


def test_each_role_is_granted_what_its_buttons_need_and_a_viewer_only_reads() -> None:
    assert granted(Identity("v", Role.VIEWER)) == ["read"]
    operator = granted(Identity("o", Role.OPERATOR))
    assert {"cancel", "redrive", "handle_dead_letters"} <= set(operator) and "approve" not in operator
    approver = granted(Identity("a", Role.APPROVER))
    assert {"approve", "activate", "retire"} <= set(approver) and "cancel" not in approver


def test_an_event_is_one_line_of_json_after_its_name() -> None:
    assert event({"a": [1, "x\ny"]}) == b'data: {"a":[1,"x\\ny"]}\n\n'
    named = event({}, "end").decode()
    assert named.startswith("event: end\ndata: ") and json.loads(named.split("data: ")[1]) == {}


def test_cookie_requests_that_change_something_need_the_console_header() -> None:
    for method in ("GET", "HEAD", "OPTIONS"):
        require_console_header(request(method))
    require_console_header(request("POST", {"X-Saga-Console": "1"}))
    for headers in ({}, {"X-Saga-Console": "0"}):
        with pytest.raises(ApiError) as refused:
            require_console_header(request("POST", headers))
        assert refused.value.status == 403 and refused.value.api_code == "console_header_missing"


def test_every_page_script_and_template_the_console_names_is_shipped() -> None:
    for name in ("console", "sign-in", "runs", "run", "definitions", "definition", "dead-letters", "shards"):
        assert (STATIC_DIR / f"{name}.js").is_file(), name
    assert (STATIC_DIR / "console.css").is_file()
    for name in ("base", "nav", "sign-in", "runs", "run", "definitions", "definition", "message"):
        assert (TEMPLATE_DIR / f"{name}.html").is_file(), name

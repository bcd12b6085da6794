"""Request bodies the server can never store or sign, refused at the door.

JSON may escape a lone UTF-16 surrogate (``"\\ud800"``), which Python decodes into a string that UTF-8
cannot encode: it would fail deep inside (a run id derived from it, a Redis key, a signature, a Lua
call) as a server error. Such a body is refused here, once, with 400 and the error document.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from orchestrator.server.errors import ErrorResponse, document

WITHOUT_BODY = frozenset({"GET", "HEAD", "OPTIONS"})


def unencodable(body: bytes) -> str | None:
    """Why a JSON body cannot be encoded as UTF-8 once decoded (None: it can, or it is not JSON at all,
    which the route's own validation answers)."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"the body holds text that is not valid Unicode ({exc.reason}): send UTF-8 text only"
    except (ValueError, RecursionError):
        return None
    return None


class RefuseUnencodableBodies:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in WITHOUT_BODY:
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        first: Message | None = None
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: let the app see it
                first = message
                break
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        why = unencodable(body) if body else None
        if why is not None:
            await ErrorResponse(document("invalid_request", why, {}), status_code=400)(scope, receive, send)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return first or {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def install(app: Any) -> None:
    app.add_middleware(RefuseUnencodableBodies)

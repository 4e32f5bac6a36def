"""Every HTTP request's id, told to the client: the X-Request-Id it sent (what proxies and clients set
to follow one request through their logs), or one made here; answered in the X-Request-Id header of
every response, refusals included (as OpenAI's API does, and vLLM's with --enable-request-id-headers),
and the base of the answer's own id (`cmpl-ID`, `chatcmpl-ID`, as vLLM takes the header), so the
client's id names the request in the router's logs and traces too."""

from __future__ import annotations

import re
import uuid

from fastapi import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = b"x-request-id"
_SAFE = re.compile(r"[A-Za-z0-9._:/+=-]{1,128}")  # nothing that could forge a log line or a header


class RequestIds:
    """ASGI middleware: scope["state"]["request_id"] for the handlers, the header on the response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v.decode("latin-1") for k, v in scope["headers"] if k == HEADER), "")
        request_id = given if _SAFE.fullmatch(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (HEADER, request_id.encode())]
            await send(message)

        await self.app(scope, receive, send_with_id)


def request_id(request: Request, prefix: str) -> str:
    """The id of the answer to `request`: prefix-ID (an app without the middleware: a fresh one)."""
    return f"{prefix}-{getattr(request.state, 'request_id', None) or uuid.uuid4().hex}"

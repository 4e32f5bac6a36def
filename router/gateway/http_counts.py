"""The HTTP door's count of every answer, by route and status (tandem:http_requests)."""

from __future__ import annotations

import re

from prometheus_client import Counter
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class HTTPCounts:
    """Counts every answer by route and status (tandem:http_requests): a 400 or a 429 never reaches the
    engine's counters. A route with parameters counts under its template (/v1/responses/{response_id}); a
    path no route serves counts as 'other' (the label's values stay few)."""

    def __init__(self, app: ASGIApp, counter: Counter) -> None:
        self.app, self.counter = app, counter
        self.routes: set[str] | None = None  # the app's paths, read at the first request (all routes are in by then)
        self.templates: list[tuple[re.Pattern, str]] = []  # ... and those with parameters

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.routes is None:
            self.routes = {getattr(r, "path", "") for r in scope["app"].routes}
            self.templates = [(r.path_regex, r.path) for r in scope["app"].routes if "{" in getattr(r, "path", "")]
        path = scope["path"]
        route = path if path in self.routes else next((t for rx, t in self.templates if rx.match(path)), "other")

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.counter.labels(route=route, status=str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counted)

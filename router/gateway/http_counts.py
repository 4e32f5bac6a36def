"""The HTTP door's count of every answer, by route and status (tandem:http_requests)."""

from __future__ import annotations

from prometheus_client import Counter
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class HTTPCounts:
    """Counts every answer by route and status (tandem:http_requests): a 400 or a 429 never reaches the
    engine's counters. A path no route serves counts as 'other' (the label's values stay few)."""

    def __init__(self, app: ASGIApp, counter: Counter) -> None:
        self.app, self.counter = app, counter
        self.routes: set[str] | None = None  # the app's paths, read at the first request (all routes are in by then)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.routes is None:
            self.routes = {getattr(r, "path", "") for r in scope["app"].routes}
        route = scope["path"] if scope["path"] in self.routes else "other"

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.counter.labels(route=route, status=str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counted)

"""OpenAI's background responses (`background: true`, stored): the POST answers at once, the request
runs on in the router, and its answer replaces the stored response when it ends. A client that goes
away loses nothing: it reads the result later, follows the events again, or stops it:

    POST /v1/responses {background: true}   -> status "queued"        (stored at once)
                       {..., stream: true}  -> its events as they come (sequence_number 0, 1, ...)
    GET  /v1/responses/{id}                 -> "in_progress" from its first token, then "completed",
                                               "incomplete" (max_output_tokens) or "failed" (its error)
    GET  /v1/responses/{id}?stream=true&starting_after=N
                                            -> a streamed one's events after N, then on as they come
                                               (while it runs, and for the last FOLLOWABLE after)
    POST /v1/responses/{id}/cancel          -> "cancelled": its sequence aborted, its KV freed; a
                                               response that has finished is answered as it finished

Kept in this router's memory like every stored response (router.gateway.responses_store). A router
that drains (SIGTERM) waits for them as for any request in flight."""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import Gauge

from common.logs import bind
from router.core import Delta, RequestError
from router.gateway.http_body import error, public_error
from router.gateway.responses_format import ResponsesFormat
from router.gateway.responses_store import ResponseNotFound, ResponseStore
from router.sequence import RequestStream

FOLLOWABLE = 64  # finished streamed responses whose events are kept for a client that comes back


@dataclass(eq=False)
class _Run:
    stream: RequestStream
    fmt: ResponsesFormat
    events: list[str] | None  # streamed: every event so far, event i has sequence_number i; None: not streamed
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    done: bool = False
    task: asyncio.Task | None = None


class BackgroundResponses:
    def __init__(self, store: ResponseStore, running: Gauge | None = None) -> None:
        """running: the gauge of how many run (tandem:background_responses_running)."""
        self.store = store
        self._running: dict[str, _Run] = {}
        if running is not None:
            running.set_function(lambda: len(self._running))
        self._finished: OrderedDict[str, _Run] = OrderedDict()  # streamed ones, still followable

    def start(self, stream: RequestStream, fmt: ResponsesFormat, streamed: bool) -> dict:
        """Stores the response queued and runs its request; returns the queued response."""
        assert fmt.keep is not None, "a background response is stored"
        queued = fmt.pending("queued")
        fmt.keep(queued)
        run = _Run(stream, fmt, [] if streamed else None)
        run.task = asyncio.create_task(self._run(run))
        self._running[fmt.id] = run
        return queued

    async def _run(self, run: _Run) -> None:
        bind(request_id=run.stream.seq.request.request_id)
        fmt, keep = run.fmt, run.fmt.keep
        assert keep is not None
        deltas: list[Delta] = []
        try:
            if run.events is not None:
                await self._add(run, fmt.opening())
            async for delta in run.stream:
                if delta.error is not None:
                    body = public_error(delta.error)[1]
                    keep(fmt.failed(body["error"]["message"]))
                    if run.events is not None:
                        await self._add(run, [fmt.error_event(body)])
                    return
                if not deltas:
                    keep(fmt.pending("in_progress"))
                deltas.append(delta)
                if run.events is not None:
                    await self._add(run, fmt.events(delta))
            if run.events is not None:
                await self._add(run, fmt.closing(deltas, False))  # stores the finished response (keep)
            else:
                fmt.whole(deltas)  # the same
        finally:
            await self._end(run)

    async def _add(self, run: _Run, events: list[str]) -> None:
        assert run.events is not None
        async with run.changed:
            run.events += events
            run.changed.notify_all()

    async def _end(self, run: _Run) -> None:
        self._running.pop(run.fmt.id, None)
        if run.events is not None:
            self._finished[run.fmt.id] = run
            while len(self._finished) > FOLLOWABLE:
                self._finished.popitem(last=False)
        async with run.changed:
            run.done = True
            run.changed.notify_all()

    def follow(self, response_id: str, starting_after: int = -1) -> AsyncIterator[str]:
        """A streamed background response's events after `starting_after`, then on until it ends.
        RequestError where it did not stream or is no longer followable; ResponseNotFound for another key."""
        self.store.get(response_id)
        run = self._running.get(response_id) or self._finished.get(response_id)
        if run is None or run.events is None:
            raise RequestError("stream", f"{response_id!r} is not a streamed background response this router "
                                         "still follows: GET it without stream")
        return self._follow(run, starting_after + 1)

    @staticmethod
    async def _follow(run: _Run, at: int) -> AsyncIterator[str]:
        events = run.events
        assert events is not None
        while True:
            async with run.changed:
                while len(events) <= at and not run.done:
                    await run.changed.wait()
                new, done = events[at:], run.done
            at += len(new)
            for event in new:
                yield event
            if done and at >= len(events):
                return

    async def cancel(self, response_id: str) -> dict:
        """ResponseNotFound, or RequestError for a response that did not run in the background."""
        stored = self.store.get(response_id)  # not found for another key, running or not
        run = self._running.get(response_id)
        if run is None:
            if not stored.get("background"):
                raise RequestError("response_id", "only a background response can be cancelled")
            return stored
        assert run.task is not None and run.fmt.keep is not None
        run.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await run.task
        await run.stream.aclose()  # its sequences aborted: KV freed in both services
        cancelled = run.fmt.pending("cancelled")
        run.fmt.keep(cancelled)
        return cancelled


def add_background_routes(app: FastAPI, store: ResponseStore, background: BackgroundResponses) -> None:
    """GET /v1/responses/{id} (whole, or a streamed background response's events) and POST .../cancel."""

    def not_found(err: ResponseNotFound) -> JSONResponse:
        return error(404, str(err), "response_id", "not_found_error")

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, stream: bool = False, starting_after: int = -1) -> Response:
        try:
            if stream:
                return StreamingResponse(background.follow(response_id, starting_after),
                                         media_type="text/event-stream")
            return JSONResponse(store.get(response_id))
        except ResponseNotFound as err:
            return not_found(err)
        except RequestError as err:
            return error(400, str(err), err.field)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel(response_id: str) -> JSONResponse:
        try:
            return JSONResponse(await background.cancel(response_id))
        except ResponseNotFound as err:
            return not_found(err)
        except RequestError as err:
            return error(400, str(err), err.field)

"""OpenAI's background responses (`background: true`, stored): the POST answers at once with the
response queued, the request runs on in the router, and its answer replaces the stored response
when it ends. A client that goes away loses nothing; it reads the result later, or stops it:

    POST /v1/responses {background: true}  -> status "queued"      (stored at once)
    GET  /v1/responses/{id}                -> "in_progress" from its first token, then "completed",
                                              "incomplete" (max_output_tokens) or "failed" (its error)
    POST /v1/responses/{id}/cancel         -> "cancelled": its sequence aborted, its KV freed; a
                                              response that has finished is answered as it finished

Not streamed (`background` with `stream` is a 400), and kept in this router's memory like every
stored response (router.gateway.responses_store). A router that drains (SIGTERM) waits for them as
for any request in flight."""

from __future__ import annotations

import asyncio
import contextlib

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from common.logs import bind
from router.core import Delta, RequestError
from router.gateway.http_body import error, public_error
from router.gateway.responses_format import ResponsesFormat
from router.gateway.responses_store import ResponseNotFound, ResponseStore
from router.sequence import RequestStream


class BackgroundResponses:
    def __init__(self, store: ResponseStore) -> None:
        self.store = store
        self._running: dict[str, tuple[asyncio.Task, RequestStream, ResponsesFormat]] = {}

    def start(self, stream: RequestStream, fmt: ResponsesFormat) -> dict:
        """Stores the response queued and runs its request; returns the queued response."""
        assert fmt.keep is not None, "a background response is stored"
        queued = fmt.pending("queued")
        fmt.keep(queued)
        self._running[fmt.id] = (asyncio.create_task(self._run(stream, fmt)), stream, fmt)
        return queued

    async def _run(self, stream: RequestStream, fmt: ResponsesFormat) -> None:
        bind(request_id=stream.seq.request.request_id)
        deltas: list[Delta] = []
        try:
            async for delta in stream:
                if not deltas:
                    fmt.keep(fmt.pending("in_progress"))  # type: ignore[misc]
                deltas.append(delta)
            if deltas and deltas[-1].error is not None:
                fmt.keep(fmt.failed(public_error(deltas[-1].error)[1]["error"]["message"]))  # type: ignore[misc]
            else:
                fmt.whole(deltas)  # stores the finished response (fmt.keep)
        finally:
            self._running.pop(fmt.id, None)

    async def cancel(self, response_id: str) -> dict:
        """ResponseNotFound, or RequestError for a response that did not run in the background."""
        running = self._running.pop(response_id, None)
        if running is None:
            stored = self.store.get(response_id)
            if not stored.get("background"):
                raise RequestError("response_id", "only a background response can be cancelled")
            return stored
        task, stream, fmt = running
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await stream.aclose()  # its sequences aborted: KV freed in both services
        cancelled = fmt.pending("cancelled")
        fmt.keep(cancelled)  # type: ignore[misc]
        return cancelled


def add_cancel_route(app: FastAPI, background: BackgroundResponses) -> None:
    """POST /v1/responses/{id}/cancel."""

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel(response_id: str) -> JSONResponse:
        try:
            return JSONResponse(await background.cancel(response_id))
        except ResponseNotFound as err:
            return error(404, str(err), "response_id", "not_found_error")
        except RequestError as err:
            return error(400, str(err), err.field)

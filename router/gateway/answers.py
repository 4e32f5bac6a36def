"""An answer as the HTTP door sends it: streamed as server-sent events (the format's opening, events
and closing), or whole once the request is done. A client that goes away aborts its request, which
frees its KV in both services."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from common.logs import bind
from router.core import Delta
from router.gateway.http_body import error_response, public_error
from router.sequence import RequestStream, report


async def respond(request: Request, body, stream: RequestStream, fmt) -> Response:  # noqa: ANN001
    """The answer to a request whose stream is `stream`, in the shape of `fmt` (body: the parsed request)."""
    bind(request_id=stream.seq.request.request_id)  # every line this request's task logs from here on
    if stream.seq.request.tandem_metrics:
        fmt.metrics = functools.partial(report, stream.seq)
    fmt.prompt_top = getattr(body, "prompt_logprobs", None)  # vLLM's, where the body has it
    if body.stream:
        fmt.continuous_usage = body.continuous_usage
        return StreamingResponse(sse(fmt, stream, body.include_usage), media_type="text/event-stream")
    return await collect(request, fmt, stream)

async def sse(fmt, stream: RequestStream, usage: bool) -> AsyncIterator[str]:  # noqa: ANN001
    seen: list[Delta] = []
    failed = False
    try:
        for event in fmt.opening():
            yield event
        async for delta in stream:
            if delta.error is not None:
                yield fmt.error_event(public_error(delta.error)[1])
                failed = True
                break
            for event in fmt.events(delta):
                yield event
            seen.append(delta)
        for event in fmt.closing(seen, usage, failed):
            yield event
    finally:
        await stream.aclose()  # a client that went away frees its KV in both services

async def collect(request: Request, fmt, stream: RequestStream) -> Response:  # noqa: ANN001
    deltas: list[Delta] = []

    async def drain() -> None:
        async for d in stream:
            deltas.append(d)

    task = asyncio.create_task(drain())
    while not task.done():
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if not done and await request.is_disconnected():
            task.cancel()
            await stream.aclose()
            return Response(status_code=499)
    if deltas[-1].error is not None:
        return error_response(deltas[-1].error)
    return JSONResponse(fmt.whole(deltas))

"""Unary calls over one long-lived bidi stream (the target's StepStream, the draft's ProposeStream):
one request in, its response out, in order. A message each way per call instead of a call's setup
roughly halves the round trip on loopback. The caller keeps the stream open while it has work.

A failing call ends the stream with that call's status and trailing metadata (the handler aborts,
as the unary RPC would); the caller opens a new stream for what follows. Each request carries its
own deadline (timeout_ms). Shutting down ends a stream waiting for its next call at once, and one
in a call after that call."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc


class CallStreams:
    """The open streams of one servicer: each served by `serve`, all ended by `close` at shutdown."""

    def __init__(self) -> None:
        self._closing = False
        self._waiting: set[asyncio.Task] = set()  # handlers waiting for their stream's next request

    async def serve(self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext,
                    handle: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]) -> None:
        """The stream's handler: `handle` (an @rpc_errors method) answers each request in turn."""
        task = asyncio.current_task()
        assert task is not None
        while not self._closing:
            self._waiting.add(task)
            try:
                request = await context.read()
            except asyncio.CancelledError:
                if self._closing:
                    return  # close(): the caller reads the end of the stream
                raise
            finally:
                self._waiting.discard(task)
            if request is grpc.aio.EOF:
                return
            await context.write(await handle(request, context))

    def close(self) -> None:
        """Shutdown began: no stream is kept open for a next call (serve()'s on_shutdown)."""
        self._closing = True
        for task in self._waiting:
            task.cancel()


def request_deadline(request: Any) -> float | None:
    """A streamed request's absolute deadline (monotonic) from its timeout_ms; None: no limit."""
    return time.monotonic() + request.timeout_ms / 1000 if request.timeout_ms else None

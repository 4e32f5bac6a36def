"""A request's own span, tandem.request, and its queue spans (router.tracing has the whole trace's
shape and the spans of its steps). It lives on the request's figures (router.request_stats), which
open and close its queue spans as the request waits and runs."""

from __future__ import annotations

from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode

from router.core import FinishReason, Request


class RequestTrace:
    def __init__(self, tracer: trace.Tracer, request: Request, seq_id: int, replica: str,
                 parent: Context | None) -> None:
        """parent None: the current context (the HTTP door's span, when FastAPI traces it)."""
        self.tracer = tracer
        self.span = tracer.start_span("tandem.request", context=parent, kind=SpanKind.INTERNAL, attributes={
            "tandem.request_id": request.request_id, "tandem.seq_id": seq_id,
            "gen_ai.request.max_tokens": request.max_tokens or 0,
            "gen_ai.request.temperature": request.sampling.temperature or 0.0,
            "gen_ai.usage.input_tokens": len(request.prompt_ids),
            "tandem.replica": replica})
        self.context = trace.set_span_in_context(self.span)
        self.queue: trace.Span | None = None
        self.queued()

    def queued(self) -> None:
        if self.queue is None:
            self.queue = self.tracer.start_span("queue", context=self.context)

    def dispatched(self) -> None:
        if self.queue is not None:
            self.queue.end()
            self.queue = None

    def finish(self, reason: FinishReason, output_tokens: int, figures: dict[str, Any],
               error: Exception | None) -> None:
        """figures: the request's (router.sequence.report), each as a tandem.* attribute."""
        self.dispatched()
        span = self.span
        span.set_attribute("gen_ai.response.finish_reasons", [reason.value])
        span.set_attribute("gen_ai.usage.output_tokens", output_tokens)
        for key, value in figures.items():
            span.set_attribute(f"tandem.{key}", value)
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        span.end()

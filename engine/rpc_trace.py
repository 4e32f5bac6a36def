"""What a model service records about each RPC: log fields (the sequences it carries, the trace it
belongs to: common.logs) and, when tracing, a SERVER span in the caller's trace whose child is the
model thread's work:

    tandem.v1.TargetService/Step   SERVER: the whole call; tandem.forward_ms, tandem.seq_ids
    └ forward                      the model thread's work (forward pass, sampling); the gap before it
                                   is the wait for the thread (a call queued behind another)

Calls that carry no trace context (GetInfo, Release, a router that does not trace) get no span,
so a service traces exactly the calls of the traces its router samples, and costs nothing else.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, TypeVar

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from common.logs import log_context
from common.tracing import Tracing, extract

log = logging.getLogger(__name__)
T = TypeVar("T")
_TRACER: ContextVar[trace.Tracer | None] = ContextVar("tandem_rpc_tracer", default=None)  # set in traced calls
_ANNOTATED = ("forward_ms", "forwards", "free_blocks")  # response fields copied onto the SERVER span


def seq_ids(request: Any) -> list[int]:
    """The sequences a Step, Propose, Sync or Release is about."""
    fields = request.DESCRIPTOR.fields_by_name
    for name in ("entries", "chunks"):
        if name in fields:
            return [e.seq_id for e in getattr(request, name)]
    return list(request.seq_ids) if "seq_ids" in fields else []


def _trace_id(metadata: tuple) -> str | None:
    """From the caller's traceparent (00-TRACEID-SPANID-FLAGS), whether or not this service traces."""
    for key, value in metadata:
        if key == "traceparent":
            parts = value.split("-")
            return parts[1] if len(parts) == 4 and len(parts[1]) == 32 else None
    return None


@contextmanager
def rpc_scope(tracing: Tracing | None, name: str, request: Any,
              context: grpc.aio.ServicerContext) -> Iterator[trace.Span | None]:
    metadata = tuple(context.invocation_metadata() or ())
    trace_id = _trace_id(metadata)
    fields: dict[str, Any] = {"seq_ids": seq_ids(request)}
    if trace_id is not None:
        fields["trace_id"] = trace_id
    parent = extract(metadata) if tracing is not None and trace_id is not None else None
    with log_context(**fields):
        t0 = time.perf_counter()
        if parent is None:
            yield None
            log.debug("%s: %.1f ms", name, (time.perf_counter() - t0) * 1e3)
            return
        service, method = name.rsplit("/", 1)
        span = tracing.tracer.start_span(name, context=parent, kind=SpanKind.SERVER, attributes={
            "rpc.system": "grpc", "rpc.service": service, "rpc.method": method, "tandem.seq_ids": fields["seq_ids"]})
        attached = otel_context.attach(trace.set_span_in_context(span))
        tracer = _TRACER.set(tracing.tracer)
        try:
            yield span
        except BaseException as err:
            cause = err.__context__ if isinstance(err, grpc.aio.AbortError) and err.__context__ else err
            span.set_status(Status(StatusCode.ERROR, f"{type(cause).__name__}: {cause}"))
            raise
        finally:
            _TRACER.reset(tracer)
            otel_context.detach(attached)
            span.end()
        log.debug("%s: %.1f ms", name, (time.perf_counter() - t0) * 1e3)


def annotate(span: trace.Span | None, response: Any) -> None:
    if span is None:
        return
    fields = response.DESCRIPTOR.fields_by_name
    for name in _ANNOTATED:
        if name in fields:
            span.set_attribute(f"tandem.{name}", getattr(response, name))


def on_model_thread(fn: Callable[[], T]) -> Callable[[], T]:
    """fn as the model thread runs it: inside a `forward` span when the calling RPC is traced.
    Run it in a copy of the caller's context (contextvars.copy_context().run): that is where the
    span, the tracer and the log fields are."""

    def run() -> T:
        tracer = _TRACER.get()
        if tracer is None:
            return fn()
        with tracer.start_as_current_span("forward"):
            return fn()

    return run

"""OpenTelemetry tracing for Tandem's processes: off unless --otlp-traces-endpoint is given.

Each process (router, target, draft) owns one TracerProvider named by its `service.name`, never
the global one: three of them can share a test process, each exporting to its own exporter, and
no library that happens to use the global API starts tracing behind the operator's back.
Trace context crosses processes as W3C `traceparent`/`tracestate` in gRPC metadata (and HTTP
headers at the router's door). Sampling follows the SDK's environment variables
(OTEL_TRACES_SAMPLER=parentbased_traceidratio, OTEL_TRACES_SAMPLER_ARG=0.1, ...).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()
TRACE_HEADERS = ("traceparent", "tracestate")
Metadata = tuple[tuple[str, str], ...]


class Tracing:
    """One process's tracer and the provider behind it."""

    def __init__(self, service_name: str, exporter: SpanExporter, batch: bool = True) -> None:
        self.service_name = service_name
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self.provider.add_span_processor(BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter))
        self.tracer: trace.Tracer = self.provider.get_tracer("tandem")

    @classmethod
    def otlp(cls, service_name: str, endpoint: str) -> Tracing:
        """Batched export over OTLP/gRPC (http://host:4317 is plaintext, https:// is TLS)."""
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return cls(service_name, OTLPSpanExporter(endpoint=endpoint, insecure=endpoint.startswith("http://")))

    def shutdown(self) -> None:
        """Export what is still buffered, then stop."""
        self.provider.shutdown()


def inject(span: trace.Span) -> Metadata:
    """gRPC metadata that makes `span` the parent of the callee's spans."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return tuple(carrier.items())


def extract(headers: Mapping[str, str] | Iterable[tuple[str, str]]) -> Context | None:
    """The caller's context from gRPC metadata or HTTP headers; None when the call carries none."""
    pairs = headers.items() if isinstance(headers, Mapping) else headers
    carrier = {k.lower(): v for k, v in pairs if k.lower() in TRACE_HEADERS}
    if "traceparent" not in carrier:
        return None
    context = _PROPAGATOR.extract(carrier)
    return context if trace.get_current_span(context).get_span_context().is_valid else None


def add_tracing_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--otlp-traces-endpoint", default="",
                        help="export OpenTelemetry traces over OTLP/gRPC to this collector, e.g. "
                             "http://otel-collector:4317 (empty: tracing off, at no cost). Sampling: the standard "
                             "OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG variables")


def tracing_from_args(args: argparse.Namespace, service_name: str) -> Tracing | None:
    endpoint = args.otlp_traces_endpoint.strip()
    return Tracing.otlp(service_name, endpoint) if endpoint else None

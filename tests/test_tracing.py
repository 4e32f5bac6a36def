"""OpenTelemetry tracing: one request is one trace across router, target and draft, with its
parent/child links intact; a batched call is linked both ways with every request it served; with
tracing off not one span object is made. The three "processes" share this test process (tests.stack
runs each on its own thread and event loop), each with its own TracerProvider named by its
service.name and its own in-memory exporter, so the trace is only whole if the context really
crossed gRPC. test_otlp_export_reaches_a_collector checks the OTLP exporter itself, against a
collector started here."""

from __future__ import annotations

import concurrent.futures as cf
import threading
from concurrent import futures

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.trace import SpanKind

from common.tracing import Tracing
from router.config import RouterConfig
from router.tracing import DRAFT_PROPOSE, TARGET_STEP
from tests.stack import REALISTIC_STEP_S, running_stack, start_draft, start_router, start_target, wait_until

SERVICES = ("tandem-router", "tandem-target", "tandem-draft")
CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
STEP_SPANS = ("prefill_chunk", "decode")


def config(**kw) -> RouterConfig:  # noqa: ANN003
    # dynamic_k off: the tiny pair makes the policy choose k = 0 mostly, and these tests need drafts
    return RouterConfig(max_num_batched_tokens=64, max_num_seqs=8, draft_timeout_s=5.0, dynamic_k=False, **kw)


@pytest.fixture(scope="module")
def traced(model_pair):
    exporters = {name: InMemorySpanExporter() for name in SERVICES}
    tracing = {name: Tracing(name, exporters[name], batch=False) for name in SERVICES}
    target_dir, draft_dir = model_pair
    target, _ = start_target(target_dir, step_delay_s=REALISTIC_STEP_S, tracing=tracing["tandem-target"])
    draft, _ = start_draft(draft_dir, tracing=tracing["tandem-draft"])
    router = start_router(config(tracing=tracing["tandem-router"]), target.address, draft.address,
                          target_dir)
    post(router.url, [3, 1, 4, 1, 5, 9, 2, 6], 8)  # warm-up: the first forwards of a fresh model are slow
    settled(router, exporters)
    try:
        yield router, exporters
    finally:
        router.stop(), target.stop(), draft.stop()


def finished(exporters: dict[str, InMemorySpanExporter]) -> list[ReadableSpan]:
    return [s for e in exporters.values() for s in e.get_finished_spans()]


def service(span: ReadableSpan) -> str:
    return span.resource.attributes["service.name"]


def post(url: str, prompt: list[int], max_tokens: int, headers: dict | None = None) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, headers=headers or {}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def settled(router, exporters: dict, trace_id: int | None = None) -> list[ReadableSpan]:  # noqa: ANN001
    """The spans (of one trace) once every call has ended: the draft may still be preparing the
    next step when the client has its answer, a client span ends after its server span, and the
    router's HTTP server span may end after the client has read the response."""
    def spans() -> list[ReadableSpan]:
        return [s for s in finished(exporters) if trace_id is None or s.context.trace_id == trace_id]

    def done() -> bool:
        now = spans()
        requests = {s.context.trace_id for s in now if s.name == "tandem.request"}
        client_calls = sum(1 for s in now if s.kind == SpanKind.CLIENT)
        server_calls = sum(1 for s in now if s.kind == SpanKind.SERVER and service(s) != "tandem-router")
        http = {s.context.trace_id for s in now if s.kind == SpanKind.SERVER and service(s) == "tandem-router"}
        idle = all(lane.draft.idle for lane in router.server.engine.lanes.values())
        return idle and bool(requests) and requests <= http and client_calls == server_calls
    assert wait_until(done, timeout=30), sorted(s.name for s in spans())
    return spans()


def test_one_request_is_one_trace_across_router_target_and_draft(traced):
    router, exporters = traced
    for e in exporters.values():
        e.clear()
    out = post(router.url, [5, 17, 29, 41, 53, 65, 77, 89, 101, 113], 12,
               headers={"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"})
    spans = settled(router, exporters, int(CALLER_TRACE, 16))
    others = [(s.name, service(s), s.context.trace_id, s.parent) for s in finished(exporters) if s not in spans]
    assert not others, "every span of the three processes is in the caller's trace"
    assert {service(s) for s in spans} == set(SERVICES)

    by_id = {s.context.span_id: s for s in spans}
    roots = [s for s in spans if s.parent is None or s.parent.span_id not in by_id]
    assert len(roots) == 1 and roots[0].parent.span_id == int(CALLER_SPAN, 16), [s.name for s in roots]
    http = roots[0]
    assert (service(http), http.kind) == ("tandem-router", SpanKind.SERVER)

    def parent(span: ReadableSpan) -> ReadableSpan:
        return by_id[span.parent.span_id]

    (request,) = [s for s in spans if s.name == "tandem.request"]
    assert parent(request) is http
    assert request.attributes["tandem.request_id"] == out["id"]
    assert request.attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert request.attributes["gen_ai.usage.output_tokens"] == 12
    assert request.attributes["tandem.num_draft_tokens"] >= 0  # the request's figures (request_stats)
    children = [s for s in spans if s.parent and s.parent.span_id == request.context.span_id]
    # a draft call made before a step (a pipeline miss filled: router.upfront) is the request's own
    assert {s.name for s in children} - {DRAFT_PROPOSE} == {"queue", "prefill_chunk", "decode"}
    # the prompt's last chunk emits the first token; the decodes the rest (a last one may overshoot max_tokens)
    assert sum(s.attributes["tandem.emitted"] for s in children if s.name == "decode") + 1 >= 12

    for method, callee in ((TARGET_STEP, "tandem-target"), (DRAFT_PROPOSE, "tandem-draft")):
        servers = [s for s in spans if s.name == method and s.kind == SpanKind.SERVER]
        assert servers and all(service(s) == callee for s in servers), method
        for server in servers:
            client = parent(server)
            assert (client.name, client.kind, service(client)) == (method, SpanKind.CLIENT, "tandem-router")
            assert parent(client) is request and method == DRAFT_PROPOSE or \
                parent(client).name in STEP_SPANS and parent(parent(client)) is request
            (forward,) = [s for s in spans if s.parent and s.parent.span_id == server.context.span_id]
            assert (forward.name, service(forward)) == ("forward", callee)
            assert server.start_time <= forward.start_time <= forward.end_time <= server.end_time
        assert all("tandem.forward_ms" in s.attributes for s in servers)


def test_a_batched_step_links_every_request_it_served_both_ways(traced):
    router, exporters = traced
    for e in exporters.values():
        e.clear()
    prompts = [[(3 * i + 7 * j) % 300 + 2 for j in range(12 + 5 * i)] for i in range(3)]
    barrier = threading.Barrier(len(prompts))

    def one(prompt: list[int]) -> dict:
        barrier.wait()
        return post(router.url, prompt, 16)

    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(one, prompts))
    assert wait_until(lambda: len([s for s in finished(exporters) if s.name == "tandem.request"]) == len(outs))
    spans = {s.context.span_id: s for s in settled(router, exporters)}
    requests = {s.context.trace_id for s in spans.values() if s.name == "tandem.request"}
    assert len(requests) == len(outs), "one trace per request"
    shared = [s for s in spans.values() if s.name == TARGET_STEP and s.kind == SpanKind.CLIENT and s.links]
    assert shared, "concurrent requests shared target steps"
    for call in shared:
        for link in call.links:
            other = spans[link.context.span_id]
            assert other.name in STEP_SPANS and other.context.trace_id != call.context.trace_id
            assert any(back.context.span_id == call.context.span_id for back in other.links), "linked back"
        own = spans[call.parent.span_id]
        assert own.name in STEP_SPANS and own.context.trace_id == call.context.trace_id


def count_spans(monkeypatch) -> list[str]:  # noqa: ANN001
    """The class name of every span object made from now on, recording or not, in any thread."""
    from opentelemetry import trace
    from opentelemetry.sdk import trace as sdk_trace

    made = []
    for cls in (sdk_trace.Span, trace.NonRecordingSpan):
        init = cls.__init__

        def counting(self, *args, __init=init, **kwargs):  # noqa: ANN001, ANN002, ANN003
            made.append(type(self).__name__)
            __init(self, *args, **kwargs)

        monkeypatch.setattr(cls, "__init__", counting)
    return made


def test_an_unsampled_request_costs_no_span_per_step(traced, monkeypatch):
    """A caller that does not sample (traceparent flags 00): a few spans for the request, none per
    step in the router, and no trace context sent on, so the services make none."""
    router, exporters = traced
    made = count_spans(monkeypatch)
    out = post(router.url, [2, 7, 1, 8, 2, 8, 1, 8], 24, headers={"traceparent": f"00-{'5' * 32}-{CALLER_SPAN}-00"})
    assert out["usage"]["completion_tokens"] == 24
    assert wait_until(lambda: all(lane.draft.idle for lane in router.server.engine.lanes.values()))
    assert set(made) == {"NonRecordingSpan"} and len(made) <= 4, made  # HTTP, tandem.request, queue (twice at most)
    assert not [s for s in finished(exporters) if s.context.trace_id == int("5" * 32, 16)]


def test_tracing_off_makes_no_span_objects(model_pair, monkeypatch):
    """With tracing off, the step path makes no span object at all, recording or not."""
    from opentelemetry.sdk import trace as sdk_trace

    made = count_spans(monkeypatch)
    with running_stack(model_pair, config()) as s:
        out = post(s["router"].url, [9, 8, 7, 6, 5, 4, 3, 2], 16, headers={"traceparent": f"00-{CALLER_TRACE}-"
                                                                                           f"{CALLER_SPAN}-01"})
        assert out["usage"]["completion_tokens"] == 16
    assert made == []
    Tracing("spy-check", InMemorySpanExporter(), batch=False).tracer.start_span("a").end()
    sdk_trace.TracerProvider(sampler=ALWAYS_OFF).get_tracer("spy-check").start_span("b").end()  # not sampled
    assert made == ["_Span", "NonRecordingSpan"], "the spy sees both kinds"


class _Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []

    def Export(self, request, context):  # noqa: ANN001, ANN201, N802
        self.requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()


def test_otlp_export_reaches_a_collector():
    collector = _Collector()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        tracing = Tracing.otlp("tandem-test", f"http://127.0.0.1:{port}")
        with tracing.tracer.start_as_current_span("hello"):
            pass
        tracing.shutdown()  # flushes the batch
    finally:
        server.stop(0)
    (request,) = collector.requests
    (resource_spans,) = request.resource_spans
    names = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
    assert names["service.name"] == "tandem-test"
    assert [s.name for ss in resource_spans.scope_spans for s in ss.spans] == ["hello"]

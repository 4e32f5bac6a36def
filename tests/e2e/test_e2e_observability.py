"""Observability end to end: the three processes started with --otlp-traces-endpoint (an OTLP/gRPC
collector run by this test) and --log-format json. One request is one trace made of spans from all
three processes, parent/child links intact once they meet at the collector; every log line is
JSON, and the router's lines about the request carry its id."""

from __future__ import annotations

import json
import os
import re
import time
from collections import defaultdict
from concurrent import futures

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from router.stack import Stack, free_port

CALLER_TRACE = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN = "b7ad6b7169203331"
TEXT_LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) ")


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[tuple[str, object]] = []  # (service.name, Span)

    def Export(self, request, context):  # noqa: ANN001, ANN201, N802
        for rs in request.resource_spans:
            name = next(a.value.string_value for a in rs.resource.attributes if a.key == "service.name")
            self.spans += [(name, s) for ss in rs.scope_spans for s in ss.spans]
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture(scope="module")
def observed(models_dir, tmp_path_factory):
    if os.environ.get("TANDEM_E2E_K8S") == "1":
        pytest.skip("needs its own processes, started with an OTLP endpoint this test serves")
    collector = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    logs = tmp_path_factory.mktemp("observed-logs")
    observe = ["--log-format", "json", "--otlp-traces-endpoint", f"http://127.0.0.1:{port}", "--log-level", "DEBUG"]
    s = Stack(models_dir / "target", models_dir / "draft", served_model_name=models_dir.name,
              http_port=free_port(), grpc_port=free_port(), target_port=free_port(), draft_port=free_port(),
              log_dir=logs, service_args=["--num-blocks", "256", "--threads", "1", *observe],
              router_args=["--max-num-batched-tokens", "64", "--no-dynamic-k", *observe])
    try:
        s.start(timeout=120)
        deadline = time.monotonic() + 60  # /ready needs the target only; this test needs the draft too
        while not httpx.get(f"{s.url}/ready", timeout=5).json().get("draft_available"):
            assert time.monotonic() < deadline, "the draft never came up"
            time.sleep(0.2)
        body = {"model": models_dir.name, "prompt": "def fibonacci(n):\n", "max_tokens": 24, "temperature": 0,
                "tandem_metrics": True}
        r = httpx.post(f"{s.url}/v1/completions", json=body, timeout=120,
                       headers={"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"})
        assert r.status_code == 200, r.text
    finally:
        codes = s.stop()  # each process exports what it still buffers as it stops
        server.stop(0)
    assert all(c == 0 for c in codes.values()), f"unclean shutdown {codes}; logs in {logs}"
    return r.json(), collector.spans, logs


def test_one_request_is_one_trace_across_the_three_processes(observed):
    answer, spans, _ = observed
    mine = [(svc, s) for svc, s in spans if s.trace_id.hex() == CALLER_TRACE]
    assert {svc for svc, _ in mine} == {"tandem-router", "tandem-target", "tandem-draft"}
    by_id = {s.span_id: (svc, s) for svc, s in mine}
    orphans = [s.name for _, s in mine if s.parent_span_id not in by_id]
    assert orphans == ["POST /v1/completions"], f"only the HTTP span has a parent outside the trace: {orphans}"
    (http,) = [s for _, s in mine if s.name == "POST /v1/completions"]
    assert http.parent_span_id.hex() == CALLER_SPAN and by_id[http.span_id][0] == "tandem-router"
    (request,) = [s for _, s in mine if s.name == "tandem.request"]
    attrs = {a.key: a.value for a in request.attributes}
    assert attrs["tandem.request_id"].string_value == answer["id"]
    assert attrs["tandem.num_draft_tokens"].int_value == answer["usage"]["tandem_metrics"]["num_draft_tokens"]
    children = defaultdict(list)
    for svc, s in mine:
        children[s.parent_span_id].append((svc, s.name))
    for svc, s in mine:
        if s.kind == s.SPAN_KIND_SERVER and svc != "tandem-router":
            caller_svc, caller = by_id[s.parent_span_id]
            assert (caller_svc, caller.name) == ("tandem-router", s.name), "a service's span is its caller's child"
            assert (svc, "forward") in children[s.span_id]


def test_every_log_line_is_json_and_names_its_request(observed):
    answer, _, logs = observed
    records = defaultdict(list)
    for name in ("router", "target", "draft"):
        for line in (logs / f"{name}.log").read_text().splitlines():
            assert not TEXT_LOG_LINE.match(line), f"{name}: a text log line: {line}"
            if line.startswith("{"):
                records[name].append(json.loads(line))
    about = [r for r in records["router"] if r.get("request_id") == answer["id"]]
    assert {r["message"].split(" ", 1)[0] for r in about} >= {"queued", "finished"}
    calls = [r for name in ("target", "draft") for r in records[name] if r["logger"] == "engine.rpc_trace"]
    assert calls and all(r["trace_id"] == CALLER_TRACE and r["seq_ids"] for r in calls
                         if "/Step" in r["message"] or "/Propose" in r["message"])

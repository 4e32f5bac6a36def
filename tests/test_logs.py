"""Structured logs (--log-format json): one JSON object per line, and every line about a request
names it: the router's lines carry its request id (and sequence id), the services' lines the ids
of the sequences in the call and the id of the trace the call belongs to."""

from __future__ import annotations

import concurrent.futures as cf
import io
import json
import logging
import re

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from common.logs import handler, log_context
from common.tracing import Tracing
from router.config import RouterConfig
from tests.stack import REALISTIC_STEP_S, start_draft, start_router, start_target, wait_until


def test_a_json_line_carries_its_context_and_traceback():
    stream = io.StringIO()
    log = logging.getLogger("tandem.test.logs")
    log.addHandler(handler("json", stream))
    log.propagate = False
    log.setLevel(logging.INFO)
    try:
        with log_context(request_id="cmpl-1", trace_id="ab" * 16):
            log.warning("about %s", "it")
            with log_context(seq_ids=[3, 4]):
                try:
                    raise ValueError("boom")
                except ValueError:
                    log.exception("failed")
        log.info("outside", extra={"request_id": "cmpl-2"})
    finally:
        log.handlers.clear()
        log.propagate = True
    first, second, third = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["message"] == "about it" and first["level"] == "WARNING" and first["logger"] == "tandem.test.logs"
    assert (first["request_id"], first["trace_id"]) == ("cmpl-1", "ab" * 16) and "seq_ids" not in first
    assert second["seq_ids"] == [3, 4] and "ValueError: boom" in second["exception"]
    assert third["request_id"] == "cmpl-2" and "trace_id" not in third
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00", first["ts"])


@pytest.fixture()
def captured():
    """Every record of the test process, as JSON lines."""
    stream = io.StringIO()
    root = logging.getLogger()
    h, level = handler("json", stream), root.level
    root.addHandler(h)
    root.setLevel(logging.DEBUG)
    try:
        yield stream
    finally:
        root.removeHandler(h)
        root.setLevel(level)


def test_every_line_about_a_request_names_it(model_pair, captured):
    exporter = InMemorySpanExporter()
    tracing = {name: Tracing(name, exporter, batch=False) for name in ("tandem-router", "tandem-target",
                                                                         "tandem-draft")}
    target_dir, draft_dir = model_pair
    # 15 blocks of 16 tokens: no two of these sequences fit together to their end, so one is preempted
    # whichever arrive first (with 18, the two shortest did, and a run under load preempted nobody)
    target, _ = start_target(target_dir, num_blocks=15, step_delay_s=REALISTIC_STEP_S,
                             tracing=tracing["tandem-target"])
    draft, _ = start_draft(draft_dir, tracing=tracing["tandem-draft"])
    config = RouterConfig(max_num_batched_tokens=64, max_num_seqs=8, dynamic_k=False,
                          tracing=tracing["tandem-router"])
    router = start_router(config, target.address, draft.address, target_dir)
    try:
        def one(i: int) -> str:
            body = {"model": "tiny", "prompt": [(3 * i + 7 * j) % 300 + 2 for j in range(60 + 8 * i)],
                    "max_tokens": 56, "temperature": 0, "ignore_eos": True}
            r = httpx.post(f"{router.url}/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["id"]

        with cf.ThreadPoolExecutor(6) as pool:
            ids = set(pool.map(one, range(6)))
        requests = {}  # request id -> (seq id, trace id)
        assert wait_until(lambda: sum(s.name == "tandem.request" for s in exporter.get_finished_spans()) == 6)
        for s in exporter.get_finished_spans():
            if s.name == "tandem.request":
                requests[s.attributes["tandem.request_id"]] = (s.attributes["tandem.seq_id"],
                                                               format(s.context.trace_id, "032x"))
    finally:
        router.stop(), target.stop(), draft.stop()
    assert set(requests) == ids
    lines = [json.loads(line) for line in captured.getvalue().splitlines()]
    by_seq = {seq: rid for rid, (seq, _) in requests.items()}
    by_trace = {trace: seq for seq, trace in requests.values()}

    for rid, (seq, _) in requests.items():  # the router's own lines about each request
        mine = [x for x in lines if x.get("request_id") == rid]
        assert {m["message"].split(" ", 1)[0] for m in mine} >= {"queued", "finished"}, rid
        assert all(m.get("seq_id") == seq for m in mine if m["logger"].startswith("router."))

    mentions = [(x, int(m.group(1))) for x in lines for m in re.finditer(r"\bseq (\d+)\b", x["message"])]
    preempted = [x for x, _ in mentions if x["message"].startswith("preempted")]
    assert preempted, "the small KV cache preempted someone"
    for line, seq in mentions:  # a line that names a sequence is about its request
        if seq in by_seq:
            assert line.get("request_id") == by_seq[seq], line

    calls = [x for x in lines if x["logger"] == "engine.rpc_trace" and ("/Step" in x["message"]
                                                                        or "/Propose" in x["message"])]
    assert calls, "the services log each call at DEBUG"
    for call in calls:  # a service's line names the call's sequences and its trace
        assert call["seq_ids"] and set(call["seq_ids"]) <= set(by_seq), call
        assert by_trace[call["trace_id"]] in call["seq_ids"], "the trace is one of the call's requests'"

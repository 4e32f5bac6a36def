"""Per-request figures (`tandem_metrics`: usage.tandem_metrics over HTTP, RequestMetrics in gRPC's
last message): over a concurrent load through every door, with a KV cache small enough to preempt,
they add up exactly to the increase of the aggregate counters on /metrics; each one is consistent
in itself; and nobody gets them without asking."""

from __future__ import annotations

import concurrent.futures as cf
import json

import grpc
import httpx
import pytest
from google.protobuf.json_format import MessageToDict
from prometheus_client.parser import text_string_to_metric_families

from router.config import RouterConfig
from tandem.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from tests.stack import REALISTIC_STEP_S, start_draft, start_router, start_target

PROMPT_LENGTHS = (40, 55, 70, 85, 100, 62, 47, 93, 12, 30)
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def router(model_pair):
    target_dir, draft_dir = model_pair
    target, _ = start_target(target_dir, num_blocks=24, step_delay_s=REALISTIC_STEP_S)  # 384 slots: it preempts
    draft, _ = start_draft(draft_dir)
    config = RouterConfig(max_num_batched_tokens=64, max_num_seqs=8, draft_timeout_s=5.0, dynamic_k=False)
    router = start_router(config, target.address, draft.address, target_dir)
    try:
        yield router
    finally:
        router.stop(), target.stop(), draft.stop()


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample on /metrics: (name, sorted labels) -> value."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def prompt(i: int) -> list[int]:
    return [(5 * i + 11 * j) % 300 + 2 for j in range(PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)])]


def body(i: int, **extra) -> dict:  # noqa: ANN003
    return {"model": "tiny", "prompt": prompt(i), "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            **extra}


def http_whole(url: str, i: int) -> tuple[dict, dict]:
    r = httpx.post(f"{url}/v1/completions", json=body(i, tandem_metrics=True), timeout=120)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    return usage, usage["tandem_metrics"]


def http_chat(url: str, i: int) -> tuple[dict, dict]:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "def f(x):" * (i + 1)}],
            "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "tandem_metrics": True}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    return usage, usage["tandem_metrics"]


def http_stream(url: str, i: int) -> tuple[dict, dict]:
    """Asking for tandem_metrics is enough to get the final usage chunk."""
    with httpx.stream("POST", f"{url}/v1/completions", json=body(i, stream=True, tandem_metrics=True),
                      timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    (usage,) = [e["usage"] for e in events if e.get("usage")]
    assert events[-1].get("usage") == usage, "usage comes last"
    return usage, usage["tandem_metrics"]


def grpc_call(address: str, i: int, streaming: bool) -> tuple[dict, dict]:
    req = generate_pb2.GenerateRequest(prompt_token_ids=prompt(i), max_tokens=MAX_TOKENS, ignore_eos=True,
                                       sampling=common_pb2.SamplingParams(temperature=0.0), tandem_metrics=True)
    with grpc.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerateStub(channel)
        msgs = list(stub.Generate(req, timeout=120)) if streaming else [stub.GenerateUnary(req, timeout=120)]
    assert not any(m.HasField("tandem_metrics") for m in msgs[:-1]), "only the last message carries them"
    last = msgs[-1]
    figures = MessageToDict(last.tandem_metrics, preserving_proto_field_name=True,
                            always_print_fields_with_no_presence=True)
    return {"prompt_tokens": last.prompt_tokens, "completion_tokens": last.completion_tokens}, figures


def test_per_request_figures_add_up_to_the_aggregate_counters(router):
    before = scrape(router.url)
    calls = [lambda i: http_whole(router.url, i), lambda i: http_stream(router.url, i),
             lambda i: grpc_call(router.grpc_address, i, streaming=False),
             lambda i: grpc_call(router.grpc_address, i, streaming=True), lambda i: http_chat(router.url, i)]
    with cf.ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda i: calls[i % len(calls)](i), range(len(PROMPT_LENGTHS))))
    after = scrape(router.url)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    def total(field: str) -> float:
        return sum(figures[field] for _, figures in outs)

    assert sum(u["completion_tokens"] for u, _ in outs) == delta("tandem:generation_tokens_total")
    assert sum(u["prompt_tokens"] for u, _ in outs) == delta("tandem:prompt_tokens_total")
    assert total("num_spec_steps") == delta("tandem:spec_decode_num_drafts_total") > 0
    assert total("num_draft_tokens") == delta("tandem:spec_decode_num_draft_tokens_total")
    assert total("num_accepted_draft_tokens") == delta("tandem:spec_decode_num_accepted_tokens_total")
    longest = max(len(f["num_accepted_tokens_per_pos"]) for _, f in outs)
    for pos in range(longest + 1):
        per_request = sum(f["num_accepted_tokens_per_pos"][pos] for _, f in outs
                          if pos < len(f["num_accepted_tokens_per_pos"]))
        assert per_request == delta("tandem:spec_decode_num_accepted_tokens_per_pos_total", position=str(pos))
    assert total("num_decode_steps") == delta("tandem:spec_decode_emitted_tokens_per_step_count")
    assert total("pipeline_lookups") == delta("tandem:pipeline_lookups_total")
    assert total("pipeline_hits") == delta("tandem:pipeline_hits_total")
    assert total("pipeline_misses_late") == delta("tandem:pipeline_misses_total", reason="late")
    assert total("pipeline_misses_wrong") == delta("tandem:pipeline_misses_total", reason="wrong")
    assert total("pipeline_misses_unasked") == delta("tandem:pipeline_misses_total", reason="unasked")
    assert total("num_preemptions") == delta("tandem:num_preemptions_total") > 0
    assert total("queued_seconds") == pytest.approx(delta("tandem:request_queue_time_seconds_sum"), abs=1e-6)
    assert len(outs) == delta("tandem:request_queue_time_seconds_count")


def test_each_request_s_figures_are_consistent(router):
    outs = [http_whole(router.url, i) for i in (0, 4)] + [grpc_call(router.grpc_address, 8, streaming=True)]
    for usage, f in outs:
        hist = f["acceptance_histogram"]
        assert sum(hist) == f["num_spec_steps"] and sum(j * n for j, n in enumerate(hist)) == \
            f["num_accepted_draft_tokens"]
        assert sum(f["num_draft_tokens_per_pos"]) == f["num_draft_tokens"]
        assert sum(f["num_accepted_tokens_per_pos"]) == f["num_accepted_draft_tokens"] <= f["num_draft_tokens"]
        if f["num_spec_steps"]:
            assert f["num_draft_tokens_per_pos"][0] == f["num_spec_steps"]
            assert f["draft_acceptance_rate"] == pytest.approx(f["num_accepted_draft_tokens"] / f["num_draft_tokens"])
            assert f["mean_acceptance_length"] == pytest.approx(1 + f["num_accepted_draft_tokens"] /
                                                                f["num_spec_steps"])
        assert f["pipeline_lookups"] == f["pipeline_hits"] + f["pipeline_misses_late"] + f["pipeline_misses_wrong"] \
            + f["pipeline_misses_unasked"]
        assert f["pipeline_lookups"] <= f["num_decode_steps"] < usage["completion_tokens"]
        assert f["num_prefill_chunks"] >= 1 and f["queued_seconds"] >= 0.0


def test_nobody_gets_the_figures_without_asking(router):
    r = httpx.post(f"{router.url}/v1/completions", json=body(1, max_tokens=4), timeout=60)
    assert r.status_code == 200 and "tandem_metrics" not in r.json()["usage"]
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body(1, max_tokens=4, stream=True),
                      timeout=60) as s:
        assert not any('"usage"' in line for line in s.iter_lines()), "no usage chunk unless asked"
    with grpc.insecure_channel(router.grpc_address) as channel:
        one = generate_pb2_grpc.GenerateStub(channel).GenerateUnary(generate_pb2.GenerateRequest(
            prompt_token_ids=prompt(1), max_tokens=4, ignore_eos=True), timeout=60)
    assert not one.HasField("tandem_metrics")
    r = httpx.post(f"{router.url}/v1/completions", json=body(1, max_tokens=4, tandem_metrics="yes"), timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tandem_metrics"

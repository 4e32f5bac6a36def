"""Stopping the router as Kubernetes does (a real SIGTERM to a real router process) loses no request:
streams in flight run to their last token while new requests are refused, and the router exits as
soon as they are done. SIGINT, a second signal or a drain that runs out abort what still runs with a
clean error in the stream. Every time: exit code 0 and both services' KV blocks all free again."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import time

import grpc
import httpx
import pytest

from router.stack import Stack, free_port
from tandem.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from tests.e2e.test_chaos import assert_nothing_held

PROMPTS = [[(11 * i + 5 * j) % 300 + 2 for j in range(n)] for i, n in enumerate([5, 17, 9, 30, 12, 24])]
LONG = 300  # tokens per stream: long enough that the signal arrives mid-stream
LONGEST = 480  # the gRPC stream's, started first (the model's context: 512)

pytestmark = pytest.mark.skipif(os.environ.get("TANDEM_E2E_K8S") == "1", reason="needs the processes at hand")


@pytest.fixture(scope="module")
def stack(models_dir, tmp_path_factory):
    s = Stack(models_dir / "target", models_dir / "draft", served_model_name="tiny", http_port=free_port(),
              grpc_port=free_port(), target_port=free_port(), draft_port=free_port(),
              log_dir=tmp_path_factory.mktemp("drain-logs"), service_args=["--num-blocks", "512", "--threads", "1"])
    s.start(timeout=120)
    yield s
    s.stop()


def restart_router(stack: Stack, *router_args: str) -> None:
    if "router" in stack.procs and stack.procs["router"].poll() is None:
        stack.kill("router", signal.SIGTERM)
    stack.router_args = list(router_args)
    stack.start_router()
    stack.wait_ready(120)


def stream(stack: Stack, prompt: list[int], started: cf.Future | None = None) -> dict:
    """One streamed completion, read to its end: its tokens, finish reason and error event, if any."""
    out: dict = {"token_ids": [], "finish_reason": None, "error": None, "done": False}
    body = {"model": "tiny", "prompt": prompt, "max_tokens": LONG, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": True}
    with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out["done"] = True
                continue
            event = json.loads(line[6:])
            if "error" in event:
                out["error"] = event["error"]
                continue
            choice = event["choices"][0]
            out["token_ids"] += choice.get("token_ids") or []
            out["finish_reason"] = choice["finish_reason"] or out["finish_reason"]
            if started is not None and not started.done():
                started.set_result(True)
    return out


def streams_in_flight(stack: Stack) -> list[cf.Future]:
    """Every prompt streaming, returned once each has its first tokens."""
    pool = cf.ThreadPoolExecutor(len(PROMPTS))
    started = [cf.Future() for _ in PROMPTS]
    futures = [pool.submit(stream, stack, p, s) for p, s in zip(PROMPTS, started, strict=True)]
    pool.shutdown(wait=False)
    for s in started:
        s.result(timeout=60)
    return futures


def grpc_stream(stack: Stack, prompt: list[int], started: cf.Future) -> tuple[list[int], str]:
    """One streamed gRPC Generate, read to its end: its tokens and finish reason."""
    ids, reason = [], ""
    with grpc.insecure_channel(f"{stack.host}:{stack.grpc_port}") as channel:
        for msg in generate_pb2_grpc.GenerateStub(channel).Generate(generate_pb2.GenerateRequest(
                prompt_token_ids=prompt, max_tokens=LONGEST, ignore_eos=True,
                sampling=common_pb2.SamplingParams(temperature=0)), timeout=120):
            ids += msg.token_ids
            reason = msg.finish_reason or reason
            if not started.done():
                started.set_result(True)
    return ids, reason


def refused(stack: Stack) -> tuple[bool, grpc.StatusCode | None]:
    """A new HTTP request is turned away (the listener closed, or 503), and so is a new gRPC Generate."""
    try:
        http_refused = httpx.post(f"{stack.url}/v1/completions", timeout=10, json={
            "model": "tiny", "prompt": PROMPTS[0], "max_tokens": 4}).status_code == 503
    except httpx.TransportError:
        http_refused = True
    with grpc.insecure_channel(f"{stack.host}:{stack.grpc_port}") as channel:
        try:
            generate_pb2_grpc.GenerateStub(channel).GenerateUnary(generate_pb2.GenerateRequest(
                prompt_token_ids=PROMPTS[0], max_tokens=4, sampling=common_pb2.SamplingParams(temperature=0)),
                timeout=10)
            code = grpc.StatusCode.OK
        except grpc.RpcError as err:
            code = err.code()
    return http_refused, code


def test_sigterm_lets_every_stream_in_flight_finish_and_refuses_new_requests(stack, ref):
    restart_router(stack, "--shutdown-timeout", "120")
    started = cf.Future()
    with cf.ThreadPoolExecutor(1) as pool:
        over_grpc = pool.submit(grpc_stream, stack, PROMPTS[2], started)
        started.result(timeout=60)
        futures = streams_in_flight(stack)
        assert not over_grpc.done(), "the gRPC stream ended before the signal: nothing under test"
        t0 = time.monotonic()
        stack.procs["router"].send_signal(signal.SIGTERM)
        time.sleep(0.5)  # the signal handled: the listener closes, gRPC refuses
        http_refused, grpc_code = refused(stack)
        results = [f.result(timeout=120) for f in futures]
        assert over_grpc.result(timeout=120) == (ref.greedy(PROMPTS[2], LONGEST), "length"), "gRPC's stream too"
    code = stack.procs["router"].wait(60)
    took = time.monotonic() - t0
    for prompt, r in zip(PROMPTS, results, strict=True):
        assert r["error"] is None and r["finish_reason"] == "length" and r["done"], r
        assert r["token_ids"] == ref.greedy(prompt, LONG), "the stream in flight ran to its last token, exact"
    assert http_refused and grpc_code == grpc.StatusCode.UNAVAILABLE
    assert code == 0
    assert took < 60, f"the router exited {took:.0f} s after SIGTERM: it waited for its timeout, not its streams"
    assert_nothing_held(stack)


@pytest.mark.parametrize("signals, timeout", [
    ((signal.SIGINT,), "120"),  # Ctrl-C does not wait
    ((signal.SIGTERM,), "0"),  # a drain of 0 s: vLLM's default behaviour
    ((signal.SIGTERM, signal.SIGTERM), "120"),  # a second signal cuts the drain short
], ids=["sigint", "no-drain", "second-signal"])
def test_a_stop_that_does_not_wait_ends_each_stream_with_a_clean_error(stack, signals, timeout):
    restart_router(stack, "--shutdown-timeout", timeout)
    futures = streams_in_flight(stack)
    t0 = time.monotonic()
    for sig in signals:
        stack.procs["router"].send_signal(sig)
        time.sleep(0.2)
    results = [f.result(timeout=60) for f in futures]
    code = stack.procs["router"].wait(60)
    took = time.monotonic() - t0
    aborted = [r for r in results if r["finish_reason"] != "length"]
    assert aborted, "every stream had finished before the signal: nothing was under test"
    for r in aborted:
        assert r["error"] is not None and r["error"]["code"] == 503 and "shutting down" in r["error"]["message"], r
        assert len(r["token_ids"]) < LONG
    assert code == 0 and took < 30
    assert_nothing_held(stack)
    restart_router(stack)  # the module's stack serves again (with the default drain)

"""A router draining (router.server: what SIGTERM starts) refuses new requests at every door and says
why, while a request already running finishes exactly. The signal itself, on real processes:
tests/e2e/test_drain.py."""

from __future__ import annotations

import concurrent.futures as cf

import grpc
import httpx
import pytest

from router.config import RouterConfig
from tandem.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from tests.conftest import hf_greedy
from tests.stack import complete, running_stack, wait_until


def test_a_draining_router_refuses_new_requests_with_the_reason_and_finishes_the_running_one(model_pair):
    prompt = [(3 * j) % 300 + 2 for j in range(12)]
    with running_stack(model_pair, RouterConfig(max_num_batched_tokens=64, max_num_seqs=8)) as s:
        router, engine = s["router"], s["router"].server.engine
        with cf.ThreadPoolExecutor(1) as pool:
            running = pool.submit(complete, router.url, prompt, 120)
            assert wait_until(lambda: len(engine._seqs) == 1, timeout=30), "the request never started"
            router.loop.call_soon_threadsafe(engine.drain)
            assert wait_until(lambda: engine.draining)
            ready = httpx.get(f"{router.url}/ready", timeout=10)
            draining = httpx.get(f"{router.url}/metrics", timeout=10).text
            health = httpx.get(f"{router.url}/health", timeout=10)
            new = httpx.post(f"{router.url}/v1/completions", timeout=10,
                             json={"model": "tiny", "prompt": prompt, "max_tokens": 4})
            with grpc.insecure_channel(router.grpc_address) as channel, pytest.raises(grpc.RpcError) as refused:
                generate_pb2_grpc.GenerateStub(channel).GenerateUnary(generate_pb2.GenerateRequest(
                    prompt_token_ids=prompt, max_tokens=4, sampling=common_pb2.SamplingParams(temperature=0)),
                    timeout=10)
            done = running.result(timeout=120)
    assert ready.status_code == 503 and "shutting down" in ready.json()["error"]["message"]
    assert health.status_code == 200, "liveness holds while draining: the kubelet must not kill a drain"
    assert "\ntandem:router_draining 1.0" in draining
    assert new.status_code == 503 and "shutting down" in new.json()["error"]["message"]
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in refused.value.details()
    assert done["choices"][0]["token_ids"] == hf_greedy(model_pair[0], prompt, 120)

"""vLLM's --served-model-name with several names: the model answers to each (HTTP and gRPC), /v1/models
lists them, the first first; any other name is a 404 (HTTP) or INVALID_ARGUMENT (gRPC) naming them all."""

from __future__ import annotations

import importlib.metadata

import grpc
import httpx

from router.__main__ import build_parser
from router.config import RouterConfig
from tandem.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from tests.stack import complete, start_router, start_target


def test_the_flag_takes_several_names_and_the_first_leads():
    args = build_parser().parse_args(["--target", "t:1", "--tokenizer", "m", "--served-model-name", "qwen", "gpt-4o"])
    assert args.served_model_name == ["qwen", "gpt-4o"]
    assert build_parser().parse_args(["--target", "t:1", "--tokenizer", "m"]).served_model_name == []


def test_a_model_answers_to_each_of_its_names(model_pair):
    target, _ = start_target(model_pair[0])
    router = start_router(RouterConfig(max_num_batched_tokens=64), target.address, None, model_pair[0],
                          model_name="tiny", aliases=("tiny-latest",))
    try:
        assert [m["id"] for m in httpx.get(f"{router.url}/v1/models").json()["data"]] == ["tiny", "tiny-latest"]
        assert httpx.get(f"{router.url}/version").json()["version"] == importlib.metadata.version("tandem")
        prompt = [5, 17, 33, 8, 90]
        by_alias = complete(router.url, prompt, 6, model="tiny-latest")
        assert by_alias["choices"][0]["token_ids"] == complete(router.url, prompt, 6)["choices"][0]["token_ids"]
        r = httpx.post(f"{router.url}/v1/completions", json={"model": "other", "prompt": prompt, "max_tokens": 2})
        assert r.status_code == 404 and "'tiny-latest'" in r.json()["error"]["message"]
        with grpc.insecure_channel(router.grpc_address) as channel:
            stub = generate_pb2_grpc.GenerateStub(channel)
            out = stub.GenerateUnary(generate_pb2.GenerateRequest(
                prompt_token_ids=prompt, max_tokens=6, model="tiny-latest", ignore_eos=True,
                sampling=common_pb2.SamplingParams(temperature=0.0)), timeout=60)
        assert list(out.token_ids) == by_alias["choices"][0]["token_ids"]
    finally:
        router.stop(), target.stop()
